"""The shadow side of a rollout worker: stand by, watch the main, take over when told.

A shadow has built everything it needs to serve (weights and KV arena mapped from the servers, the
engine, its NATS connection) and then idles: it runs no inference, it only watches the main. The
main's exit shows at once on a pidfd; a hang shows as a heartbeat file whose mtime stops moving.
The shadow reports what it sees on stdout, one line each, and the shadow supervisor decides: it
alone kills the main, checks the servers, flushes the arena and then writes `promote` on the
shadow's stdin. The shadow checks its device with a small real operation and starts serving.

Lines on stdout: `idle weights=<instance> kv=<instance>` (the server instances that own what it
mapped), `main-failed exit`, `main-failed hang <age_s>`, `ready <epoch>`,
`unhealthy <why>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import torch

from belayer_rl.services.worker.engine import Engine
from belayer_rl.shared.config import WorkerConfig

# How often the heartbeat file's mtime is read. A hang is declared only after seconds of
# staleness, so 50 ms adds little to its detection and keeps an idle shadow near 0% CPU; an exit
# wakes the shadow at once through the pidfd.
HANG_POLL_S = 0.05
INJECT_DEVICE_FAULT_ENV = "BELAYER_INJECT_DEVICE_FAULT"  # a path; while it exists the check fails


def report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def heartbeat_age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # the main has not written it yet


async def stand_by(config: WorkerConfig, stopping: asyncio.Event, owners: str) -> bool:
    """Idle until `promote` arrives on stdin (True), or until stop or stdin closes (False)."""
    assert config.watch_file is not None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    main_exited = asyncio.Event()
    pidfd = -1
    try:
        pidfd = os.pidfd_open(config.watch_pid)
        loop.add_reader(pidfd, main_exited.set)
    except ProcessLookupError:
        main_exited.set()
    report(f"idle {owners}")
    command = asyncio.create_task(reader.readline())
    stop = asyncio.create_task(stopping.wait())
    exited = asyncio.create_task(main_exited.wait())
    reported = False
    try:
        while True:
            if command.done():
                line = command.result().decode().strip()
                if line == "promote":
                    return True
                if not line:  # stdin closed: the supervisor is gone
                    return False
                command = asyncio.create_task(reader.readline())
            if stop.done():
                return False
            if not reported:
                if main_exited.is_set():
                    report("main-failed exit")
                    reported = True
                elif (age := heartbeat_age(config.watch_file)) > config.hang_timeout_s:
                    report(f"main-failed hang {age:.3f}")
                    reported = True
            wake_on = [command, stop] if reported else [command, stop, exited]
            await asyncio.wait(wake_on, timeout=HANG_POLL_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (command, stop, exited):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if pidfd >= 0:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        transport.close()


def device_check(engine: Engine) -> tuple[bool, str]:
    """A small real operation on the engine's device (a kernel on a GPU), checked exactly."""
    if (fault := os.environ.get(INJECT_DEVICE_FAULT_ENV)) and Path(fault).exists():
        return False, "injected device fault"
    device = engine.cache.arena.device
    try:
        x = torch.arange(1, 65, dtype=torch.float32, device=device).reshape(8, 8)
        total = float((x @ torch.ones(8, 1, device=device)).sum().item())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except RuntimeError as exc:
        return False, f"device error: {exc}"
    if total != 2080.0:  # sum(1..64): small integers are exact in float32
        return False, f"device computed {total}, expected 2080"
    return True, "ok"
