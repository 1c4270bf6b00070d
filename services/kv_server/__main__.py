"""`python -m belayer_rl.services.kv_server`: the kv-server of this host, until SIGTERM/SIGINT.

Stopping removes every arena segment; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import torch
import uvloop

from belayer_rl.services.kv_server.server import KvServer, KvServerConfig
from belayer_rl.shared import bus, subjects
from belayer_rl.shared.config import resolve_nats_url
from belayer_rl.shared.protocol import KvArenaRequest, KvFlush, KvRelease, ServerPing
from belayer_rl.shared.segments import PrefixBusy

log = logging.getLogger("belayer.kv_server")


def parse_args(argv: list[str] | None = None) -> KvServerConfig:
    parser = argparse.ArgumentParser(
        prog="belayer-kv-server", description="Own this host's KV-cache arenas in shared memory."
    )
    parser.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    parser.add_argument(
        "--shm-prefix", default="belayer", help="names of its /dev/shm segments start with <prefix>.kv."
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where arenas live (auto: cuda when torch sees a GPU)",
    )
    parser.add_argument("--max-arena-mb", type=int, default=16 << 10, help="largest arena of one engine")
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return KvServerConfig(
        nats_url=resolve_nats_url(args.nats),
        shm_prefix=args.shm_prefix,
        device=device,
        max_arena_bytes=args.max_arena_mb << 20,
    )


async def serve(config: KvServerConfig) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async with contextlib.AsyncExitStack() as stack:
        server = KvServer(config)
        stack.callback(server.close)  # runs last: nothing stays in /dev/shm
        nc = await bus.unless_stopped(stopping, bus.connect(config.nats_url, "kv-server"))
        if nc is None:
            return
        stack.push_async_callback(nc.close)
        subscriptions = [
            await bus.serve(nc, subjects.KV_ARENA, KvArenaRequest, server.on_arena),
            await bus.serve(nc, subjects.KV_FLUSH, KvFlush, server.on_flush),
            await bus.serve(nc, subjects.KV_RELEASE, KvRelease, server.on_release),
            await bus.serve(nc, subjects.KV_PING, ServerPing, server.on_ping),
        ]
        log.info("kv-server %s serving from %s* (%s)", server.instance, server.lock.prefix, config.device)
        await stopping.wait()
        for sub in subscriptions:  # stop intake, then let in-flight replies go out
            await sub.unsubscribe()
        await nc.flush()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    try:
        uvloop.run(serve(config))
    except PrefixBusy as exc:
        sys.exit(f"kv-server: {exc}")


if __name__ == "__main__":
    main()
