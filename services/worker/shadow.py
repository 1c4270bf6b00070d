"""The shadow side of a rollout worker: stand by, watch the main, take over when told.

A shadow has built everything it needs to serve (weights and KV arena mapped from the servers, the
engine, its NATS connection) and then idles: it runs no inference, it only watches the main. The
main's exit shows at once on a pidfd; a hang shows as a heartbeat file whose mtime stops moving.
The shadow reports what it sees on stdout and the shadow supervisor decides: it alone kills the
main, checks the servers, flushes the arena and then commands a promotion on the shadow's stdin.
The shadow checks its device with a small real operation and starts serving.

Both directions carry the shadow-pipe messages of shared/protocol.py, one encoded message per
line: WorkerIdle, MainFailed, WorkerReady and WorkerUnhealthy on stdout (a main under the
supervisor reports WorkerReady too), PromoteShadow on stdin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from belayer_rl.services.worker.engine import ServingEngine
from belayer_rl.shared.config import WorkerConfig
from belayer_rl.shared.protocol import (
    BadMessage,
    MainFailed,
    PromoteShadow,
    ShadowCommand,
    WorkerIdle,
    WorkerReady,
    WorkerReport,
    WorkerUnhealthy,
    decode,
    decoder_for,
    encode,
)

log = logging.getLogger("belayer.worker.shadow")

# How often the heartbeat file's mtime is read. A hang is declared only after seconds of
# staleness, so 50 ms adds little to its detection and keeps an idle shadow near 0% CPU; an exit
# wakes the shadow at once through the pidfd.
HANG_POLL_S = 0.05
INJECT_DEVICE_FAULT_ENV = "BELAYER_INJECT_DEVICE_FAULT"  # a path; while it exists the check fails
COMMANDS = decoder_for(ShadowCommand)  # stateless: one decoder serves every line


def report(message: WorkerReport) -> None:
    """One line on stdout for the supervisor, sent at once: it may be waiting on it to hand over."""
    sys.stdout.flush()  # anything printed before goes first, so lines never interleave
    sys.stdout.buffer.write(encode(message) + b"\n")
    sys.stdout.buffer.flush()


def report_ready(epoch: int) -> None:
    """The worker serves under `epoch` (a main or cold worker at start-up, a shadow once promoted)."""
    report(WorkerReady(epoch=epoch))


def report_unhealthy(why: str) -> None:
    """The worker will not serve; the supervisor takes the cold path and gives `why` as the reason."""
    report(WorkerUnhealthy(why=why))


def parse_command(line: bytes) -> ShadowCommand | None:
    """The command on one line of stdin, or None (logged) when the line is not one."""
    try:
        return decode(COMMANDS, line)
    except BadMessage as exc:
        log.warning("ignored a line on stdin that is not a command (%s): %.200r", exc, line)
        return None


def heartbeat_age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0  # the main has not written it yet


async def stand_by(config: WorkerConfig, stopping: asyncio.Event, owners: WorkerIdle) -> bool:
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
    report(owners)
    command = asyncio.create_task(reader.readline())
    stop = asyncio.create_task(stopping.wait())
    exited = asyncio.create_task(main_exited.wait())
    reported = False
    try:
        while True:
            if command.done():
                try:
                    line = command.result()
                except ValueError:  # a line over the reader's limit: asyncio has dropped it
                    log.warning("ignored an oversized line on stdin")
                else:
                    if not line:  # stdin closed: the supervisor is gone
                        return False
                    if isinstance(parse_command(line), PromoteShadow):
                        return True
                command = asyncio.create_task(reader.readline())
            if stop.done():
                return False
            if not reported:
                if main_exited.is_set():
                    report(MainFailed(reason="exit"))
                    reported = True
                elif (age := heartbeat_age(config.watch_file)) > config.hang_timeout_s:
                    report(MainFailed(reason="hang", heartbeat_age_s=round(age, 3)))
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


def device_check(engine: ServingEngine) -> tuple[bool, str]:
    """A small real operation on the engine's device (a kernel on a GPU), checked exactly."""
    if (fault := os.environ.get(INJECT_DEVICE_FAULT_ENV)) and Path(fault).exists():
        return False, "injected device fault"
    device = engine.device
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
