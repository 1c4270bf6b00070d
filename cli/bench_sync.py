"""`belayer bench sync`: what syncing each JetStream write before its acknowledgement costs.

Two nats-servers in one run, one with `sync_interval: always` (what `belayer up` and compose.yaml
run) and one with nats-server's default (a sync every two minutes), measured in alternated rounds:
- acknowledged publishes one at a time, the way the router appends a LogStart or a LogTakeover;
- publishes with many in flight, the way the token-log writer's queue and the lease renewals
  add up under load;
- tokens/s of concurrent generations through a one-engine local cluster on each server.
Each figure is printed with and without, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import uvloop
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

from belayer_rl.cli.bench_report import Report, emit
from belayer_rl.cli.cluster import ClusterConfig, UpSettings, local_cluster
from belayer_rl.shared.client import Client
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process

SETTINGS = {"always": True, "default": False}
PROMPT = "An agent asks for a tool call and then waits for the sandbox to answer. "


def add_parser(kinds: argparse._SubParsersAction) -> None:
    sync = kinds.add_parser("sync", help="the cost of JetStream writes synced before they are acknowledged")
    sync.add_argument("--rounds", type=int, default=5, help="alternated rounds of each measurement")
    sync.add_argument("--publishes", type=int, default=500, help="publishes per round")
    sync.add_argument("--in-flight", type=int, default=64, help="publishes in flight at once (batched)")
    sync.add_argument("--requests", type=int, default=8, help="concurrent generations per round")
    sync.add_argument("--max-tokens", type=int, default=96, help="tokens per generation")
    sync.add_argument("--preset", default="tiny", help="model preset of the clusters")
    sync.add_argument("--json", action="store_true", help="print one JSON object")
    sync.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return emit(uvloop.run(bench(args)), args.json, print_table)


@contextlib.asynccontextmanager
async def server(folder: Path, sync_always: bool) -> AsyncIterator[NATS]:
    port = free_port()
    await asyncio.to_thread(folder.mkdir, parents=True)
    process = await start_nats_server(
        folder / "jetstream", port, folder / "nats.log", sync_always=sync_always
    )
    try:
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            await nc.jetstream().add_stream(StreamConfig(name="BENCH", subjects=["bench.>"]))
            yield nc
        finally:
            await nc.close()
    finally:
        await stop_process(process)


async def one_at_a_time(nc: NATS, n: int) -> float:
    js = nc.jetstream()
    started = time.perf_counter()
    for i in range(n):
        await js.publish(f"bench.{i % 64}", b"x" * 64)
    return n / (time.perf_counter() - started)


async def in_flight(nc: NATS, n: int, width: int) -> float:
    js = nc.jetstream()
    started = time.perf_counter()
    for first in range(0, n, width):
        await asyncio.gather(
            *(js.publish(f"bench.{i % 64}", b"x" * 64) for i in range(first, min(n, first + width)))
        )
    return n / (time.perf_counter() - started)


async def generations(client: Client, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            client.generate_all(PROMPT, max_tokens=args.max_tokens, seed=i, temperature=0.8)
            for i in range(args.requests)
        )
    )
    return sum(len(r.tokens) for r in results) / (time.perf_counter() - started)


def compare(rounds: dict[str, list[float]], unit: str) -> Report:
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    return {
        "unit": unit,
        **{
            name: {
                "median": round(m, 1),
                "min": round(min(rounds[name]), 1),
                "max": round(max(rounds[name]), 1),
            }
            for name, m in medians.items()
        },
        "ratio_always_to_default": round(medians["always"] / medians["default"], 3),
    }


async def bench(args: argparse.Namespace) -> Report:
    report: Report = {"rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="belayer-bench-sync-") as folder:
        async with contextlib.AsyncExitStack() as stack:
            servers = {
                name: await stack.enter_async_context(server(Path(folder) / name, always))
                for name, always in SETTINGS.items()
            }
            single: dict[str, list[float]] = {name: [] for name in SETTINGS}
            batched: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for _ in range(args.rounds):
                for name, nc in servers.items():
                    single[name].append(await one_at_a_time(nc, args.publishes))
                    batched[name].append(await in_flight(nc, args.publishes, args.in_flight))
        report["acknowledged_one_at_a_time"] = compare(single, "publishes/s")
        report["acknowledged_in_flight"] = {"in_flight": args.in_flight, **compare(batched, "publishes/s")}
        async with contextlib.AsyncExitStack() as stack:
            clients: dict[str, Client] = {}
            for name, always in SETTINGS.items():
                config = ClusterConfig(
                    state_dir=Path(folder) / f"cluster-{name}", engines=1, services=UpSettings(preset=args.preset),
                    shadows=False, sandboxes=False, nats_sync_always=always,
                )  # fmt: skip
                supervisor = await stack.enter_async_context(local_cluster(config))
                clients[name] = await stack.enter_async_context(
                    await Client.connect(supervisor.target(), "bench-sync")
                )
                await clients[name].wait_for_engines(1, 300)
            rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for client in clients.values():  # warm-up
                await generations(client, args)
            for _ in range(args.rounds):
                for name, client in clients.items():
                    rates[name].append(await generations(client, args))
        report["rollout"] = {"preset": args.preset, "requests": args.requests, **compare(rates, "tokens/s")}
    return report


def print_table(report: Report) -> None:
    print(f"JetStream writes synced before their acknowledgement, {report['rounds']} alternated rounds")
    for key, label in (
        ("acknowledged_one_at_a_time", "publishes, one at a time"),
        ("acknowledged_in_flight", "publishes, many in flight"),
        ("rollout", "generations through the router"),
    ):
        figure = report[key]
        a, d = figure["always"], figure["default"]
        print(
            f"  {label:<32} always {a['median']:>9} {figure['unit']} (min {a['min']}, max {a['max']});"
            f" default {d['median']:>9} (min {d['min']}, max {d['max']}); ratio {figure['ratio_always_to_default']}"
        )
