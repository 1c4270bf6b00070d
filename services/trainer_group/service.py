"""A trainer group worker as a service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Owns one rank of a group (services/trainer/ranks.py) and answers its group's one call, one call at
a time, the work in a thread: the actor's `update` (rank 0 then publishes the new weights to the weight server over the bus and
writes the group's state file), the reference's `logprobs`, the reward's `reward`. Heartbeats every --heartbeat seconds with its progress
counter and CPU time, from the event loop, so a long step keeps beating and a stopped process
(SIGSTOP) falls silent. Its CPU time is that of the threads doing its work, so a worker thread
that deadlocks shows no progress and no CPU time while the heartbeats go on.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

from belayer_rl.services.trainer.ranks import ActorRank, ReferenceRank, RewardRank
from belayer_rl.services.trainer_group.declaration import TRAINER_GROUP
from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.protocol import ActorUpdate, ActorUpdated, GroupHeartbeat
from belayer_rl.shared.runtime import Runtime

M = TypeVar("M")
R = TypeVar("R")


async def setup(rt: Runtime, config: TrainerGroupConfig) -> None:
    import torch

    torch.set_num_threads(config.threads)
    nc = await rt.connect()
    names = rt.subjects
    one_at_a_time = asyncio.Lock()
    rank: ActorRank | ReferenceRank | RewardRank
    if config.group == "reward":
        rank = RewardRank(config)
        endpoints = TRAINER_GROUP.endpoints(names, config, reward=call_in_thread(rank.reward, one_at_a_time))
    elif config.group == "reference":
        rank = await asyncio.to_thread(ReferenceRank, config)
        logprobs = call_in_thread(rank.logprobs, one_at_a_time)
        endpoints = TRAINER_GROUP.endpoints(names, config, logprobs=logprobs)
    else:
        rank = await asyncio.to_thread(ActorRank, config)  # joins the process group, loads the state
        rt.on_close(rank.close)
        update = actor_update(rank, WeightClient(nc, subjects=names), config, one_at_a_time)
        endpoints = TRAINER_GROUP.endpoints(names, config, update=update)

    async def heartbeat() -> None:
        beat = GroupHeartbeat(
            run=config.run,
            group=config.group,
            rank=config.rank,
            pid=os.getpid(),
            step=rank.step,
            progress=rank.progress,
            cpu_s=rank.work.seconds(),
        )
        await rt.publish(names.event("group_heartbeat", config.run), beat)

    await rt.serve(*endpoints)
    rt.every(config.heartbeat_s, heartbeat, "heartbeat")
    await heartbeat()
    rt.ready(f"{config.group} rank {config.rank}/{config.world} at step {rank.step}")


def call_in_thread(work: Callable[[M], R], lock: asyncio.Lock) -> Callable[[M], Awaitable[R]]:
    async def handler(call: M) -> R:
        async with lock:
            try:
                return await asyncio.to_thread(work, call)
            except Exception as exc:
                raise ServiceError("update-failed", f"{type(exc).__name__}: {exc}") from None

    return handler


def actor_update(
    rank: ActorRank, weights: WeightClient, config: TrainerGroupConfig, lock: asyncio.Lock
) -> Callable[[ActorUpdate], Awaitable[ActorUpdated]]:
    async def on_update(call: ActorUpdate) -> ActorUpdated:
        async with lock:
            try:
                result, _ = await asyncio.to_thread(rank.update, call)
            except Exception as exc:
                raise ServiceError("update-failed", f"{type(exc).__name__}: {exc}") from None
            if config.rank == 0:
                # Saved before the publication: a publication that fails and is retried finds its
                # step applied (not fresh) and must not leave the state file a step behind.
                await asyncio.to_thread(rank.save)
                rank.points.reached(call.step, "publish")
                if call.publish:
                    handles = await weights.publish_params(rank.actor.weights())
                    if handles.version != result.weight_version:
                        raise ServiceError(
                            "update-failed",
                            f"published as {handles.version}, computed {result.weight_version}",
                        )
            return result

    return on_update
