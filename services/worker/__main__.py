"""`python -m belayer_rl.services.worker`: run one rollout worker until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import uvloop

from belayer_rl.services.worker.engine import Engine, EngineConfig
from belayer_rl.services.worker.worker import Worker
from belayer_rl.shared import bus, registry, subjects
from belayer_rl.shared.config import WorkerConfig, resolve_nats_url
from belayer_rl.shared.protocol import CancelDispatch, Dispatch

log = logging.getLogger("belayer.worker")


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
    )


def build_engine(config: WorkerConfig) -> Engine:
    return Engine(
        EngineConfig(
            preset=config.preset,
            weights_seed=config.weights_seed,
            weights_path=config.weights_path,
            num_blocks=config.num_blocks,
            max_step_tokens=config.max_step_tokens,
        )
    )


async def serve(config: WorkerConfig) -> None:
    engine = await asyncio.to_thread(build_engine, config)
    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(config.nats_url, f"worker-{config.engine_id}")
        stack.push_async_callback(nc.close)
        kv = await bus.with_retries("declare jetstream", lambda: bus.declare_jetstream(nc.jetstream()))
        epoch = await registry.install_worker(kv, config.engine_id, os.getpid())
        worker = Worker(config, nc, engine, epoch)

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stopping.set)

        subscriptions = [
            await bus.serve(nc, subjects.worker_dispatch(config.engine_id), Dispatch, worker.on_dispatch),
            await bus.serve(nc, subjects.worker_cancel(config.engine_id), CancelDispatch, worker.on_cancel),
        ]
        await bus.publish(nc, subjects.event("worker_registered", config.engine_id), worker.registration())
        log.info("engine %s serving at epoch %d (pid %d)", config.engine_id, epoch, os.getpid())

        async with asyncio.TaskGroup() as tasks:
            engine_task = tasks.create_task(worker.run_engine())
            beat_task = tasks.create_task(worker.heartbeat())
            await worker.stopping.wait()
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
