"""The fault manager: detect a failed worker group, retry, rebuild it, or give up to a reschedule.

The ladder, as the verl FaultMgr RFC lays it out, bounded at every rung:

1. task retries: a call that raised while its workers live is run again on the same workers, up
   to `max_task_retries` times (`enable_retry` off: never);
2. a targeted rebuild of the failed group alone: its processes killed and confirmed gone, new
   ones started, the process group formed again, weights and optimizer state loaded from the
   group's state, and the failed call run again; at most `actor_max_rebuild_times` per group (the
   actor's counter also covers the reference, rebuilt with it). A worker that died, hung or timed
   out goes straight here: in a data-parallel group one lost rank means forming the group again,
   so a restart in place (`max_restarts`) is for single-process groups only;
3. past its rebuilds, `RescheduleNeeded`: the trainer restarts the whole workflow from its last
   checkpoint, at most `max_reschedule_times` times, and past that the error surfaces naming the
   group, the attempts and the cause.

Detection: a worker's exit (an OOM kill is a SIGKILL), an error reply, a call past its timeout,
and a hang: a worker whose heartbeats stop, or whose progress counter and CPU time both stand still,
for `hang_timeout_s`. A step that is slow but still progressing is not hung. Every failure and
rebuild is an event with its timings (`group_failed`, `group_rebuilt`; `reschedule` from the
trainer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from belayer_rl.shared.protocol import GroupFailed, GroupRebuilt

log = logging.getLogger("belayer.trainer.faults")

T = TypeVar("T")
FaultKind = Literal["exit", "exception", "hang", "timeout", "start"]


@dataclass(frozen=True)
class FaultManagerConfig:
    """The `fault_manager` keys. Each bound counts attempts of its own rung, per run."""

    enable_retry: bool = True
    max_restarts: int = 1  # restarts in place of a single-process group's worker
    max_task_retries: int = 1  # re-runs of a call that raised, on the same workers
    actor_max_rebuild_times: int = 2  # targeted rebuilds of the actor (with the reference)
    rollout_max_rebuild_times: int = 1  # restarts of the rollout engines (through the cold path)
    max_reschedule_times: int = 1  # whole-workflow restarts from the last trainer checkpoint
    call_timeout_s: float = 120.0
    hang_timeout_s: float = 30.0
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        bounds = (
            self.max_restarts,
            self.max_task_retries,
            self.actor_max_rebuild_times,
            self.rollout_max_rebuild_times,
            self.max_reschedule_times,
        )
        if min(bounds) < 0:
            raise ValueError(f"fault_manager bounds must be >= 0: {self}")
        if not (self.call_timeout_s > 0 and self.hang_timeout_s > 0 and self.start_timeout_s > 0):
            raise ValueError("fault_manager timeouts must be > 0")


class GroupFault(Exception):
    """A group failed: one of its workers exited, hung, timed out, failed to start, or raised."""

    def __init__(self, kind: FaultKind, rank: int, cause: str) -> None:
        super().__init__(f"{kind} (rank {rank}): {cause}")
        self.kind = kind
        self.rank = rank
        self.cause = cause


class RescheduleNeeded(Exception):
    """A group has used up its rebuilds: only a restart of the whole workflow can go on."""

    def __init__(self, group: str, attempts: int, cause: str) -> None:
        super().__init__(f"group {group} failed {attempts} times; last cause: {cause}")
        self.group = group
        self.attempts = attempts
        self.cause = cause


class FaultBoundExceeded(Exception):
    """Every bound is spent: the one final error, naming the group, the attempts and the cause."""


class Group(Protocol):
    name: Literal["actor", "reference", "reward"]
    rebuilds: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class FaultManager:
    def __init__(
        self,
        config: FaultManagerConfig,
        run: str,
        publish: Callable[[GroupFailed | GroupRebuilt], Awaitable[None]],
    ) -> None:
        self.config = config
        self.run = run
        self.publish = publish  # onto the event's subject

    def rebuild_bound(self, group: Group) -> int:
        return (
            self.config.actor_max_rebuild_times
            if group.name in ("actor", "reference")
            else self.config.max_restarts
        )

    async def call(
        self, group: Group, step: int, do: Callable[[], Awaitable[T]], rebuild: tuple[Group, ...] = ()
    ) -> T:
        """`do()`, a call to `group`, through retries and targeted rebuilds; raises RescheduleNeeded.

        `rebuild`: the groups a rebuild restarts (default: `group` alone; the actor and the
        reference go together). The first of them keeps the count its bound applies to."""
        unit = rebuild or (group,)
        attempt = retries = 0
        while True:
            attempt += 1
            started = time.monotonic()
            try:
                return await do()
            except GroupFault as fault:
                detected_s = time.monotonic() - started
                await self.publish(
                    GroupFailed(
                        run=self.run, group=group.name, rank=fault.rank, kind=fault.kind, cause=fault.cause,
                        step=step, attempt=attempt, detected_s=detected_s,
                    ),
                )  # fmt: skip
                log.warning("%s failed at step %d (%.2f s in): %s", group.name, step, detected_s, fault)
                if (
                    fault.kind == "exception"
                    and self.config.enable_retry
                    and retries < self.config.max_task_retries
                ):
                    retries += 1
                    continue
                await self.rebuild(group, unit, step, attempt, str(fault))
                retries = 0

    async def rebuild(
        self, failed: Group, unit: tuple[Group, ...], step: int, attempt: int, cause: str
    ) -> None:
        """Rebuild `unit` until it is up, within its bound; raises RescheduleNeeded past it."""
        group = unit[0]
        while True:
            if not self.config.enable_retry or group.rebuilds >= self.rebuild_bound(group):
                raise RescheduleNeeded(failed.name, attempt, cause)
            try:
                await self.rebuild_once(unit, step)
                return
            except GroupFault as fault:  # the new processes did not come up
                cause = str(fault)
                await self.publish(
                    GroupFailed(
                        run=self.run, group=group.name, rank=fault.rank, kind=fault.kind, cause=fault.cause,
                        step=step, attempt=attempt, detected_s=0.0,
                    ),
                )  # fmt: skip

    async def rebuild_once(self, unit: tuple[Group, ...], step: int) -> None:
        group = unit[0]
        started = time.monotonic()
        for member in unit:
            await member.stop()
        stopped = time.monotonic()
        group.rebuilds += 1
        for member in unit:
            await member.start()
        done = time.monotonic()
        await self.publish(
            GroupRebuilt(
                run=self.run, group=group.name, rebuild=group.rebuilds, step=step,
                stop_s=stopped - started, start_s=done - stopped, total_s=done - started,
            ),
        )  # fmt: skip
        log.info("%s rebuilt (%d) in %.2f s", group.name, group.rebuilds, done - started)
