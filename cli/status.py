"""`belayer status`: the local cluster's processes, the router's engines and requests, and every
declared kind of process's own account (its stats endpoint), as a table or JSON, once or watched."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import uvloop

from belayer_rl.cli.target import resolve_target
from belayer_rl.cli.up import pid_alive, read_cluster
from belayer_rl.services import SERVICES
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import ConfigError, hostname_id
from belayer_rl.shared.declaration import stats_keys

ROUTER_STATUS_TIMEOUT_S = 5.0  # bus.connect retries an unreachable server forever; status must answer
CLEAR_SCREEN = "\033[H\033[2J"  # cursor home, then clear: each `status --watch` frame replaces the last


class ProcessRow(msgspec.Struct, kw_only=True):
    name: str
    pid: int
    state: str


class EngineRow(msgspec.Struct, kw_only=True):
    id: str
    worker_pid: int
    epoch: int
    alive: bool
    shadow_pid: int  # 0: none (no shadows, or none ready)
    weight_version: str | None


class ServiceRow(msgspec.Struct, kw_only=True):
    """A service's own account (its stats endpoint): readiness and where its metrics are."""

    name: str
    pid: int
    ready: bool
    metrics_port: int  # 0: none


class StatusReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What `belayer status` shows; `--json` prints it as one object (router_error only when set)."""

    processes: list[ProcessRow]
    engines: list[EngineRow]
    requests_in_flight: int
    services: list[ServiceRow] = []
    router_error: str = ""


def cmd_status(args: argparse.Namespace) -> int:
    # The reason the router cannot be reached is part of the report; the bus's reconnect warnings
    # while it tries would only repeat it on stderr.
    logging.getLogger("belayer.bus").setLevel(logging.ERROR)
    if args.watch is None:
        print(render_status(status_report(args), args.json))
        return 0
    if not args.watch > 0:
        print(f"belayer status: --watch takes seconds > 0, got {args.watch:g}", file=sys.stderr)
        return 2
    # Ctrl-C sets a flag rather than raising: arriving while a frame asks the bus (inside an event
    # loop, which would take it as a cancellation and could go on), it must still end the watch.
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        while not interrupted.is_set():
            frame = render_status(status_report(args), args.json)
            if args.json:  # a program reading this gets one JSON line per refresh
                print(frame, flush=True)
            else:
                stamp = f"{time.strftime('%H:%M:%S')}, every {args.watch:g}s; Ctrl-C to stop"
                print(f"{CLEAR_SCREEN}{frame}\n\n{stamp}", flush=True)
            interrupted.wait(args.watch)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0


def status_report(args: argparse.Namespace) -> StatusReport:
    state_dir: Path = args.state_dir
    cluster = read_cluster(state_dir)
    processes: list[ProcessRow] = []
    if cluster is not None and pid_alive(cluster.supervisor_pid):
        processes = [ProcessRow(name="supervisor", pid=cluster.supervisor_pid, state="running")] + [
            ProcessRow(name=p.name, pid=p.pid, state=p.state) for p in cluster.processes
        ]
    try:
        target = resolve_target(args)
    except ConfigError as exc:
        return StatusReport(processes=processes, engines=[], requests_in_flight=0, router_error=str(exc))
    url = target.url
    try:
        status = uvloop.run(router_status(target))
    except TimeoutError:
        error = f"no answer from NATS at {url} within {ROUTER_STATUS_TIMEOUT_S:g}s"
        return StatusReport(processes=processes, engines=[], requests_in_flight=0, router_error=error)
    except (bus.ServiceError, OSError) as exc:
        error = f"router via {url}: {exc}"
        return StatusReport(processes=processes, engines=[], requests_in_flight=0, router_error=error)
    shadows = read_shadows(state_dir)
    workers = {
        e.engine_id: [pid for pid in (e.pid, shadows.get(e.engine_id, 0)) if pid] for e in status.engines
    }
    # Every declared kind of process, on this host (a local cluster's checkpointer runs here).
    keys = stats_keys(SERVICES, workers, hosts=[hostname_id()])
    services = uvloop.run(service_rows(target, keys))
    engines = [
        EngineRow(
            id=e.engine_id,
            worker_pid=e.pid,
            epoch=e.epoch,
            alive=e.alive,
            shadow_pid=shadows.get(e.engine_id, 0),
            weight_version=e.weight_version,
        )
        for e in status.engines
    ]
    return StatusReport(
        processes=processes, engines=engines, requests_in_flight=len(status.requests), services=services
    )


SERVICE_STATS_TIMEOUT_S = 1.0


async def service_rows(target: Target, names: list[str]) -> list[ServiceRow]:
    """Each named service's stats, asked at once; one that does not answer is left out."""
    nc = await target.connect("belayer-status")
    try:

        async def ask(name: str) -> ServiceRow | None:
            try:
                stats = await bus.request_struct(
                    nc,
                    target.subjects.service_stats(name),
                    protocol.StatsRequest(),
                    protocol.ServiceStats,
                    SERVICE_STATS_TIMEOUT_S,
                )
            except bus.ServiceError:
                return None
            return ServiceRow(
                name=stats.name, pid=stats.pid, ready=stats.ready, metrics_port=stats.metrics_port
            )

        rows = await asyncio.gather(*(ask(name) for name in names))
    finally:
        await nc.close()
    return [row for row in rows if row is not None]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-aligned columns as wide as their widest cell, two spaces apart."""
    cells = [list(header), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    pad = [[cell.ljust(width) for cell, width in zip(row, widths, strict=True)] for row in cells]
    return ["  ".join(row).rstrip() for row in pad]


def yes_no(alive: bool) -> str:
    return "yes" if alive else "NO"  # a dead engine should stand out


def render_status(report: StatusReport, as_json: bool) -> str:
    if as_json:
        return msgspec.json.encode(report).decode()
    lines = table(["PROCESS", "PID", "STATE"], [(p.name, p.pid, p.state) for p in report.processes])
    if not report.processes:
        lines.append("(none: no local cluster is running in this state dir)")
    lines.append("")
    lines += table(
        ["ENGINE", "WORKER PID", "EPOCH", "ALIVE", "SHADOW PID", "WEIGHTS"],
        [
            (e.id, e.worker_pid, e.epoch, yes_no(e.alive), e.shadow_pid or "-", e.weight_version or "-")
            for e in report.engines
        ],
    )
    if not report.engines:
        lines.append("(unknown: no answer from the router, see below)" if report.router_error else "(none)")
    if report.services:
        lines.append("")
        lines += table(
            ["SERVICE", "PID", "READY", "METRICS"],
            [
                (
                    s.name,
                    s.pid,
                    yes_no(s.ready),
                    f"http://127.0.0.1:{s.metrics_port}/metrics" if s.metrics_port else "-",
                )
                for s in report.services
            ],
        )
    lines.append("")
    lines.append(f"requests in flight: {report.requests_in_flight if not report.router_error else '-'}")
    if report.router_error:
        lines.append(f"router error: {report.router_error}")
    return "\n".join(lines)


def read_shadows(state_dir: Path) -> dict[str, int]:
    """Engine id -> its idle shadow's pid, from the shadow supervisor's state file."""
    path = state_dir / "workers" / "engines.json"
    if not path.exists():
        return {}
    state = protocol.decode(protocol.decoder_for(protocol.ShadowState), path.read_bytes())
    return {engine: workers.shadow for engine, workers in state.items()}


async def router_status(target: Target) -> protocol.RouterStatus:
    async with asyncio.timeout(ROUTER_STATUS_TIMEOUT_S):
        async with Client(await target.connect("belayer-status"), subjects=target.subjects) as client:
            return await client.status()


def add_parser(commands: argparse._SubParsersAction) -> None:
    status = commands.add_parser("status", help="processes, engines and requests in flight")
    status.add_argument("--json", action="store_true", help="print one JSON object (one per refresh)")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    status.set_defaults(run=cmd_status)
