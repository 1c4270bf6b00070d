"""`python -m belayer_rl.services.router`: run the router until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal

import uvloop

from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus, subjects
from belayer_rl.shared.config import RouterConfig, resolve_nats_url
from belayer_rl.shared.protocol import (
    AttachRequest,
    CancelRequest,
    ClientKeepAlive,
    EngineQuarantined,
    GenerateRequest,
    Heartbeat,
    StatusRequest,
    WorkerFailed,
    WorkerRegistration,
    WorkerStream,
)

log = logging.getLogger("belayer.router")
SHUTDOWN_FLUSH_S = 5.0


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="belayer-router", description="Run the Belayer router.")
    parser.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="k: log at least every k tokens")
    parser.add_argument("--heartbeat-timeout", type=float, default=1.0, help="seconds of worker silence")
    parser.add_argument(
        "--no-worker-deadline", type=float, default=30.0, help="seconds a request waits for an engine"
    )
    parser.add_argument("--dispatch-timeout", type=float, default=2.0, help="seconds to await a worker ack")
    parser.add_argument(
        "--handover-grace",
        type=float,
        default=0.0,
        help="seconds a failed engine's requests wait for its shadow",
    )
    parser.add_argument(
        "--client-timeout",
        type=float,
        default=60.0,
        help="seconds without a client following a request before it is cancelled",
    )
    args = parser.parse_args(argv)
    return RouterConfig(
        nats_url=resolve_nats_url(args.nats),
        chunk_tokens=args.chunk_tokens,
        heartbeat_timeout_s=args.heartbeat_timeout,
        no_worker_deadline_s=args.no_worker_deadline,
        dispatch_timeout_s=args.dispatch_timeout,
        handover_grace_s=args.handover_grace,
        client_timeout_s=args.client_timeout,
    )


async def serve(config: RouterConfig) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    router: Router | None = None

    async def on_reconnect() -> None:
        if router is not None:
            await router.on_reconnect()

    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(config.nats_url, "router", on_reconnect=on_reconnect)
        stack.push_async_callback(nc.close)
        js = nc.jetstream()
        kv = await bus.with_retries("declare jetstream", lambda: bus.declare_jetstream(js))
        router = Router(config, nc, js, kv)

        # Listen to workers before rebuilding, so no heartbeat of a serving engine is missed.
        subscriptions = [
            await bus.listen(nc, subjects.ROUTER_WORKER_STREAM, WorkerStream, router.on_worker_stream),
            await bus.listen(nc, subjects.event("heartbeat", "*"), Heartbeat, router.on_heartbeat),
            await bus.listen(
                nc, subjects.event("worker_registered", "*"), WorkerRegistration, router.on_registration
            ),
            await bus.listen(nc, subjects.event("worker_failed", "*"), WorkerFailed, router.on_worker_failed),
            await bus.listen(
                nc, subjects.event("engine_quarantined", "*"), EngineQuarantined, router.on_quarantined
            ),
        ]
        started = await router.rebuild()
        subscriptions += [
            await bus.serve(nc, subjects.ROUTER_GENERATE, GenerateRequest, router.on_generate),
            await bus.serve(nc, subjects.ROUTER_ATTACH, AttachRequest, router.on_attach),
            await bus.serve(nc, subjects.ROUTER_CANCEL, CancelRequest, router.on_cancel),
            await bus.serve(nc, subjects.ROUTER_STATUS, StatusRequest, router.on_status),
            await bus.listen(nc, subjects.ROUTER_KEEPALIVE, ClientKeepAlive, router.on_keepalive),
        ]
        await bus.publish(nc, subjects.event("router_started", str(started.router_pid)), started)
        log.info(
            "router up: %d requests rebuilt, %d resumed", started.rebuilt_requests, started.resumed_requests
        )

        async with asyncio.TaskGroup() as tasks:
            watchdog = tasks.create_task(router.watchdog())
            writer = tasks.create_task(router.writer.run())
            await stopping.wait()
            for sub in subscriptions:  # stop intake, then let the log catch up
                await sub.unsubscribe()
            with contextlib.suppress(TimeoutError):
                await router.writer.flush(SHUTDOWN_FLUSH_S)
            watchdog.cancel()
            writer.cancel()
            for task in list(router.tasks):
                task.cancel()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
