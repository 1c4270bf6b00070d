"""The checkpointer as a service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Owns the sandbox containers of its host (services/checkpointer/checkpointer.py). Its RPC arrives
through one subscription, so requests are seen in the order they were sent; each runs as its own task (a long action on one sandbox does not hold up another) and
takes its place in its sandbox's FIFO before its first wait. A drain lets running actions and
checkpoints finish within --drain-timeout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from belayer_rl.services.checkpointer import objects, pointer
from belayer_rl.services.checkpointer.checkpointer import Checkpointer
from belayer_rl.services.checkpointer.declaration import CHECKPOINTER
from belayer_rl.services.checkpointer.sandbox import DockerEngine
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.config import CheckpointerConfig
from belayer_rl.shared.metrics import CheckpointerMetrics
from belayer_rl.shared.protocol import Message, SandboxRequest
from belayer_rl.shared.runtime import Runtime
from belayer_rl.shared.subjects import sender

VERBS: dict[type[Message], str] = {
    protocol.SandboxCreate: "create",
    protocol.SandboxExec: "exec",
    protocol.SandboxCheckpoint: "checkpoint",
    protocol.SandboxRestore: "restore",
    protocol.SandboxDestroy: "destroy",
    protocol.SandboxList: "list",
    protocol.TrajectoryEnd: "end",
}


def router(checkpointer: Checkpointer) -> Callable[[SandboxRequest, str], Awaitable[Message]]:
    """One handler for the host's wildcard subject: the request's type must match its verb."""
    c = checkpointer
    handlers: dict[type[Message], Callable[[Any], Awaitable[Message]]] = {
        protocol.SandboxCreate: c.on_create,
        protocol.SandboxExec: c.on_exec,
        protocol.SandboxCheckpoint: c.on_checkpoint,
        protocol.SandboxRestore: c.on_restore,
        protocol.SandboxDestroy: c.on_destroy,
        protocol.SandboxList: c.on_list,
        protocol.TrajectoryEnd: c.on_end,
    }

    async def route(request: SandboxRequest, subject: str) -> Message:
        verb, client = subject.split(".")[-2], sender(subject)
        kind = type(request)
        if VERBS[kind] != verb:
            raise protocol.BadMessage(f"a {kind.__name__} does not belong on {subject}")
        await c.check_client(request, client)
        if isinstance(request, protocol.SandboxCreate):
            return await c.on_create(request, owner=client)
        if isinstance(request, protocol.SandboxRestore):
            return await c.on_restore(request, owner=client)
        return await handlers[kind](request)

    return route


async def setup(rt: Runtime, config: CheckpointerConfig) -> None:
    nc = await rt.connect()
    kv = await bus.with_retries(
        "declare prefix pointers", lambda: pointer.declare(nc.jetstream(), rt.subjects, config.replicas)
    )
    engine = await DockerEngine.connect(config.docker_url, config.docker_timeout_s, config.dump_stall_s)
    rt.on_close(engine.close)
    checkpointer = Checkpointer(config, engine, nc, kv, rt.record_skipped, CheckpointerMetrics(rt.metrics))
    if config.object_store:
        checkpointer.objects = await bus.with_retries(
            "declare checkpoint object store",
            lambda: objects.declare(nc.jetstream(), rt.subjects, config.replicas),
        )
    rt.on_close(checkpointer.close)
    await checkpointer.reconcile()
    await rt.serve(
        *CHECKPOINTER.endpoints(
            rt.subjects,
            config,
            sandbox=router(checkpointer),
            trajectory_ended=checkpointer.on_trajectory_ended,
        )
    )
    rt.spawn(checkpointer.watch(), "watch-engine")
    rt.ready(
        f"host {config.host_id}: {len(checkpointer.sandboxes)} sandboxes, docker root {engine.data_root},"
        f" state {config.state_dir}"
    )
