"""A trainer group (actor, reference or reward) as local processes, driven over the bus (the local
backend).

Each rank is `python -m belayer_rl.services.trainer_group` in a session of its own, so the group
can be killed whole (SIGKILL to each process group) and its death confirmed before a new one
starts. By default a rank is forked from the trainer's fork server, which has torch loaded
(services/trainer_group/fork_server.py), so a rebuild does not pay three Python and torch
start-ups again; with `warm_start` off, or while no fork server can start, it starts cold. Ranks
form a gloo process group through a rendezvous file that is new for every build, load the group's
state file (written by rank 0 after every step) and heartbeat with their progress.

A call goes to every rank at once and is watched while it runs: a rank's exit, a hang (no
heartbeat, or neither progress nor CPU time moving, for the hang timeout), the call's own timeout
and an error reply each end it with a GroupFault for the fault manager.
"""

from __future__ import annotations

import asyncio
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
from belayer_rl.shared.processes import Child, dies_with_parent, kill_process
from belayer_rl.shared.protocol import (
    ActorUpdate,
    ActorUpdated,
    BadMessage,
    ForkRank,
    ForkRefused,
    ForkServerReady,
    ForkServerReport,
    GroupHeartbeat,
    Message,
    RankExited,
    RankForked,
    decode,
    decoder_for,
    encode,
)
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.trainer.groups")

R = TypeVar("R", bound=Message)

WATCH_EVERY_S = 0.05
EXIT_GRACE_S = 1.0  # how long a failed reply waits for a rank's exit to explain it


@dataclass
class ForkedRank:
    """A rank forked by the fork server. The server reaps it and reports its exit status; should
    the server die first, its pidfd says when the kernel's SIGKILL has ended it."""

    pid: int
    pidfd: int | None  # None: it was gone before we could open one (its RankExited follows)
    returncode: int | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    def exit(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self.exited.set()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    async def wait(self) -> int:
        await self.exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def dead(self) -> None:
        """Until the process has ended, without its parent's word (a readable pidfd)."""
        if self.pidfd is None:
            return
        ended = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(self.pidfd, ended.set_result, None)
        try:
            await ended
        finally:
            asyncio.get_running_loop().remove_reader(self.pidfd)


FORK_REPORTS = decoder_for(ForkServerReport)


@dataclass
class ForkServer:
    """The trainer's handle on its fork server: started on the first fork, and again on the next
    fork after it died. One fork at a time, so each answer pairs with its request; a fork that
    got no answer closes the server, so a late answer can never pair with the next request."""

    folder: Path  # its log goes to <folder>/logs/fork-server.log
    start_timeout_s: float
    process: asyncio.subprocess.Process | None = None
    ranks: dict[int, ForkedRank] = field(default_factory=dict)  # pid -> a rank not yet reaped
    answers: asyncio.Queue[ForkedRank | ForkServerReady | ForkRefused | None] = field(
        default_factory=asyncio.Queue
    )
    reader: asyncio.Task[None] | None = None
    one_at_a_time: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False  # by the backend: no more forks, no restarts

    async def fork(self, config: TrainerGroupConfig, log_path: Path) -> ForkedRank:
        """A rank forked on `config`; ForkUnavailable if the server cannot start or refuses."""
        async with self.one_at_a_time:
            if self.closed:
                raise ForkUnavailable("the fork server is closed")
            if self.process is None or self.process.returncode is not None:
                await self.start()
            assert self.process is not None and self.process.stdin is not None
            command = ForkRank(argv=to_argv(config), log_path=str(log_path))
            try:
                self.process.stdin.write(encode(command) + b"\n")
                await self.process.stdin.drain()
                async with asyncio.timeout(self.start_timeout_s):
                    answer = await self.answers.get()
            except BaseException as exc:  # a timeout, a broken pipe, a cancel: the pairing is lost
                await asyncio.shield(self.stop())
                if isinstance(exc, (ConnectionError, TimeoutError)):
                    raise ForkUnavailable(f"the fork server did not answer: {exc!r}") from None
                raise
            if isinstance(answer, ForkedRank):
                return answer
            if isinstance(answer, ForkRefused):
                raise ForkUnavailable(f"the fork server refused: {answer.why}")
            raise ForkUnavailable("the fork server exited")

    async def start(self) -> None:
        await self.stop()
        self.answers = asyncio.Queue()
        try:
            (self.folder / "logs").mkdir(parents=True, exist_ok=True)
            with (self.folder / "logs" / "fork-server.log").open("ab") as err:
                self.process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "belayer_rl.services.trainer_group.fork_server",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                    start_new_session=True, preexec_fn=dies_with_parent(signal.SIGKILL),
                )  # fmt: skip
        except OSError as exc:
            raise ForkUnavailable(f"the fork server cannot start: {exc}") from None
        self.reader = asyncio.create_task(self.read(self.process), name="fork-server-reader")
        try:
            async with asyncio.timeout(self.start_timeout_s):
                ready = await self.answers.get()
        except TimeoutError:
            ready = None
        if not isinstance(ready, ForkServerReady):
            await self.stop()
            raise ForkUnavailable("the fork server did not start; see logs/fork-server.log")

    async def read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while True:
            try:
                line = await process.stdout.readline()
            except ValueError:  # over the stream's limit: not a report of ours
                log.warning("fork server: ignored an oversized stdout line")
                continue
            if not line:
                break
            try:
                report = decode(FORK_REPORTS, line)
            except BadMessage as exc:
                log.warning("fork server: ignored a line that is not a report: %s", exc)
                continue
            if isinstance(report, RankForked):
                try:
                    pidfd: int | None = os.pidfd_open(report.pid)
                except ProcessLookupError:
                    pidfd = None
                rank = self.ranks[report.pid] = ForkedRank(report.pid, pidfd)
                self.answers.put_nowait(rank)
            elif isinstance(report, RankExited):
                if (exited := self.ranks.pop(report.pid, None)) is not None:
                    exited.exit(report.returncode)
            else:
                self.answers.put_nowait(report)
        # The server is gone, and the kernel SIGKILLs the ranks it had as it goes: confirm each
        # death before saying so, or a rebuild could overlap ranks still holding their memory.
        await process.wait()
        orphans, self.ranks = list(self.ranks.values()), {}
        await asyncio.gather(*(rank.dead() for rank in orphans))
        for rank in orphans:
            rank.exit(-signal.SIGKILL)
        self.answers.put_nowait(None)

    async def stop(self) -> None:
        """Kill the server (its ranks die with it) and wait until they are all dead."""
        if self.process is not None and self.process.returncode is None:
            await kill_process(self.process, group=True)
        if self.reader is not None:
            await self.reader  # ends at the server's EOF, once its ranks are dead
            self.reader = None
        self.process = None

    async def close(self) -> None:
        self.closed = True
        await self.stop()


