"""`python -m belayer_rl.services.shadow_supervisor`: run the shadow supervisor until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import uvloop

from belayer_rl.services.shadow_supervisor.supervisor import ShadowSupervisor
from belayer_rl.shared import bus
from belayer_rl.shared.config import ShadowSupervisorConfig, resolve_nats_url


def parse_args(argv: list[str] | None = None) -> ShadowSupervisorConfig:
    parser = argparse.ArgumentParser(prog="belayer-shadow-supervisor")
    parser.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    parser.add_argument("--engines", required=True, help="comma-separated engine ids")
    parser.add_argument("--state-dir", type=Path, required=True, help="heartbeat files and worker logs")
    parser.add_argument("--preset", default="tiny", help="model preset (must match the weight server)")
    parser.add_argument("--weights-seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=512, help="KV arena blocks per engine")
    parser.add_argument("--hang-timeout", type=float, default=2.0, help="stale heartbeat file (s)")
    parser.add_argument(
        "--failure-window", type=float, default=60.0, help="two failures inside: quarantine (s)"
    )
    parser.add_argument("--death-timeout", type=float, default=2.0, help="wait for a killed main (s)")
    args = parser.parse_args(argv)
    return ShadowSupervisorConfig(
        nats_url=resolve_nats_url(args.nats),
        engines=tuple(e for e in args.engines.split(",") if e),
        state_dir=args.state_dir,
        preset=args.preset,
        weights_seed=args.weights_seed,
        num_blocks=args.num_blocks,
        hang_timeout_s=args.hang_timeout,
        failure_window_s=args.failure_window,
        death_timeout_s=args.death_timeout,
    )


async def serve(config: ShadowSupervisorConfig) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(config.nats_url, "shadow-supervisor")
        stack.push_async_callback(nc.close)
        kv = await bus.with_retries("declare jetstream", lambda: bus.declare_jetstream(nc.jetstream()))
        supervisor = ShadowSupervisor(config, nc, kv)
        stack.push_async_callback(supervisor.stop)
        await supervisor.start()
        await stopping.wait()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
