"""`python -m belayer_rl.services.checkpointer`: the checkpointer of one Docker host, until SIGTERM/SIGINT.

RPC arrives on `belayer.sandbox.<host>.<verb>` through one subscription, so requests are seen in
the order they were sent; each runs as its own task (a long action on one sandbox does not hold
up another) and takes its place in its sandbox's FIFO before its first wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from belayer_rl.services.checkpointer import objects, pointer
from belayer_rl.services.checkpointer.checkpointer import Checkpointer, CheckpointerConfig
from belayer_rl.services.checkpointer.phases import PHASES
from belayer_rl.services.checkpointer.sandbox import Engine
from belayer_rl.shared import bus, protocol, subjects
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import default_state_dir, resolve_nats_url
from belayer_rl.shared.protocol import ErrorReply, Message, SandboxRequest

log = logging.getLogger("belayer.checkpointer")
SHUTDOWN_GRACE_S = 30.0
VERBS: dict[type[Message], str] = {
    protocol.SandboxCreate: "create",
    protocol.SandboxExec: "exec",
    protocol.SandboxCheckpoint: "checkpoint",
    protocol.SandboxRestore: "restore",
    protocol.SandboxDestroy: "destroy",
    protocol.SandboxList: "list",
    protocol.TrajectoryEnd: "end",
}


def default_host_id() -> str:
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())
    return name[:64] or "host"


def parse_args(argv: list[str] | None = None) -> CheckpointerConfig:
    parser = argparse.ArgumentParser(
        prog="belayer-checkpointer", description="Run the checkpointer of one Docker host."
    )
    parser.add_argument("--nats", help="NATS URL (default: $BELAYER_NATS_URL or the local cluster)")
    parser.add_argument(
        "--host-id", default=default_host_id(), help="this Docker host's id (default: hostname)"
    )
    parser.add_argument(
        "--state-dir", type=Path, help="records and checkpoints (default: <belayer state>/checkpointer)"
    )
    parser.add_argument("--docker", help="Docker Engine URL (default: $DOCKER_HOST or the local socket)")
    parser.add_argument("--disk-budget-gb", type=float, default=50.0, help="checkpoint store bound; 0: none")
    parser.add_argument(
        "--object-store",
        action="store_true",
        help="upload checkpoints to JetStream for restores on other hosts",
    )
    parser.add_argument(
        "--crash-at", default="", choices=("", *PHASES), help="chaos: SIGKILL self at this phase"
    )
    args = parser.parse_args(argv)
    state_dir = args.state_dir or default_state_dir() / "checkpointer"
    return CheckpointerConfig(
        nats_url=resolve_nats_url(args.nats),
        host_id=args.host_id,
        state_dir=state_dir.resolve(),
        docker_url=args.docker,
        disk_budget_gb=args.disk_budget_gb,
        crash_at=args.crash_at,
        object_store=args.object_store,
    )


async def serve_ordered(
    nc: NATS,
    subject: str,
    handlers: dict[type[Message], Callable[[Any], Awaitable[Message]]],
    tasks: set[asyncio.Task[None]],
) -> Subscription:
    """Like bus.serve, over one subject pattern and a union of requests, one task per request in
    arrival order; errors cross the wire the same way (bad-request, the ServiceError's code, internal)."""
    decoder = protocol.decoder_for(SandboxRequest)

    async def answer(msg: Msg) -> None:
        try:
            request = protocol.decode(decoder, msg.data)
            verb, kind = msg.subject.rsplit(".", 1)[-1], type(request)
            if VERBS.get(kind) != verb:
                raise protocol.BadMessage(f"a {kind.__name__} does not belong on {msg.subject}")
            reply: Message = await handlers[kind](request)
        except protocol.BadMessage as exc:
            log.warning("dropped bad message on %s: %s", msg.subject, exc)
            reply = ErrorReply(code="bad-request", message=str(exc))
        except ServiceError as exc:
            log.info("%s: %s", msg.subject, exc)
            reply = ErrorReply(code=exc.code, message=exc.message)
        except Exception as exc:
            log.exception("handler for %s failed", msg.subject)
            reply = ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
        if msg.reply:
            try:
                await bus.publish(nc, msg.reply, reply)
            except Exception as exc:
                log.warning("could not reply on %s: %s", msg.subject, exc)

    async def on_message(msg: Msg) -> None:
        task = asyncio.create_task(answer(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await nc.subscribe(subject, cb=on_message, pending_bytes_limit=256 << 20)


async def serve(config: CheckpointerConfig) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(config.nats_url, f"checkpointer-{config.host_id}")
        stack.push_async_callback(nc.close)
        kv = await bus.with_retries("declare prefix pointers", lambda: pointer.declare(nc.jetstream()))
        engine = await Engine.connect(config.docker_url)
        stack.push_async_callback(engine.close)
        checkpointer = Checkpointer(config, engine, nc, kv)
        if config.object_store:
            checkpointer.objects = await bus.with_retries(
                "declare checkpoint object store", lambda: objects.declare(nc.jetstream())
            )
        stack.push_async_callback(checkpointer.close)
        await checkpointer.reconcile()

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
        tasks: set[asyncio.Task[None]] = set()
        subscription = await serve_ordered(nc, subjects.sandbox_rpc_all(config.host_id), handlers, tasks)
        log.info(
            "checkpointer %s up: %d sandboxes, docker root %s, state %s",
            config.host_id, len(c.sandboxes), engine.data_root, config.state_dir,
        )  # fmt: skip
        watcher = asyncio.create_task(c.watch(), name="watch-engine")
        await stopping.wait()
        await subscription.unsubscribe()  # stop intake, then let in-flight work end
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        if tasks:
            _, late = await asyncio.wait(set(tasks), timeout=SHUTDOWN_GRACE_S)
            for task in late:
                task.cancel()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvloop.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