class ForkUnavailable(Exception):
    """No warm start now: the rank is started cold instead."""


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
    forks: ForkServer | None = None  # warm starts; None: every rank starts cold
    rebuilds: int = 0
    processes: list[Child] = field(default_factory=list)  # asyncio subprocesses or ForkedRanks
    beats: dict[int, Beat] = field(default_factory=dict)
    builds: int = 0
    _listener: Subscription | None = None

    @property
    def name(self) -> Literal["actor", "reference", "reward"]:
        return self.worker.group

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
        # absolute: a rank (a Ray actor's among them) need not run in this process's folder
        rendezvous = self.folder.absolute() / f"{self.name}-rendezvous-{self.builds}"
        rendezvous.unlink(missing_ok=True)
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        for rank in range(self.worker.world):
            config = replace(self.worker, rank=rank, rendezvous=rendezvous, state_file=self.state_file)
            log_path = self.folder / "logs" / f"{self.name}-{rank}-build{self.builds}.log"
            self.processes.append(await self.launch(config, log_path))
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

    async def launch(self, config: TrainerGroupConfig, log_path: Path) -> Child:
        if self.forks is not None:
            try:
                return await self.forks.fork(config, log_path)
            except ForkUnavailable as exc:
                log.warning("%s rank %d starts cold: %s", self.name, config.rank, exc)
        with log_path.open("ab") as out:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "belayer_rl.services.trainer_group", *to_argv(config),
                stdout=out, stderr=out, start_new_session=True,
                preexec_fn=dies_with_parent(signal.SIGKILL),  # a SIGKILLed trainer leaves no ranks
            )  # fmt: skip

    async def stop(self) -> None:
        """SIGKILL every rank's process group and wait for each death."""
        await asyncio.gather(*(kill_process(process, group=True) for process in self.processes))
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
            for running in [*replies, watch]:
                running.cancel()
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
            return GroupFault("exception", rank, str(error))
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline:
            for dead, process in enumerate(self.processes):
                if process.returncode is not None:
                    return GroupFault("exit", dead, exit_cause(process.returncode))
            await asyncio.sleep(WATCH_EVERY_S)
        return GroupFault("timeout" if transport else "exception", rank, str(error))

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
