"""The fault manager: detect a failed worker group, retry, rebuild it, or give up to a reschedule.

The ladder, as the verl FaultMgr RFC lays it out, bounded at every rung:

1. task retries: a call that raised while its workers live is run again on the same workers, up
   to `max_task_retries` times (`enable_retry` off: never);
2. a targeted rebuild of the failed group alone: its processes killed and confirmed gone, new
   ones started, the process group formed again, weights and optimizer state loaded from the
   group's state, and the failed call run again; at most `actor_max_rebuild_times` per group (the
   actor's counter also covers the reference, rebuilt with it). A worker that died, hung or timed
   out goes straight here: in a data-parallel group one lost rank means forming the group again,
   so a restart in place (`max_restarts`) is for single-process groups only. The rollout side is
   a group too (services/trainer/rollout_side.py): its rebuild restarts the engines through the
   shadow supervisors' cold path and re-syncs the weights, at most `rollout_max_rebuild_times`;
3. past its rebuilds, `RescheduleNeeded`: the trainer restarts the whole workflow from its last
   checkpoint, at most `max_reschedule_times` times, and past that the error surfaces naming the
   group, the attempts and the cause. The actor (or the reference) failing together with the
   rollout side, a rollout worker failed within `joint_window_s` of it, goes here directly: the
   weights the rollout would be re-synced from are the ones being rebuilt. The rollout side's
   report (the supervisor's handover, the router's worker_failed) may come a moment after the
   actor's failure is seen, so an actor failure waits up to `joint_grace_s` for it, while the
   rebuild's new processes start (announced only once no joint failure is found; a joint
   failure's reschedule waits for them and stops them again); a hang is
   dated a hang timeout before it was seen. A joint failure with no reschedule left ends the run.

Detection: a worker's exit (an OOM kill is a SIGKILL), an error reply, a call past its timeout,
and a hang: a worker whose heartbeats stop, or whose progress counter and CPU time both stand still,
for `hang_timeout_s`; for the rollout side, no generation finishing for `rollout_timeout_s`. A step that is slow but still progressing is not hung. Every failure and
rebuild is an event with its timings (`group_failed`, `group_rebuilt`; `reschedule` from the
trainer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from belayer_rl.shared.config import setting
from belayer_rl.shared.protocol import GroupFailed, GroupRebuilt

log = logging.getLogger("belayer.trainer.faults")

T = TypeVar("T")
FaultKind = Literal["exit", "exception", "hang", "timeout", "start"]


@dataclass(frozen=True)
class FaultManagerConfig:
    """The `fault_manager` keys. Each bound counts attempts of its own rung, per run."""

    # The fields made by setting() are `belayer train` flags (cli/train.py); the rest are code's.
    enable_retry: bool = setting(True, "enable_retry: a call that raised runs again first", flag="--retry")
    max_restarts: int = setting(1, "restarts in place of a single-process group's worker (the reward's)")
    max_task_retries: int = setting(1, "re-runs of a call that raised, on the same workers")
    actor_max_rebuild_times: int = setting(2, "targeted rebuilds of the actor (with the reference)")
    rollout_max_rebuild_times: int = setting(
        1, "restarts of the rollout engines through the shadow supervisors' cold path"
    )
    max_reschedule_times: int = setting(1, "whole-workflow restarts from the last trainer checkpoint")
    call_timeout_s: float = setting(120.0, "seconds one group call may take")
    hang_timeout_s: float = setting(30.0, "seconds without progress that make a worker hung")
    rollout_timeout_s: float = setting(
        60.0, "seconds without a generation finished that make the rollout side hung"
    )
    start_timeout_s: float = 120.0
    joint_window_s: float = 30.0  # a rollout failure this close to an actor failure: both at once
    joint_grace_s: float = 1.0  # how long an actor failure waits for the rollout side's report
    # Local backend: fork ranks from a process that has torch loaded (a warm start), not start
    # each one cold. Not an RFC key: the RFC's groups are Ray actors.
    warm_start: bool = True

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
        timeouts = (
            self.call_timeout_s,
            self.hang_timeout_s,
            self.rollout_timeout_s,
            self.start_timeout_s,
            self.joint_window_s,
        )
        if min(timeouts) <= 0:
            raise ValueError("fault_manager timeouts and the joint window must be > 0")
        if self.joint_grace_s < 0:
            raise ValueError("fault_manager joint_grace_s must be >= 0")


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
    @property
    def name(self) -> Literal["actor", "reference", "reward", "rollout"]: ...

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
        # The latest rollout failure not yet answered: (wall-clock time, worker, cause).
        self.rollout_failure: tuple[float, tuple[str, int], str] | None = None
        # The rollout workers (engine, pid) whose failure has been answered by a reschedule: the
        # router's worker_failed and the supervisor's handover both report one failure.
        self.answered: set[tuple[str, int]] = set()

    def note_rollout_failure(self, at: float, worker: tuple[str, int], cause: str) -> None:
        """Rollout worker `worker` (engine, pid) failed at wall-clock time `at` (a handover's
        detection time, or when the router's worker_failed arrived)."""
        if worker not in self.answered:
            self.rollout_failure = (at, worker, cause)

    async def joint_with_rollout(self, failed_at: float) -> str | None:
        """The cause of the rollout failure within the joint window of an actor failure at
        `failed_at`, if any, waiting up to the joint grace for one to be reported. A failure
        returned is answered: its worker's later reports are ignored."""
        deadline = time.monotonic() + self.config.joint_grace_s
        while True:
            if self.rollout_failure is not None:
                at, worker, cause = self.rollout_failure
                if abs(failed_at - at) <= self.config.joint_window_s:
                    self.answered.add(worker)  # the reschedule answers both
                    self.rollout_failure = None
                    return cause
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

    def rebuild_bound(self, group: Group) -> int:
        if group.name in ("actor", "reference"):
            return self.config.actor_max_rebuild_times
        if group.name == "rollout":
            return self.config.rollout_max_rebuild_times
        return self.config.max_restarts

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
                joint = None
                if group.name in ("actor", "reference"):
                    # When it failed: a hang began a hang timeout before it was seen.
                    hung_for = self.config.hang_timeout_s if fault.kind == "hang" else 0.0
                    joint = asyncio.create_task(self.joint_with_rollout(time.time() - hung_for))
                try:
                    if (
                        fault.kind == "exception"
                        and self.config.enable_retry
                        and retries < self.config.max_task_retries
                    ):
                        await self.unless_joint(joint, group, attempt, fault)
                        retries += 1
                        continue
                    await self.rebuild(group, unit, step, attempt, fault, joint)
                    retries = 0
                finally:  # a rebuild that failed before the joint check was needed
                    if joint is not None and not joint.done():
                        joint.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await joint

    async def unless_joint(
        self, joint: asyncio.Task[str | None] | None, failed: Group, attempt: int, fault: GroupFault
    ) -> None:
        """Raise RescheduleNeeded if the joint check finds the rollout side failed with `failed`."""
        if joint is not None and (rollout := await joint) is not None:
            raise RescheduleNeeded(
                failed.name, attempt, f"{fault}, with the rollout side: {rollout}"
            ) from fault

    async def rebuild(
        self,
        failed: Group,
        unit: tuple[Group, ...],
        step: int,
        attempt: int,
        fault: GroupFault,
        joint: asyncio.Task[str | None] | None,
    ) -> None:
        """Rebuild `unit` until it is up, within its bound; raises RescheduleNeeded past it, or
        when `joint` (the joint check of an actor failure, running meanwhile) finds the rollout
        side failed with it."""
        group = unit[0]
        cause = str(fault)
        while True:
            if not self.config.enable_retry or group.rebuilds >= self.rebuild_bound(group):
                await self.unless_joint(joint, failed, attempt, fault)
                raise RescheduleNeeded(failed.name, attempt, cause)
            try:
                await self.rebuild_once(unit, step, lambda: self.unless_joint(joint, failed, attempt, fault))
                return
            except GroupFault as again:  # the new processes did not come up
                cause = str(again)
                await self.publish(
                    GroupFailed(
                        run=self.run, group=group.name, rank=again.rank, kind=again.kind, cause=again.cause,
                        step=step, attempt=attempt, detected_s=0.0,
                    ),
                )  # fmt: skip

    async def rebuild_once(
        self, unit: tuple[Group, ...], step: int, unless_joint: Callable[[], Awaitable[None]]
    ) -> None:
        """Stop and start `unit`, then announce the rebuild unless `unless_joint` raises. The new
        processes start while the joint grace runs, since a single failure (the common case) needs
        them; a joint one is rescheduled, and the reschedule stops them again."""
        group = unit[0]
        started = time.monotonic()
        for member in unit:
            await member.stop()
        stopped = time.monotonic()
        group.rebuilds += 1  # counted once tried: a group that never starts must reach its bound
        for member in unit:
            await member.start()
        done = time.monotonic()
        await unless_joint()
        await self.publish(
            GroupRebuilt(
                run=self.run, group=group.name, rebuild=group.rebuilds, step=step,
                stop_s=stopped - started, start_s=done - stopped, total_s=done - started,
            ),
        )  # fmt: skip
        log.info("%s rebuilt (%d) in %.2f s", group.name, group.rebuilds, done - started)
