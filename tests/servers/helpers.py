"""Helpers for the server tests: the servers as real subprocesses, typed requests, /dev/shm and smaps."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec
from nats.aio.client import Client as NATS

from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.processes import stop_process
from belayer_rl.shared.protocol import ErrorReply, KvServerAlive, Message, ServerPing, WeightServerAlive
from belayer_rl.shared.segments import SHM_DIR
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects()  # the default cluster's names

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0

PING = {
    "weight_server": (NAMES.weights_ping, WeightServerAlive),
    "kv_server": (NAMES.kv_ping, KvServerAlive),
}


@dataclass
class Server:
    kind: str  # "weight_server" or "kv_server"
    process: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")


async def start(kind: str, nats_url: str, prefix: str, log_dir: Path, *args: str) -> Server:
    """Start `python -m belayer_rl.services.<kind>` and wait until it answers a ping with its pid."""
    log = log_dir / f"{kind}-{secrets.token_hex(3)}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"belayer_rl.services.{kind}",
            "--nats", nats_url, "--shm-prefix", prefix, *args,
            stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
    server = Server(kind, process, log)
    subject, kind_alive = PING[kind]
    async with contextlib.AsyncExitStack() as stack:
        nc = await bus.connect(nats_url, "test-wait")
        stack.push_async_callback(nc.close)
        async with asyncio.timeout(120):
            while True:
                if process.returncode is not None:
                    raise RuntimeError(f"{kind} exited with {process.returncode}:\n{server.output()}")
                with contextlib.suppress(ServiceError):
                    alive = await bus.request_struct(nc, subject, ServerPing(), kind_alive, 1.0)
                    if alive.pid == process.pid:
                        return server
                await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(kind: str, nats_url: str, prefix: str, log_dir: Path, *args: str) -> AsyncIterator[Server]:
    server = await start(kind, nats_url, prefix, log_dir, *args)
    try:
        yield server
    finally:
        await stop_process(server.process)


async def call(nc: NATS, subject: str, message: Message, kind: type[T]) -> T:
    return await bus.request_struct(nc, subject, message, kind, TIMEOUT_S)


async def error_of(nc: NATS, subject: str, payload: bytes) -> ErrorReply:
    """Send raw bytes; the reply must be an ErrorReply."""
    reply = await nc.request(subject, payload, timeout=TIMEOUT_S)
    answer = protocol.decode(protocol.decoder_for(protocol.Reply), reply.data)
    assert isinstance(answer, ErrorReply), answer
    return answer


async def error_code(nc: NATS, subject: str, message: Message) -> str:
    return (await error_of(nc, subject, protocol.encode(message))).code


def shm_names(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def smaps_of(pid: int, segment: str) -> dict[str, int | str]:
    """The mapping of /dev/shm/`segment` in process `pid`: its permissions and kB fields, summed
    over its VMAs."""
    found: dict[str, int | str] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(f"/dev/shm/{segment}")
            if inside:
                found["perms"] = head[1]
            continue
        if inside and len(head) == 3 and head[2] == "kB":
            key = head[0].rstrip(":")
            found[key] = int(found.get(key, 0)) + int(head[1])
    return found


def encode_json(value: object) -> bytes:
    return msgspec.json.encode(value)
