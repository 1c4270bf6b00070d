"""`python -m belayer_rl.services.weight_server`: the weight server of this host, until SIGTERM/SIGINT.

Stopping removes every segment it made; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import torch
import uvloop

from belayer_rl.services.weight_server.server import WeightServer, WeightServerConfig
from belayer_rl.shared import bus, subjects
from belayer_rl.shared.config import resolve_nats_url
from belayer_rl.shared.protocol import (
    ServerPing,
    WeightsHandlesRequest,
    WeightsList,
    WeightsPin,
    WeightsPublish,
    WeightsUnpin,
)
from belayer_rl.shared.segments import PrefixBusy

log = logging.getLogger("belayer.weight_server")


def parse_args(argv: list[str] | None = None) -> WeightServerConfig:
    parser = argparse.ArgumentParser(
        prog="belayer-weight-server", description="Own this host's model weights in shared memory."
    )
    parser.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    parser.add_argument("--preset", default="tiny", help="model size preset the weights must fit")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of random initial weights")
    parser.add_argument("--weights", type=Path, help="initial weights file (overrides --weights-seed)")
    parser.add_argument(
        "--shm-prefix", default="belayer", help="names of its /dev/shm segments start with <prefix>.w."
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the weights live (auto: cuda when torch sees a GPU)",
    )
    parser.add_argument(
        "--sweep-interval", type=float, default=1.0, help="seconds between dead-holder sweeps"
    )
    parser.add_argument(
        "--free-grace",
        type=float,
        default=10.0,
        help="seconds an unpinned version other than the newest is kept before it is freed",
    )
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return WeightServerConfig(
        nats_url=resolve_nats_url(args.nats),
        preset=args.preset,
        shm_prefix=args.shm_prefix,
        weights_seed=args.weights_seed,
        weights_path=args.weights,
        device=device,
        sweep_interval_s=args.sweep_interval,
        free_grace_s=args.free_grace,
    )


async def sweep_forever(server: WeightServer) -> None:
    while True:
        await asyncio.sleep(server.config.sweep_interval_s)
        try:
            server.sweep()
        except Exception:
            log.exception("sweep failed")


async def serve(config: WeightServerConfig) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async with contextlib.AsyncExitStack() as stack:
        server = WeightServer(config)
        stack.callback(server.close)  # runs last: nothing stays in /dev/shm
        await server.load_initial()
        nc = await bus.unless_stopped(stopping, bus.connect(config.nats_url, "weight-server"))
        if nc is None:
            return
        stack.push_async_callback(nc.close)
        server.nc = nc
        subscriptions = [
            await bus.serve(nc, subjects.WEIGHTS_LIST, WeightsList, server.on_list),
            await bus.serve(nc, subjects.WEIGHTS_HANDLES, WeightsHandlesRequest, server.on_handles),
            await bus.serve(nc, subjects.WEIGHTS_PIN, WeightsPin, server.on_pin),
            await bus.serve(nc, subjects.WEIGHTS_UNPIN, WeightsUnpin, server.on_unpin),
            await bus.serve(nc, subjects.WEIGHTS_PUBLISH, WeightsPublish, server.on_publish),
            await bus.serve(nc, subjects.WEIGHTS_PING, ServerPing, server.on_ping),
        ]
        sweeper = asyncio.create_task(sweep_forever(server), name="sweep")
        log.info(
            "weight server %s serving %s from %s* (%s)",
            server.instance,
            server.newest,
            server.lock.prefix,
            config.device,
        )
        await stopping.wait()
        for sub in subscriptions:  # stop intake, then let in-flight replies go out
            await sub.unsubscribe()
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        await nc.flush()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        uvloop.run(serve(config))
    except PrefixBusy as exc:
        sys.exit(f"weight server: {exc}")


if __name__ == "__main__":
    main()
