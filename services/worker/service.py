"""The worker as a service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Builds its engine (own weights and arena, or mapped from the weight and KV servers; a cold worker
owns its arena and maps the weight server's versions too), then serves its engine's endpoints and
heartbeats. Under a shadow supervisor a shadow first
idles (services/worker/shadow.py) until it is told to take over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.client import Client as NATS

from belayer_rl.services.worker import shadow
from belayer_rl.services.worker.declaration import WORKER
from belayer_rl.services.worker.engine import Engine, EngineConfig, ServingEngine
from belayer_rl.services.worker.weights import PinnedWeights
from belayer_rl.services.worker.worker import Worker
from belayer_rl.shared import bus, registry, segments
from belayer_rl.shared.config import WorkerConfig
from belayer_rl.shared.metrics import WorkerMetrics
from belayer_rl.shared.protocol import (
    ArenaHandle,
    KvArenaRequest,
    Message,
    WeightHandles,
    WeightsPin,
    WorkerIdle,
)
from belayer_rl.shared.runtime import Runtime

log = logging.getLogger("belayer.worker")
T = TypeVar("T")
SERVER_TIMEOUT_S = 10.0  # pinning maps nothing yet, but a big version may still be loading
SERVER_WAIT_S = 60.0  # how long a worker waits for the servers to come up
BLOCK_SIZE = 16


def engine_config(config: WorkerConfig) -> EngineConfig:
    return EngineConfig(
        preset=config.preset,
        weights_seed=config.weights_seed,
        weights_path=config.weights_path,
        num_blocks=config.num_blocks,
        max_step_tokens=config.max_step_tokens,
    )


async def ask_server(nc: NATS, subject: str, message: Message, kind: type[T]) -> T:
    """A request to the weight or KV server, waiting (bounded) while it is still starting."""
    deadline = time.monotonic() + SERVER_WAIT_S
    while True:
        try:
            return await bus.request_struct(nc, subject, message, kind, SERVER_TIMEOUT_S)
        except bus.ServiceError as exc:
            if exc.code not in ("no-responders", "timeout") or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def build_engine(config: WorkerConfig, nc: NATS) -> tuple[Engine, WorkerIdle, PinnedWeights | None]:
    """The engine, with its own weights and arena or mapped from the weight and KV servers; the
    instances of the servers that own the mapped memory (none when it owns its own), as a shadow
    reports them; its pins."""
    if not config.shared_memory:
        engine = await asyncio.to_thread(Engine, engine_config(config))
        if not config.follow_versions:
            return engine, WorkerIdle(), None
        # The cold path: its own arena, and its own weights to begin with, so that it needs
        # neither server; it still maps the versions the weight server holds when that answers
        # (a trainer's current one among them), and follows the newest.
        pins = PinnedWeights(nc, config.engine_id, config.subjects)
        pins.attach(engine)
        return engine, WorkerIdle(), pins
    pins = PinnedWeights(nc, config.engine_id, config.subjects)
    pin = WeightsPin(holder=pins.holder, pid=os.getpid())  # the newest version
    weights = await ask_server(nc, config.subjects.weights_pin(config.engine_id), pin, WeightHandles)
    ask = KvArenaRequest(
        engine_id=config.engine_id, preset=config.preset, num_blocks=config.num_blocks, block_size=BLOCK_SIZE,
        pid=os.getpid(), watch_pid=config.watch_pid,  # a shadow shares it with the main it watches
    )  # fmt: skip
    arena = await ask_server(nc, config.subjects.kv_arena(config.engine_id), ask, ArenaHandle)
    params = await asyncio.to_thread(segments.map_weights, weights)
    tensor = await asyncio.to_thread(segments.map_arena, arena)
    # Which server instances own what we mapped: a restarted server owns none of it.
    owners = WorkerIdle(weights_instance=weights.manifest.instance, kv_instance=arena.manifest.instance)
    engine = Engine(engine_config(config), params, tensor, weight_version=weights.version)
    pins.attach(engine)
    return engine, owners, pins


async def setup(rt: Runtime, config: WorkerConfig) -> None:
    """The built-in engine's worker (kind "builtin")."""
    # Until the engine is built SIGTERM keeps its default action (run() is told so): there is
    # nothing to drain, and a worker stuck waiting for a server must still go when its supervisor goes.
    nc = await rt.connect()
    engine, owners, pins = await build_engine(config, nc)
    await serve(rt, config, nc, engine, owners, pins)


async def serve(
    rt: Runtime,
    config: WorkerConfig,
    nc: NATS,
    engine: ServingEngine,
    owners: WorkerIdle,
    pins: PinnedWeights | None,
    on_worker: Callable[[Worker], Awaitable[None]] | None = None,
) -> None:
    """Serve a built engine of any kind: a shadow first stands by, then the worker installs its
    epoch, listens and runs the engine."""
    kv = await bus.engine_registry(nc.jetstream(), rt.subjects)
    if pins is not None:  # the shadow follows new versions too, so it holds no stale pin
        rt.on_close(pins.close)
        await rt.serve(*WORKER.endpoints(rt.subjects, config, weights_published=pins.follow))
        await pins.follow()  # a publication before the subscription would be missed
    rt.capture_signals()
    if config.role == "shadow":
        # A process's first kernel pays for loading CUDA modules and setting up cuBLAS (0.1 s on an
        # H200): paid now, so that the check at promotion is only the check.
        await asyncio.to_thread(shadow.device_check, engine)
        # Everything needed to serve is built; now idle until the supervisor hands over.
        if not await shadow.stand_by(config, rt.stopping, owners):
            rt.stopping.set()  # told to go, or stopping already
            return
        healthy, why = await asyncio.to_thread(shadow.device_check, engine)
        if not healthy:
            shadow.report_unhealthy(why)
            rt.stopping.set()
            return
    epoch, replaced = await registry.install_worker(kv, config.engine_id, os.getpid())
    if replaced is not None:  # an entry that did not decode: overwritten under a safe epoch
        await rt.record_skipped(replaced)
    metrics = WorkerMetrics(rt.metrics, config.engine_id)
    worker = Worker(config, nc, engine, epoch, rt.stopping, pins, metrics)
    if on_worker is not None:  # before it serves: from here on only the worker steps the engine
        await on_worker(worker)
    await rt.serve(
        *WORKER.endpoints(
            rt.subjects,
            config,
            dispatch=worker.on_dispatch,
            cancel=worker.on_cancel,
            adopt=worker.on_adopt,
            router_started=worker.on_router_started,
        )
    )
    await rt.publish(rt.subjects.event("worker_registered", config.engine_id), worker.registration())
    rt.spawn(worker.run_engine(), "engine", essential=True)
    rt.spawn(worker.heartbeat(), "heartbeat", essential=True)
    rt.on_drain(worker.wake_up)  # intake stopped: the scheduling loop sees `stopping` and ends
    if config.role != "standalone":
        shadow.report_ready(epoch)
    rt.ready(f"engine {config.engine_id} serving at epoch {epoch} (pid {os.getpid()})")
