"""A trainer group (actor, reference or reward) as local processes, driven over the bus (the local
backend).

Each rank is `python -m belayer_rl.services.trainer_group` in a session of its own, so the group
can be killed whole (SIGKILL to each process group) and its death confirmed before a new one
starts. Ranks form a gloo process group through a rendezvous file that is new for every build,
load the group's state file (written by rank 0 after every step) and heartbeat with their progress.

A call goes to every rank at once and is watched while it runs: a rank's exit, a hang (no
heartbeat, or neither progress nor CPU time moving, for the hang timeout), the call's own timeout
and an error reply each end it with a GroupFault for the fault manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from belayer_rl.services.trainer.fault_manager import FaultManagerConfig, GroupFault
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import TrainerGroupConfig, to_argv
from belayer_rl.shared.processes import dies_with_parent
from belayer_rl.shared.protocol import ActorUpdate, ActorUpdated, GroupHeartbeat, Message
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.trainer.groups")

R = TypeVar("R", bound=Message)

WATCH_EVERY_S = 0.05
EXIT_GRACE_S = 1.0  # how long a failed reply waits for a rank's exit to explain it


@dataclass
class Beat:
    """What the last heartbeats of one rank said, and when they last showed it moving."""

    pid: int
    seen: float  # monotonic time of the last heartbeat
    moved: float  # monotonic time progress or CPU time last changed
    progress: int
    cpu_s: float


@dataclass
class LocalGroup:
    nc: NATS
    subjects: Subjects
    worker: TrainerGroupConfig  # every rank's settings but rank, rendezvous and state file; names the group
    folder: Path  # the group's state file, rendezvous files and logs
    faults: FaultManagerConfig
    rebuilds: int = 0
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    beats: dict[int, Beat] = field(default_factory=dict)
    builds: int = 0
    _listener: Subscription | None = None

    @property
    def name(self) -> Literal["actor", "reference", "reward"]:
        return self.worker.group  # type: ignore[return-value]

    @property
    def state_file(self) -> Path:
        return self.folder / f"{self.name}-state.ckpt"

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start every rank and wait until each heartbeats; GroupFault("start") if one cannot."""
        if self._listener is None:
            subject = self.subjects.event("group_heartbeat", self.worker.run)
            self._listener = await bus.listen(self.nc, subject, GroupHeartbeat, self.on_heartbeat)
        self.builds += 1
        self.beats.clear()
        rendezvous = self.folder / f"{self.name}-rendezvous-{self.builds}"
        rendezvous.unlink(missing_ok=True)
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        for rank in range(self.worker.world):
            config = replace(self.worker, rank=rank, rendezvous=rendezvous, state_file=self.state_file)
            log_path = self.folder / "logs" / f"{self.name}-{rank}-build{self.builds}.log"
            with log_path.open("ab") as out:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "belayer_rl.services.trainer_group", *to_argv(config),
                    stdout=out, stderr=out, start_new_session=True,
                    preexec_fn=dies_with_parent(signal.SIGKILL),  # a SIGKILLed trainer leaves no ranks
                )  # fmt: skip
            self.processes.append(process)
        deadline = time.monotonic() + self.faults.start_timeout_s
        while not all(self.beats.get(r) and self.beats[r].pid == p.pid for r, p in enumerate(self.processes)):
            for rank, process in enumerate(self.processes):
                if process.returncode is not None:
                    raise GroupFault("start", rank, f"exited with {process.returncode} while starting")
            if time.monotonic() > deadline:
                raise GroupFault(
                    "start", -1, f"not every rank heartbeat within {self.faults.start_timeout_s} s"
                )
            await asyncio.sleep(WATCH_EVERY_S)

    async def stop(self) -> None:
        """SIGKILL every rank's process group and wait for each death."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            await process.wait()
        self.processes = []

    async def close(self) -> None:
        await self.stop()
        if self._listener is not None:
            await self._listener.unsubscribe()
            self._listener = None

    async def on_heartbeat(self, beat: GroupHeartbeat) -> None:
        if (
            beat.group != self.name
            or beat.rank >= len(self.processes)
            or self.processes[beat.rank].pid != beat.pid
        ):
            return  # another group's, or a rank of an earlier build
        now = time.monotonic()
        last = self.beats.get(beat.rank)
        if last is None or last.pid != beat.pid or (last.progress, last.cpu_s) != (beat.progress, beat.cpu_s):
            self.beats[beat.rank] = Beat(beat.pid, now, now, beat.progress, beat.cpu_s)
        else:
            last.seen = now

    # ------------------------------------------------------------------ calls

    async def call(self, verb: str, message: Message, reply: type[R]) -> list[R]:
        """`message` to every rank at once; their replies by rank, or the GroupFault that ended it."""
        timeout = self.faults.call_timeout_s
        replies = {
            asyncio.create_task(
                bus.request_struct(
                    self.nc,
                    self.subjects.trainer_group(self.worker.run, self.name, rank, verb),
                    message,
                    reply,
                    timeout,
                )
            ): rank
            for rank in range(len(self.processes))
        }
        watch = asyncio.create_task(self.watch())
        results: dict[int, R] = {}
        try:
            while len(results) < len(replies):
                pending = {t for t in replies if not t.done()}
                await asyncio.wait({*pending, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch.done():
                    raise watch.result()
                for task in pending:
                    if not task.done():
                        continue
                    rank = replies[task]
                    try:
                        results[rank] = task.result()
                    except ServiceError as exc:
                        raise await self.fault_of(rank, exc) from None
                    except Exception as exc:  # a reply that does not decode, a closed connection
                        raise GroupFault("exception", rank, f"{type(exc).__name__}: {exc}") from None
        finally:
            for task in [*replies, watch]:
                task.cancel()
            await asyncio.gather(*replies, watch, return_exceptions=True)
        return [results[rank] for rank in sorted(results)]

    async def update(self, call: ActorUpdate) -> ActorUpdated:
        """The actor's step on every rank; the ranks must agree on the weights after it."""
        results = await self.call("update", call, ActorUpdated)
        differing = [
            r for r, result in enumerate(results) if result.weight_version != results[0].weight_version
        ]
        if differing:
            raise GroupFault("exception", differing[0], "ranks disagree on the weights after the step")
        return results[0]

    async def fault_of(self, rank: int, error: ServiceError) -> GroupFault:
        """What a failed reply means. A dead rank's subscription is gone before its exit is reaped,
        and its peers' collectives fail ("connection reset by peer") before it is, so a timeout,
        "no responders", or any error of a multi-rank group first waits briefly for an exit to
        explain it: the cause is the death, not its echo."""
        transport = error.code in ("timeout", "no-responders")
        if not transport and len(self.processes) == 1:
            return GroupFault("exception", rank, f"{error.code}: {error}")
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline:
            for dead, process in enumerate(self.processes):
                if process.returncode is not None:
                    return GroupFault("exit", dead, exit_cause(process.returncode))
            await asyncio.sleep(WATCH_EVERY_S)
        return GroupFault("timeout" if transport else "exception", rank, f"{error.code}: {error}")

    async def watch(self) -> GroupFault:
        """Returns (does not raise) the first fault seen among the running ranks: an exit; a rank
        with no heartbeat for the hang timeout (stopped, or stuck in the kernel); or a group none
        of whose ranks made progress or spent CPU time on its work for that long. The last is
        judged on the group, since a rank blocked in a collective waits for a slower peer, and
        idle time before the call does not count."""
        hang = self.faults.hang_timeout_s
        started = time.monotonic()
        while True:
            now = time.monotonic()
            for rank, process in enumerate(self.processes):
                if process.returncode is not None:
                    return GroupFault("exit", rank, exit_cause(process.returncode))
                beat = self.beats.get(rank)
                if beat is not None and now - beat.seen > hang:
                    return GroupFault("hang", rank, f"no heartbeat for {now - beat.seen:.1f} s")
            if self.beats:
                still = now - max(started, *(b.moved for b in self.beats.values()))
                if still > hang:
                    return GroupFault("hang", -1, f"no progress and no CPU time for {still:.1f} s")
            await asyncio.sleep(WATCH_EVERY_S)


def exit_cause(returncode: int) -> str:
    if returncode == -signal.SIGKILL:
        return "killed by SIGKILL (the OOM killer, or an operator)"
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with status {returncode}"
