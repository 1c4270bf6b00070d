"""`belayer bench takeover`: how long a successor router takes to rebuild, against the requests
that ended before it.

One nats-server (synced writes, as `belayer up` runs it) holds a token log of `--ended` requests
that ended and `--running` that still run, each with its index entry, written the way a router
writes them. Each round starts a router in this process, takes the lease and times its rebuild:
it reads the open entries of the request index and those requests' records, and claims them. The
baseline, in the same rounds, is what a takeover read before the request index: every record of
the log (`token_log.read_all` of the whole stream; a lower bound of that takeover, which also
built a request for each ended one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import uvloop
from nats.aio.client import Client as NATS

from belayer_rl.cli.bench_report import Report, emit
from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import Lease, lease_bucket
from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from belayer_rl.shared.protocol import (
    IndexComplete,
    LogChunk,
    LogClosed,
    LogEnd,
    LogOpen,
    LogStart,
    SamplingParams,
)
from belayer_rl.shared.runtime import Runtime

IN_FLIGHT = 256  # publishes in flight while the log is filled
CHUNK_TOKENS = 16


def add_parser(kinds: argparse._SubParsersAction) -> None:
    takeover = kinds.add_parser(
        "takeover", help="a successor router's rebuild against a log of ended requests"
    )
    takeover.add_argument("--ended", type=int, default=10_000, help="requests that ended, in the log")
    takeover.add_argument("--running", type=int, default=10, help="requests still running, in the log")
    takeover.add_argument("--rounds", type=int, default=5, help="takeovers timed, each beside a baseline")
    takeover.add_argument("--json", action="store_true", help="print one JSON object")
    takeover.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return emit(uvloop.run(bench(args)), args.json, print_table)


@contextlib.asynccontextmanager
async def server(folder: Path) -> AsyncIterator[NATS]:
    port = free_port()
    process = await start_nats_server(folder / "jetstream", port, folder / "nats.log", sync_always=True)
    try:
        nc = await bus.connect(f"nats://127.0.0.1:{port}", "bench-takeover")
        try:
            yield nc
        finally:
            await nc.close()
    finally:
        await stop_process(process)


async def in_flight(writes: list[Awaitable[object]]) -> None:
    for first in range(0, len(writes), IN_FLIGHT):
        await asyncio.gather(*writes[first : first + IN_FLIGHT])


async def fill(nc: NATS, config: RouterConfig, ended: int, running: int) -> None:
    """The log and index a router leaves: each request's start and one chunk, and for the ended ones
    an end and a closed entry (ended now, so none is due within the bench)."""
    js, names = nc.jetstream(), config.subjects

    def record(subject: str, message: protocol.Message) -> Awaitable[object]:
        return js.publish(subject, protocol.encode(message))

    writes: list[Awaitable[object]] = []
    for i in range(ended + running):
        request_id = f"ended-{i}" if i < ended else f"running-{i}"
        start = LogStart(request_id=request_id, prompt_tokens=list(range(1, 40)), max_tokens=64,
                         sampling=SamplingParams(seed=i), chunk_tokens=CHUNK_TOKENS, owner="cli")  # fmt: skip
        chunk = LogChunk(
            request_id=request_id, index=0, position=0, tokens=list(range(CHUNK_TOKENS)), attempt=1
        )
        writes += [record(names.token_log(request_id), start), record(names.token_log(request_id), chunk)]
        if i < ended:
            end = LogEnd(request_id=request_id, finish_reason="length", num_tokens=CHUNK_TOKENS)
            closed = LogClosed(
                request_id=request_id, owner="cli", end_sequence=0, size=0, ended_at=time.time()
            )
            writes += [
                record(names.token_log(request_id), end),
                record(names.request_closed(request_id), closed),
            ]
        else:
            writes.append(record(names.request_open(request_id), LogOpen(request_id=request_id, owner="cli")))
    writes.append(record(names.request_index_complete, IndexComplete(since=time.time())))  # a router's log
    await in_flight(writes)


async def takeover(nc: NATS, config: RouterConfig) -> tuple[float, int]:
    """One router's rebuild, timed from the lease taken to the requests placed; and how many."""
    js = nc.jetstream()
    kv = await bus.declare_jetstream(js, config.subjects, ended_keep_s=config.ended_keep_s)
    lease = Lease(await lease_bucket(js, config.subjects, 1), config.lease_ttl_s)
    runtime = Runtime("bench-takeover", config)
    router = Router(config, nc, js, kv, lease, runtime.spawn, runtime.record_skipped)
    await lease.acquire()
    try:
        started = time.perf_counter()
        rebuilt = await router.rebuild()
        took = time.perf_counter() - started
    finally:
        await lease.release()
        await runtime.shutdown()
    return took, rebuilt.rebuilt_requests


async def full_read(nc: NATS, config: RouterConfig) -> tuple[float, int]:
    started = time.perf_counter()
    logged, _ = await token_log.read_all(nc.jetstream(), config.subjects)
    return time.perf_counter() - started, len(logged)


def figure(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


async def bench(args: argparse.Namespace) -> Report:
    config = RouterConfig(nats_url="nats://unused", cluster_id="bench", ended_keep_s=3600.0)
    with tempfile.TemporaryDirectory(prefix="belayer-bench-takeover-") as folder:
        async with server(Path(folder)) as nc:
            await bus.declare_jetstream(nc.jetstream(), config.subjects, ended_keep_s=config.ended_keep_s)
            filling = time.perf_counter()
            await fill(nc, config, args.ended, args.running)
            filled_s = time.perf_counter() - filling
            rebuilds: list[float] = []
            reads: list[float] = []
            rebuilt = read = 0
            for _ in range(args.rounds):
                took, rebuilt = await takeover(nc, config)
                rebuilds.append(took)
                took, read = await full_read(nc, config)
                reads.append(took)
    median_rebuild, median_read = statistics.median(rebuilds), statistics.median(reads)
    return {
        "ended": args.ended,
        "running": args.running,
        "rounds": args.rounds,
        "fill_s": round(filled_s, 2),
        "takeover_s": {**figure(rebuilds), "requests_rebuilt": rebuilt},
        "baseline_whole_log_read_s": {**figure(reads), "requests_read": read},
        "ratio_takeover_to_baseline": round(median_rebuild / median_read, 4),
    }


def print_table(report: Report) -> None:
    rebuild, read = report["takeover_s"], report["baseline_whole_log_read_s"]
    print(
        f"router takeover with {report['ended']} ended and {report['running']} running requests in the token log,"
        f" {report['rounds']} rounds (filled in {report['fill_s']} s)"
    )
    print(
        f"  takeover (index, then in-flight records) {rebuild['median']:.4f} s"
        f" (min {rebuild['min']}, max {rebuild['max']}), {rebuild['requests_rebuilt']} rebuilt"
    )
    print(
        f"  baseline: read of the whole log         {read['median']:.4f} s"
        f" (min {read['min']}, max {read['max']}), {read['requests_read']} requests"
    )
    print(f"  ratio takeover / baseline               {report['ratio_takeover_to_baseline']}")
