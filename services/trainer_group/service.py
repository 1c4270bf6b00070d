"""A trainer group worker as a service: what it owns, listens to and publishes; `setup` is what
the runtime runs (shared/runtime.py).

Owns one rank of the actor group (services/trainer_group/rank.py). Answers ActorUpdate on
`belayer.<cluster>.trainer.<run>.actor.<rank>.update`, one call at a time, the torch work in a
thread; rank 0 then publishes the new weights to the weight server over the bus and writes the
group's state file. Publishes `group_heartbeat` every --heartbeat seconds with its progress
counter and CPU time, from the event loop, so a long step keeps beating and a stopped process
(SIGSTOP) falls silent.
"""

from __future__ import annotations

import asyncio
import os
import time

from belayer_rl.services.trainer_group.rank import ActorRank
from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.protocol import ActorUpdate, ActorUpdated, GroupHeartbeat
from belayer_rl.shared.runtime import Endpoint, Runtime


async def setup(rt: Runtime, config: TrainerGroupConfig) -> None:
    import torch

    torch.set_num_threads(config.threads)
    nc = await rt.connect()
    names = rt.subjects
    rank = await asyncio.to_thread(ActorRank, config)  # joins the process group, loads the state
    rt.on_close(rank.close)
    weights = WeightClient(nc, subjects=names)
    one_at_a_time = asyncio.Lock()

    async def on_update(call: ActorUpdate) -> ActorUpdated:
        async with one_at_a_time:
            try:
                result, fresh = await asyncio.to_thread(rank.update, call)
            except Exception as exc:
                raise ServiceError("update-failed", f"{type(exc).__name__}: {exc}") from None
            if config.rank == 0:
                if call.publish:
                    handles = await weights.publish_params(rank.actor.weights())
                    if handles.version != result.weight_version:
                        raise ServiceError(
                            "update-failed",
                            f"published as {handles.version}, computed {result.weight_version}",
                        )
                if fresh:
                    await asyncio.to_thread(rank.save)
            return result

    async def heartbeat() -> None:
        beat = GroupHeartbeat(
            run=config.run,
            group=config.group,  # type: ignore[arg-type]
            rank=config.rank,
            pid=os.getpid(),
            step=rank.step,
            progress=rank.progress,
            cpu_s=time.process_time(),
        )
        await rt.publish(names.event("group_heartbeat", config.run), beat)

    await rt.serve(
        Endpoint(names.trainer_group(config.run, config.group, config.rank, "update"), ActorUpdate, on_update)
    )
    rt.every(config.heartbeat_s, heartbeat, "heartbeat")
    await heartbeat()
    rt.ready(f"{config.group} rank {config.rank}/{config.world} at step {rank.step}, version {rank.version}")
