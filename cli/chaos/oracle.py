"""What a chaos campaign checks afterwards: the token log's records against the attempts and the
clients' tokens, and that nothing leaked (processes, consumers)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

from belayer_rl.cli.chaos.workload import Output
from belayer_rl.cli.cluster import (
    Supervisor,
)
from belayer_rl.services.router import token_log
from belayer_rl.shared.protocol import (
    LogChunk,
    LogDispatch,
    LogEnd,
    LogStart,
    LogTakeover,
)
from belayer_rl.shared.subjects import Subjects

END_DURABLE_WAIT_S = 15.0  # for the LogEnds of requests whose clients already heard of their end


async def check_token_log(
    js, names: Subjects, finished: dict[str, Output], *, end_wait_s: float = END_DURABLE_WAIT_S
) -> list[str]:
    """The log's own invariants, request by request, and the tokens and logprobs it holds for each
    finished one.

    The router tells a request's clients of its end as it queues the LogEnd, so a client may
    finish before its end is in the log. The log is read again, for a bounded time, while a
    finished request's end is all that is missing."""
    deadline = time.monotonic() + end_wait_s
    while True:
        violations, unended = await read_token_log(js, names, finished)
        if not unended or time.monotonic() > deadline:
            return violations
        await asyncio.sleep(0.5)


async def read_token_log(js, names: Subjects, finished: dict[str, Output]) -> tuple[list[str], bool]:
    """One read of the log: its violations, and whether a finished request lacks only its end."""
    violations: list[str] = []
    claimed: dict[str, int] = {}  # request -> highest incarnation that claimed it
    current: dict[str, tuple[str, int, int]] = {}  # request -> the (engine, epoch, attempt) last dispatched
    logged: dict[str, token_log.LoggedRequest] = {}
    async for stored in token_log.each_record(js, names):
        record = stored.record
        if record is None:
            violations.append(f"{stored.subject} #{stored.sequence} does not decode: {stored.error}")
            continue
        request_id = record.request_id
        written = token_log.written_by(record)
        if written and written < claimed.get(request_id, 0):
            violations.append(f"{request_id} #{stored.sequence}: written by incarnation {written} after "
                              f"incarnation {claimed[request_id]} claimed it")  # fmt: skip
        match record:
            case LogStart():
                logged[request_id] = token_log.LoggedRequest(record)
            case LogTakeover():
                claimed[request_id] = max(claimed.get(request_id, 0), record.incarnation)
            case LogDispatch():
                current[request_id] = (record.engine_id, record.epoch, record.attempt)
            case LogChunk():
                source = (record.engine_id, record.epoch, record.attempt)
                whole = request_id in logged and len(record.tokens) == logged[request_id].start.chunk_tokens
                if whole and source != current.get(request_id):
                    violations.append(f"{request_id} chunk {record.index}: from {source}, but the request "
                                      f"was dispatched to {current.get(request_id)}")  # fmt: skip
                if request_id in logged:
                    logged[request_id].place(record)
            case LogEnd():
                if request_id in logged:
                    logged[request_id].end = record
    unended = False
    for request_id, output in finished.items():
        entry = logged.get(request_id)
        if entry is None:
            violations.append(f"{request_id}: finished, but its log has no start")
        elif entry.end is None:
            unended = True
            violations.append(f"{request_id}: finished, but its log has no end")
        elif entry.tokens != output.tokens:
            violations.append(f"{request_id}: the log holds {len(entry.tokens)} tokens, the client got "
                              f"{len(output.tokens)} (or other ones)")  # fmt: skip
        elif entry.logprobs != output.logprobs:
            violations.append(f"{request_id}: the log's logprobs differ from the client's at "
                              f"{first_difference(entry.logprobs, output.logprobs)}")  # fmt: skip
    return violations, unended


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot, field 22 of /proc/<pid>/stat), or None
    when it is gone. With its pid it names one process, however often pids are handed out again."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def outliving(pids: dict[int, int | None]) -> list[int]:
    """The processes of `pids` (pid -> start_ticks when seen) that still run. A pid that names a
    process started at another time now was handed out again: not ours."""
    found = []
    for pid, started in sorted(pids.items()):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            os.kill(pid, 0)
            alive = not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
            if alive and (started is None or start_ticks(pid) == started):
                found.append(pid)
    return found


def leaks(cluster: Supervisor, pids: dict[int, int | None]) -> list[str]:
    """What the stopped cluster left behind: segments, processes, containers, checkpoints."""
    found = [f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith(cluster.shm_prefix)]
    found += [f"process {pid}" for pid in outliving(pids)]
    checkpoints = cluster.config.state_dir / "checkpointer"
    if checkpoints.exists():
        found += [str(p) for p in checkpoints.rglob("chaos-*") if p.is_dir() and any(p.iterdir())]
    return found


async def consumers(js) -> set[str]:
    """Every durable or ephemeral consumer the server holds, as stream/name."""
    found = set()
    for stream in await js.streams_info():
        found |= {f"{stream.config.name}/{c.name}" for c in await js.consumers_info(stream.config.name)}
    return found


def first_difference(got: list[int] | list[float], want: list[int] | list[float]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )
    return f"position {at} (got {len(got)} tokens, want {len(want)})"
