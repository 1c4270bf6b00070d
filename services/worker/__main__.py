"""`python -m belayer_rl.services.worker`: run one rollout worker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import TypeVar

import uvloop
from nats.aio.client import Client as NATS

from belayer_rl.services.worker import shadow
from belayer_rl.services.worker.engine import Engine, EngineConfig
from belayer_rl.services.worker.weights import PinnedWeights
from belayer_rl.services.worker.worker import Worker
from belayer_rl.shared import bus, registry, subjects
from belayer_rl.shared import segments as shm
from belayer_rl.shared.config import WorkerConfig, resolve_nats_url
from belayer_rl.shared.protocol import (
    ArenaHandle,
    CancelDispatch,
    Dispatch,
    KvArenaRequest,
    Message,
    WeightHandles,
    WeightsPin,
    WeightsPublished,
)

log = logging.getLogger("belayer.worker")
T = TypeVar("T")
SERVER_TIMEOUT_S = 10.0  # pinning maps nothing yet, but a big version may still be loading
SERVER_WAIT_S = 60.0  # how long a worker waits for the servers to come up
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser(prog="belayer-worker", description="Run one rollout worker.")
    parser.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    parser.add_argument("--engine-id", required=True, help="engine this worker serves")
    parser.add_argument("--preset", default="tiny", help="model size preset")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of random weights")
    parser.add_argument("--weights", type=Path, help="weights file (overrides --weights-seed)")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV arena size in blocks")
    parser.add_argument("--max-step-tokens", type=int, default=128, help="prefill chunk budget per step")
    parser.add_argument("--heartbeat-interval", type=float, default=0.2, help="seconds between heartbeats")
    parser.add_argument("--role", choices=["standalone", "main", "shadow"], default="standalone")
    parser.add_argument("--heartbeat-file", type=Path, help="file whose mtime the scheduling loop refreshes")
    parser.add_argument("--shared-memory", action="store_true", help="map weights and arena from the servers")
    parser.add_argument("--watch-pid", type=int, default=0, help="shadow: pid of the main")
    parser.add_argument("--watch-file", type=Path, help="shadow: the main's heartbeat file")
    parser.add_argument("--hang-timeout", type=float, default=2.0, help="shadow: stale heartbeat file (s)")
    args = parser.parse_args(argv)
    return WorkerConfig(
        nats_url=resolve_nats_url(args.nats),
        engine_id=args.engine_id,
        preset=args.preset,
        weights_seed=args.weights_seed,
        weights_path=args.weights,
        num_blocks=args.num_blocks,
        max_step_tokens=args.max_step_tokens,
        heartbeat_interval_s=args.heartbeat_interval,
        role=args.role,
        heartbeat_file=args.heartbeat_file,
        shared_memory=args.shared_memory,
        watch_pid=args.watch_pid,
        watch_file=args.watch_file,
        hang_timeout_s=args.hang_timeout,
    )


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


async def build_engine(config: WorkerConfig, nc: NATS) -> tuple[Engine, str, PinnedWeights | None]:
    """The engine, with its own weights and arena or mapped from the weight and KV servers; the
    instances of the servers that own the mapped memory ("" when it owns its own); its pins."""
    if not config.shared_memory:
        return await asyncio.to_thread(Engine, engine_config(config)), "", None
    pins = PinnedWeights(nc, config.engine_id)
    pin = WeightsPin(holder=pins.holder, pid=os.getpid())  # the newest version
    weights = await ask_server(nc, subjects.WEIGHTS_PIN, pin, WeightHandles)
    ask = KvArenaRequest(
        engine_id=config.engine_id, preset=config.preset, num_blocks=config.num_blocks, block_size=BLOCK_SIZE
    )
    arena = await ask_server(nc, subjects.KV_ARENA, ask, ArenaHandle)
    params = await asyncio.to_thread(shm.map_weights, weights)
    tensor = await asyncio.to_thread(shm.map_arena, arena)
    # Which server instances own what we mapped: a restarted server owns none of it.
    owners = f"weights={weights.manifest.instance} kv={arena.manifest.instance}"
    engine = Engine(engine_config(config), params, tensor, weight_version=weights.version)
    pins.attach(engine)
    return engine, owners, pins


async def serve(config: WorkerConfig) -> None:
    async with contextlib.AsyncExitStack() as stack:
        # Until the engine is built, SIGTERM keeps its default action: there is nothing to drain,
        # and a worker stuck waiting for a server must still go when its supervisor goes.
        nc = await bus.connect(config.nats_url, f"worker-{config.engine_id}")
        stack.push_async_callback(nc.close)
        kv = await bus.with_retries("declare jetstream", lambda: bus.declare_jetstream(nc.jetstream()))
        engine, owners, pins = await build_engine(config, nc)
        if pins is not None:  # the shadow follows new versions too, so it holds no stale pin
            published = subjects.weights_published("*")
            stack.push_async_callback(pins.close)
            stack.push_async_callback(
                (await bus.listen(nc, published, WeightsPublished, pins.follow)).unsubscribe
            )
            await pins.follow()  # a publication before the subscription would be missed
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        if config.role == "shadow":
            # Everything needed to serve is built; now idle until the supervisor hands over.
            if not await shadow.stand_by(config, stopping, owners):
                return
            healthy, why = await asyncio.to_thread(shadow.device_check, engine)
            if not healthy:
                shadow.report(f"unhealthy {why}")
                return
        epoch = await registry.install_worker(kv, config.engine_id, os.getpid())
        worker = Worker(config, nc, engine, epoch, stopping, pins)

        subscriptions = [
            await bus.serve(nc, subjects.worker_dispatch(config.engine_id), Dispatch, worker.on_dispatch),
            await bus.serve(nc, subjects.worker_cancel(config.engine_id), CancelDispatch, worker.on_cancel),
        ]
        await bus.publish(nc, subjects.event("worker_registered", config.engine_id), worker.registration())
        log.info("engine %s serving at epoch %d (pid %d)", config.engine_id, epoch, os.getpid())
        if config.role != "standalone":
            shadow.report(f"ready {epoch}")

        async with asyncio.TaskGroup() as tasks:
            engine_task = tasks.create_task(worker.run_engine())
            beat_task = tasks.create_task(worker.heartbeat())
            await stopping.wait()
            for sub in subscriptions:  # stop intake first
                await sub.unsubscribe()
            worker.wake.set()
            engine_task.cancel()
            beat_task.cancel()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
