"""Trainer groups as Ray actors (the Ray backend), behind the same fault manager.

Each rank is a Ray actor in a placement group of its own group (one fractional-CPU bundle per
rank), running the same rank code as the local backend (services/trainer/ranks.py): the gloo
process group through a rendezvous file, the state file written by rank 0 after every step. The
actor is threaded (two calls at once), so `progress` answers while a call computes.

A rebuild kills the Ray actors, removes the placement group and waits until every old process is
gone, then creates a new placement group (ready within a timeout, or the start fails) and new
actors that load the state file. The actor's and the reference's ranks run with `max_restarts=0`:
a rank restarted in place could never rejoin its process group, so its death must surface as a
death, at once, and go to the targeted rebuild; no call is retried into a dead actor. The reward,
stateless and single-process, is left to Ray's own recovery: `max_restarts` restarts of its actor
and `max_task_retries` retries of the call that its death interrupted.

Detection: a rank's death is a RayActorError from its call; a hang is a rank whose `progress`
call goes unanswered (SIGSTOP) or whose progress counter and CPU time stand still, for the hang
timeout. A reward actor whose process is gone is being restarted by Ray, which is not a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from belayer_rl.services.trainer.fault_manager import FaultManagerConfig, GroupFault
from belayer_rl.shared import protocol
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.params import Params
from belayer_rl.shared.protocol import ActorUpdate, ActorUpdated, Message, RefLogprobsRequest, RewardRequest

R = TypeVar("R", bound=Message)

log = logging.getLogger("belayer.trainer.ray")

WATCH_EVERY_S = 0.1
EXIT_GRACE_S = 1.0  # how long a failed call waits for a peer's death to explain it
CPU_PER_RANK = 0.5  # fractional bundles: a 2-rank group fits on 2 cores beside the engine


class RankActor:
    """One rank, inside a Ray worker process. Wrapped by `ray.remote` in RayGroup.start. Every
    verb answers (the encoded reply, rank 0's new weights for the trainer to publish or None)."""

    def __init__(self, config: TrainerGroupConfig) -> None:
        import torch

        from belayer_rl.services.trainer.ranks import ActorRank, ReferenceRank, RewardRank

        torch.set_num_threads(config.threads)
        self.config = config
        kinds = {"actor": ActorRank, "reference": ReferenceRank, "reward": RewardRank}
        # One of the three: each verb below is called only on its own group's ranks.
        self.rank: Any = kinds[config.group](config)

    def pid(self) -> int:
        return os.getpid()

    def update(self, call: bytes) -> tuple[bytes, Params | None]:
        decoded = protocol.decode(protocol.decoder_for(ActorUpdate), call)
        result, _ = self.rank.update(decoded)
        self.rank.save()  # when the file holds an older step (a retried call included)
        self.rank.points.reached(decoded.step, "publish")
        weights = self.rank.actor.weights() if self.config.rank == 0 else None
        return protocol.encode(result), weights

    def logprobs(self, call: bytes) -> tuple[bytes, None]:
        decoded = protocol.decode(protocol.decoder_for(RefLogprobsRequest), call)
        return protocol.encode(self.rank.logprobs(decoded)), None

    def reward(self, call: bytes) -> tuple[bytes, None]:
        decoded = protocol.decode(protocol.decoder_for(RewardRequest), call)
        return protocol.encode(self.rank.reward(decoded)), None

    def progress(self) -> tuple[int, int, float]:
        return os.getpid(), self.rank.progress, self.rank.work.seconds()


@dataclass
class RayGroup:
    worker: TrainerGroupConfig  # names the group (actor, reference or reward)
    folder: Path
    faults: FaultManagerConfig
    publish_weights: Callable[[Params], Awaitable[str]]  # -> the version the weight server gave them
    placement_timeout_s: float = 60.0
    rebuilds: int = 0
    builds: int = 0
    actors: list[Any] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    placement: Any = None

    @property
    def name(self) -> Literal["actor", "reference", "reward"]:
        return self.worker.group

    @property
    def state_file(self) -> Path:
        return self.folder / f"{self.name}-state.ckpt"

    def restart_options(self) -> dict[str, int]:
        """Ray's own recovery: only the reward, stateless and single-process, is restarted in place
        and its call retried by Ray. A rank of the actor or the reference must die as a death."""
        if self.name == "reward" and self.faults.enable_retry:
            return {
                "max_restarts": self.faults.max_restarts,
                "max_task_retries": self.faults.max_task_retries,
            }
        return {"max_restarts": 0, "max_task_retries": 0}

    async def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.builds += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        # absolute: a rank (a Ray actor's among them) need not run in this process's folder
        rendezvous = self.folder.absolute() / f"{self.name}-rendezvous-{self.builds}"
        rendezvous.unlink(missing_ok=True)
        bundles = [{"CPU": CPU_PER_RANK} for _ in range(self.worker.world)]
        self.placement = placement_group(bundles, strategy="PACK")
        try:
            await asyncio.wait_for(self.placement.ready(), self.placement_timeout_s)
        except TimeoutError:
            raise GroupFault(
                "start",
                -1,
                f"placement group of {len(bundles)} bundles not ready in {self.placement_timeout_s} s",
            ) from None
        remote = ray.remote(RankActor)
        for rank in range(self.worker.world):
            config = replace(self.worker, rank=rank, rendezvous=rendezvous, state_file=self.state_file)
            strategy = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank)
            self.actors.append(
                remote.options(
                    num_cpus=CPU_PER_RANK,
                    max_concurrency=2,
                    scheduling_strategy=strategy,
                    **self.restart_options(),
                ).remote(config)
            )
        try:
            self.pids = list(
                await asyncio.wait_for(
                    asyncio.gather(*(a.pid.remote() for a in self.actors)), self.faults.start_timeout_s
                )
            )
        except Exception as exc:
            raise GroupFault("start", -1, f"{type(exc).__name__}: {exc}") from None

    async def refresh_pids(self, timeout_s: float) -> None:
        """Read the ranks' pids again: a rank Ray restarted has a new process."""
        async with asyncio.timeout(timeout_s):
            self.pids = list(await asyncio.gather(*(a.pid.remote() for a in self.actors)))

    async def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.restart_options()["max_restarts"] and self.actors:
            with contextlib.suppress(
                Exception
            ):  # restarted by Ray since: the new process is the one to wait for
                await self.refresh_pids(5.0)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        for pid in self.pids:  # confirmed dead before anything new starts
            await _gone(pid)
        if self.placement is not None:
            remove_placement_group(self.placement)
        self.actors, self.pids, self.placement = [], [], None

    async def close(self) -> None:
        await self.stop()

    async def call(self, verb: str, message: Message, reply: type[R]) -> list[R]:
        """`message` to every rank at once; their replies by rank, or the GroupFault that ended it."""
        return [decoded for decoded, _ in await self.call_with_weights(verb, message, reply)]

    async def call_with_weights(
        self, verb: str, message: Message, reply: type[R]
    ) -> list[tuple[R, Params | None]]:
        from ray.exceptions import RayActorError, RayTaskError

        encoded = protocol.encode(message)
        calls = [asyncio.ensure_future(_awaitable(getattr(a, verb).remote(encoded))) for a in self.actors]
        watch = asyncio.create_task(self.watch())
        try:
            async with asyncio.timeout(self.faults.call_timeout_s):
                while not all(c.done() for c in calls):
                    await asyncio.wait(
                        {*[c for c in calls if not c.done()], watch}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if watch.done():
                        raise watch.result()
                    if any(c.done() and c.exception() is not None for c in calls):
                        # A dead rank's peers fail their collectives at once: give its own call a
                        # moment to report the death, which is the cause.
                        await asyncio.wait(calls, timeout=EXIT_GRACE_S)
                        died = [
                            r
                            for r, c in enumerate(calls)
                            if c.done() and isinstance(c.exception(), RayActorError)
                        ]
                        if died:
                            raise GroupFault(
                                "exit", died[0], f"the Ray actor died: {calls[died[0]].exception()}"
                            )
                        rank, error = next(
                            (r, c.exception()) for r, c in enumerate(calls) if c.done() and c.exception()
                        )
                        if isinstance(error, RayTaskError):
                            raise GroupFault("exception", rank, str(error).splitlines()[-1])
                        raise GroupFault("exception", rank, f"{type(error).__name__}: {error}")
        except TimeoutError:
            raise GroupFault("timeout", -1, f"no answer within {self.faults.call_timeout_s} s") from None
        finally:
            watch.cancel()
            for c in calls:
                c.cancel()
            await asyncio.gather(watch, *calls, return_exceptions=True)
        if self.restart_options()["max_restarts"]:
            await self.refresh_pids(self.faults.call_timeout_s)  # what chaos aims at and stop() waits for
        decoder = protocol.decoder_for(reply)
        return [(protocol.decode(decoder, c.result()[0]), c.result()[1]) for c in calls]

    async def update(self, call: ActorUpdate) -> ActorUpdated:
        """The actor's step on every rank, then rank 0's weights published by the trainer."""
        answers = await self.call_with_weights("update", call, ActorUpdated)
        results = [result for result, _ in answers]
        if any(r.weight_version != results[0].weight_version for r in results):
            raise GroupFault("exception", -1, "ranks disagree on the weights after the step")
        weights = answers[0][1]
        assert weights is not None
        try:
            published = await self.publish_weights(weights)
        except Exception as exc:
            raise GroupFault(
                "exception", 0, f"publishing the new weights: {type(exc).__name__}: {exc}"
            ) from None
        if published != results[0].weight_version:
            raise GroupFault(
                "exception", 0, f"published as {published}, computed {results[0].weight_version}"
            )
        return results[0]

    async def watch(self) -> GroupFault:
        """Returns the first hang seen: a rank whose `progress` goes unanswered (stopped), or a
        group none of whose ranks moved, for the hang timeout. Deaths surface through the calls;
        a rank Ray is restarting (its process gone) is waited for, within the call's timeout."""
        hang = self.faults.hang_timeout_s
        restartable = self.restart_options()["max_restarts"] > 0
        started = time.monotonic()
        answered = [started] * len(self.actors)
        moved = started
        last: list[tuple[int, float] | None] = [None] * len(self.actors)
        while True:
            for rank, actor in enumerate(self.actors):
                # Unanswered in time: silence. (asyncio.timeout, not wait_for: on Python 3.11
                # wait_for can swallow the cancellation that ends this watch, which then never ends.)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(WATCH_EVERY_S * 5):
                        pid, *seen = await actor.progress.remote()
                    answered[rank] = time.monotonic()
                    if pid != self.pids[rank]:
                        log.warning(
                            "%s rank %d restarted by Ray: pid %d -> %d", self.name, rank, self.pids[rank], pid
                        )
                        self.pids[rank] = pid
                    if last[rank] is not None and tuple(seen) != last[rank]:
                        moved = time.monotonic()
                    last[rank] = (seen[0], seen[1])
                if restartable and not _alive(self.pids[rank]):
                    answered[rank] = moved = time.monotonic()
                silent = time.monotonic() - answered[rank]
                if silent > hang:
                    return GroupFault("hang", rank, f"no answer to progress for {silent:.1f} s")
            if time.monotonic() - moved > hang:
                return GroupFault(
                    "hang", -1, f"no progress and no CPU time for {time.monotonic() - moved:.1f} s"
                )
            await asyncio.sleep(WATCH_EVERY_S)


def cpus_for(world: int, with_reference: bool) -> float:
    """The CPUs the groups' bundles take: the actor's ranks, the reward and maybe the reference."""
    return CPU_PER_RANK * (world + 1 + int(with_reference))


async def _gone(pid: int, timeout_s: float = 30.0) -> None:
    """Wait for a local Ray worker process to end. The Ray backend runs on one host: its ranks
    share the state and rendezvous files with the trainer."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise GroupFault("start", -1, f"Ray worker {pid} still alive {timeout_s} s after ray.kill")
        await asyncio.sleep(0.05)


async def _awaitable(ref: Any) -> Any:
    return await ref


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: its parent (the raylet) reaps it in its own time.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    return False
