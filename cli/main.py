"""The `belayer` command: up, down, status, events, generate, weights, engines, demo, bench,
sandbox.

Global flags (--state-dir, --nats) are accepted before or after the subcommand. Commands that only
talk to the bus (status, events, generate, down, --version) never import torch."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import uvloop
from nats.aio.msg import Msg

from belayer_rl.cli.cluster import ClusterConfig, ClusterFile
from belayer_rl.cli.target import add_target_flags, cluster_id_of, resolve_target
from belayer_rl.services import SERVICES
from belayer_rl.shared import bus, protocol
from belayer_rl.shared import config as flags
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client, GenerationError
from belayer_rl.shared.config import ConfigError, default_state_dir, hostname_id
from belayer_rl.shared.declaration import stats_keys
from belayer_rl.shared.roles import Credentials, compose_owners
from belayer_rl.shared.subjects import DEFAULT_CLUSTER, Subjects, cluster_id_ok, event_kind

UP_TIMEOUT_S = 120.0
DOWN_TIMEOUT_S = 90.0  # the local cluster stops its processes one by one, each within its drain timeout
UP_SKIP = ("state_dir", "nats_url", "cluster_id", "nats_ca", "nats_cert", "nats_key")  # global flags


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_cluster(state_dir: Path) -> ClusterFile | None:
    path = state_dir / "cluster.json"
    if not path.exists():
        return None
    return msgspec.json.decode(path.read_bytes(), type=ClusterFile)


# ---------------------------------------------------------------- up / down / status


def cmd_up(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir.resolve()
    running = read_cluster(state_dir)
    if running is not None and pid_alive(running.supervisor_pid):
        print(f"already up (supervisor pid {running.supervisor_pid}); `belayer down` first", file=sys.stderr)
        return 1
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    (state_dir / "cluster.json").unlink(missing_ok=True)
    try:
        cluster_config = flags.from_args(
            ClusterConfig,
            args,
            skip=UP_SKIP,
            state_dir=state_dir,
            nats_url=args.nats or None,
            cluster_id=cluster_id_of(args),
            nats_ca=args.nats_ca,
            nats_cert=args.nats_cert,
            nats_key=args.nats_key,
        )
    except ConfigError as exc:
        print(f"belayer up: {exc}", file=sys.stderr)
        return 2
    argv = [sys.executable, "-m", "belayer_rl.cli.cluster", *flags.to_argv(cluster_config)]
    with (state_dir / "logs" / "cluster.log").open("ab") as out:
        supervisor = subprocess.Popen(
            argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        engines = uvloop.run(wait_until_serving(args, cluster_config.engines, supervisor))
    except (TimeoutError, RuntimeError, ConfigError) as exc:
        print(f"belayer up failed: {exc}; logs in {state_dir / 'logs'}", file=sys.stderr)
        return 1
    cluster = read_cluster(state_dir)
    assert cluster is not None
    print(f"belayer is up: NATS {cluster.nats_url}, {engines} engine(s) serving, state in {state_dir}")
    print(f"  export BELAYER_NATS_URL={cluster.nats_url}")
    if cluster.creds_dir:
        print(f"  credentials in {cluster.creds_dir} (`belayer` commands use cli.creds from there)")
    return 0


async def wait_until_serving(
    args: argparse.Namespace, engines: int, supervisor: subprocess.Popen[bytes]
) -> int:
    deadline = time.monotonic() + UP_TIMEOUT_S
    state_dir: Path = args.state_dir.resolve()
    while read_cluster(state_dir) is None:
        if supervisor.poll() is not None:
            raise RuntimeError(f"the supervisor exited with {supervisor.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no cluster within {UP_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.1)
    target = resolve_target(argparse.Namespace(**{**vars(args), "state_dir": state_dir}))
    async with Client(await target.connect("belayer-up"), subjects=target.subjects) as client:
        status = await client.wait_for_engines(engines, deadline - time.monotonic())
    return sum(e.alive for e in status.engines)


def cmd_down(args: argparse.Namespace) -> int:
    cluster = read_cluster(args.state_dir)
    if cluster is None or not pid_alive(cluster.supervisor_pid):
        print("not running")
        return 0
    os.kill(cluster.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while pid_alive(cluster.supervisor_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(cluster.supervisor_pid):
        os.kill(cluster.supervisor_pid, signal.SIGKILL)
    print(f"belayer is down (supervisor pid {cluster.supervisor_pid})")
    return 0


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


# ---------------------------------------------------------------- events


def cmd_events(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    kinds = frozenset(args.kind or ())
    selection = EventFilter(
        kinds=kinds,
        engine=args.engine,
        trajectory=args.trajectory,
        heartbeats=args.heartbeats or "heartbeat" in kinds,  # asking for the kind is asking to see it
    )
    try:
        uvloop.run(follow_events(target, selection, args.json, args.count))
    except KeyboardInterrupt:
        pass
    return 0


@dataclass(frozen=True)
class EventFilter:
    """Which events `belayer events` prints. The kind comes from the subject (it chose the type the
    message was decoded with); engine and trajectory are matched on the decoded message's fields,
    so an event whose type has no such field never matches a filter on it."""

    kinds: frozenset[str] = frozenset()  # empty: every kind
    engine: str | None = None
    trajectory: str | None = None
    heartbeats: bool = False  # they arrive five times a second per engine: hidden unless asked for

    def wants_kind(self, kind: str) -> bool:
        if self.kinds:
            return kind in self.kinds
        return kind != "heartbeat" or self.heartbeats

    def matches(self, kind: str, event: msgspec.Struct) -> bool:
        return (
            self.wants_kind(kind)
            and field_matches(event, "engine_id", self.engine)
            and field_matches(event, "trajectory", self.trajectory)
        )


def field_matches(event: msgspec.Struct, name: str, wanted: str | None) -> bool:
    if wanted is None:
        return True
    return name in event.__struct_fields__ and getattr(event, name) == wanted


def describe(kind: str, event: msgspec.Struct) -> str:
    fields = " ".join(f"{name}={getattr(event, name)}" for name in event.__struct_fields__ if name != "v")
    return f"{kind:<18} {fields}"


async def follow_events(target: Target, selection: EventFilter, as_json: bool, count: int) -> None:
    # One decoder per kind: what a subject carries is declared by protocol.EVENT_TYPES, so a message
    # of another type on that subject is reported as undecodable, not shown as what it claims to be.
    decoders = {kind: protocol.decoder_for(kind_type) for kind, kind_type in protocol.EVENT_TYPES.items()}
    nc = await target.connect("belayer-events")
    names = target.subjects
    seen = 0
    done = asyncio.Event()

    async def on_message(msg: Msg) -> None:
        nonlocal seen
        kind = event_kind(msg.subject)
        # Messages already delivered are still handed over after the last one counted: not printed.
        if done.is_set() or not selection.wants_kind(kind):
            return
        try:
            if kind not in decoders:
                raise protocol.BadMessage(f"unknown event kind {kind!r}")
            event = protocol.decode(decoders[kind], msg.data)
        except protocol.BadMessage as exc:
            # Shown even under --engine/--trajectory (its fields cannot be trusted) but not counted.
            if as_json:
                print(json.dumps({"subject": msg.subject, "undecodable": str(exc)}), flush=True)
            else:
                print(f"{time.strftime('%H:%M:%S')} {msg.subject}: undecodable event ({exc})", flush=True)
            return
        if not selection.matches(kind, event):
            return
        if as_json:
            print(msg.data.decode(), flush=True)
        else:
            print(f"{time.strftime('%H:%M:%S')} {describe(kind, event)}", flush=True)
        seen += 1
        if count and seen >= count:
            done.set()

    await nc.subscribe(names.events_all, cb=on_message)
    await nc.flush()  # the server has the subscription: every event published from now on is seen
    # On stderr, so that --json output stays one JSON value per line; scripts may wait for it.
    print(f"following {names.events_all} on {target.url}", file=sys.stderr, flush=True)
    try:
        await done.wait()
    finally:
        await nc.close()


# ---------------------------------------------------------------- generate


def cmd_generate(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    try:
        result = uvloop.run(generate(target, args))
    except GenerationError as exc:
        print(
            json.dumps(
                {"request_id": exc.error.request_id, "error": exc.error.code, "message": exc.error.message}
            )
        )
        return 2
    print(json.dumps(result) if args.json else result["text"])
    return 0


async def generate(target: Target, args: argparse.Namespace) -> dict[str, object]:
    nc = await target.connect("belayer-generate")
    async with Client(nc, subjects=target.subjects, client=target.access.client) as client:
        result = await client.generate_all(
            args.prompt,
            max_tokens=args.max_tokens,
            seed=args.seed,
            temperature=args.temperature,
            stop=args.stop or None,
            weight_version=args.weight_version,
        )
    return {
        "request_id": result.request_id,
        "tokens": result.tokens,
        "text": result.text,
        "resumes": result.resumes,
        "finish_reason": result.finish_reason,
        "weight_version": result.weight_version,
    }


# ---------------------------------------------------------------- weights


def cmd_weights(args: argparse.Namespace) -> int:
    if args.action == "publish" and args.file is None:
        print("belayer weights publish: give the weights file", file=sys.stderr)
        return 2
    target = resolve_target(args)
    try:
        result = uvloop.run(weights(target, args))
    except bus.ServiceError as exc:
        print(f"belayer weights {args.action}: {exc}", file=sys.stderr)
        return 2
    print(result)
    return 0


async def weights(target: Target, args: argparse.Namespace) -> str:
    from belayer_rl.services.weight_server.client import WeightClient

    nc = await target.connect("belayer-weights")
    try:
        client = WeightClient(nc, subjects=target.subjects)
        if args.action == "publish":
            handles = await client.publish(args.file.resolve())
            if args.json:
                return protocol.encode(handles).decode()
            return f"published {handles.version} ({handles.manifest.size} bytes)"
        listing = await client.versions()
        if args.json:
            return protocol.encode(listing).decode()
        return "\n".join(
            f"{v.version}{' (newest)' if v.version == listing.newest else ''}  {v.size} bytes  "
            f"pinned by {', '.join(v.holders) or 'nobody'}"
            for v in listing.versions
        )
    finally:
        await nc.close()


# ---------------------------------------------------------------- engines


def cmd_engines(args: argparse.Namespace) -> int:
    target = resolve_target(args)
    try:
        done = uvloop.run(unquarantine(target, args.engine))
    except bus.ServiceError as exc:
        print(f"belayer engines unquarantine {args.engine}: {exc}", file=sys.stderr)
        return 2
    print(f"engine {done.engine_id} unquarantined: worker pid {done.new_pid} at epoch {done.epoch}")
    return 0


async def unquarantine(target: Target, engine_id: str) -> protocol.EngineRestarted:
    nc = await target.connect("belayer-engines")
    try:
        subject = target.subjects.engine_unquarantine(engine_id)
        ask = protocol.EngineUnquarantine()
        return await bus.request_struct(nc, subject, ask, protocol.EngineRestarted, UP_TIMEOUT_S)
    finally:
        await nc.close()


# ---------------------------------------------------------------- creds


def cmd_creds(args: argparse.Namespace) -> int:
    if args.revoke:
        running = read_cluster(args.state_dir.resolve())
        return revoke(
            args, cluster_id_of(args, running.cluster_id if running is not None else DEFAULT_CLUSTER)
        )
    cluster_id = cluster_id_of(args)
    if args.out is None:
        print("belayer creds: --out names the folder for the new credentials", file=sys.stderr)
        return 2
    engines = tuple(e for e in args.engines.split(",") if e)
    if not all(cluster_id_ok(e) for e in engines):
        print(f"belayer creds: engine ids are lowercase letters, digits, - and _: {engines}", file=sys.stderr)
        return 2
    clients = tuple(c for c in args.clients.split(",") if c)
    if not all(cluster_id_ok(c) for c in clients):
        print(
            f"belayer creds: client names are lowercase letters, digits, - and _: {clients}", file=sys.stderr
        )
        return 2
    written = Credentials.generate(SERVICES, Subjects(cluster_id), engines, clients).write(args.out)
    print(f"cluster {cluster_id}: {args.out / 'auth.conf'} (include it from the nats-server config)")
    for name, path in written.items():
        print(f"  {name:<24} {path}")
    if args.compose_owners:
        # What no container reads (cli.creds, admin.creds, the folder) goes to whoever ran sudo:
        # the next step is their own `belayer --nats-creds creds/cli.creds ...`.
        invoker = int(os.environ.get("SUDO_UID", os.geteuid())), int(os.environ.get("SUDO_GID", os.getegid()))
        owners = compose_owners(args.out, engines)
        try:
            for path in [args.out, *args.out.iterdir()]:
                uid, gid = (owners[path], owners[path]) if path in owners else invoker
                os.lchown(path, uid, gid)  # a link in the folder is not followed
        except PermissionError:
            print("belayer creds --compose-owners: only root may give files to the services' uids"
                  " (run it with sudo)", file=sys.stderr)  # fmt: skip
            return 2
        print("each secret is owned by the uid of the Compose service that reads it (compose.yaml)")
    return 0


def revoke(args: argparse.Namespace, cluster_id: str) -> int:
    """A fresh key for one user, written over its `.creds` file and into auth.conf; every other
    credential stays. The local cluster's nats-server reloads at once (SIGHUP), which closes the
    revoked key's connections; another server must be told to reload."""
    running = read_cluster(args.state_dir.resolve())
    folder = args.out or (Path(running.creds_dir) if running is not None and running.creds_dir else None)
    if folder is None:
        print("belayer creds --revoke: no local cluster with credentials; name their folder with --out",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        creds = Credentials.load(SERVICES, folder, Subjects(cluster_id))
        creds.rotate(args.revoke)
    except (OSError, ValueError) as exc:
        print(f"belayer creds --revoke: {exc}", file=sys.stderr)
        return 2
    creds.write(folder)
    print(f"{args.revoke}: a new key in {folder / (args.revoke + '.creds')}; its old one is revoked")
    server = next((p for p in running.processes if p.name == "nats-server"), None) if running else None
    if args.out is None and server is not None and pid_alive(server.pid):
        os.kill(server.pid, signal.SIGHUP)
        print(
            f"nats-server (pid {server.pid}) reloaded its authorization: the old key's connections are closed"
        )
        print(f"processes of {args.revoke} reconnect with the new key when they restart")
    else:
        print("reload the nats-server that includes this auth.conf (SIGHUP; under Compose:"
              " `docker compose kill -s HUP nats`), then restart what uses the new key")  # fmt: skip
    return 0


# ---------------------------------------------------------------- parser


def add_global_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--state-dir and --nats. The top-level parser holds their real defaults; every subcommand's
    parser has the same flags with default SUPPRESS, so they are accepted after the subcommand too,
    and a subcommand that did not see one leaves the value given before it alone (argparse copies
    what a subparser parsed over the top-level namespace)."""
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir() if defaults else argparse.SUPPRESS,
        help="local cluster state (default .belayer, or $BELAYER_STATE_DIR)",
    )
    parser.add_argument(
        "--nats",
        default=None if defaults else argparse.SUPPRESS,
        help="NATS URL of an external cluster (or $BELAYER_NATS_URL)",
    )
    add_target_flags(parser, defaults=defaults)


class SubcommandParser(argparse.ArgumentParser):
    """The parser of every subcommand, at any depth: add_subparsers makes each nested parser of its
    parent's class, so the global flags reach the parsers the cli modules add without their help."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_global_flags(self, defaults=False)


def installed_version() -> str:
    try:
        return importlib.metadata.version("belayer-rl")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (belayer-rl is not installed)"


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """`benchmarks=False` gives `bench` its name and help but not its subcommands, whose modules
    import torch; main() asks for them only when the command line names `bench`."""
    parser = argparse.ArgumentParser(prog="belayer", description="Fault tolerance for agentic RL rollouts.")
    add_global_flags(parser, defaults=True)
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)

    up = commands.add_parser("up", help="start a local cluster in the background")
    flags.add_flags(up, ClusterConfig, skip=UP_SKIP)  # --state-dir and --nats are global flags
    up.set_defaults(run=cmd_up)

    down = commands.add_parser("down", help="stop the local cluster")
    down.set_defaults(run=cmd_down)

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

    events = commands.add_parser("events", help="follow the event stream, one line per event")
    events.add_argument("--json", action="store_true", help="print each event as JSON")
    events.add_argument("--heartbeats", action="store_true", help="include heartbeats")
    events.add_argument("--count", type=int, default=0, help="stop after this many events")
    events.add_argument(
        "--kind",
        action="append",
        choices=sorted(protocol.EVENT_TYPES),
        metavar="KIND",
        help=f"only this kind, as in belayer.<cluster>.evt.<kind> (repeatable): {', '.join(protocol.EVENT_TYPES)}",
    )
    events.add_argument("--engine", metavar="ID", help="only events of this engine (their engine_id)")
    events.add_argument("--trajectory", metavar="ID", help="only events of this sandbox trajectory")
    events.set_defaults(run=cmd_events)

    gen = commands.add_parser("generate", help="run one generation")
    gen.add_argument("prompt")
    gen.add_argument("--json", action="store_true", help="print request_id, tokens, text and resumes as JSON")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--weight-version", help="weights to generate with (default: the newest)")
    gen.set_defaults(run=cmd_generate)

    weights_cmd = commands.add_parser("weights", help="list or publish weight versions (weight server)")
    weights_cmd.add_argument("action", choices=["ls", "publish"])
    weights_cmd.add_argument("file", nargs="?", type=Path, help="publish: a weights file on this host")
    weights_cmd.add_argument("--json", action="store_true")
    weights_cmd.set_defaults(run=cmd_weights)

    engines_cmd = commands.add_parser("engines", help="an engine's quarantine: the manual way back")
    engines_cmd.add_argument("action", choices=["unquarantine"])
    engines_cmd.add_argument("engine", help="engine id, e.g. e0")
    engines_cmd.set_defaults(run=cmd_engines)

    creds = commands.add_parser(
        "creds", help="credentials and nats-server permissions for a cluster (compose, an external NATS)"
    )
    creds.add_argument("--out", type=Path, help="folder for auth.conf and <role>.creds")
    creds.add_argument(
        "--revoke",
        metavar="USER",
        help="give USER (a role, or <role>-<engine>) a new key and refuse its old one; the folder is"
        " --out, or the local cluster's (whose nats-server then reloads at once)",
    )
    creds.add_argument(
        "--engines", default="e0,e1", help="engine ids, each with its own credential (default e0,e1)"
    )
    creds.add_argument(
        "--clients",
        default="",
        help="names of further rollout-side users (cli-<name>.creds): each follows and cancels only"
        " the requests it started (default: one, cli)",
    )
    creds.add_argument(
        "--compose-owners",
        action="store_true",
        help="give each secret to the uid of the compose.yaml service that reads it (needs root)",
    )
    creds.set_defaults(run=cmd_creds)

    from belayer_rl.cli import bench, demo
    from belayer_rl.cli import policy as policy_cli
    from belayer_rl.cli import rollout as rollout_cli
    from belayer_rl.cli import train as train_cli
    from belayer_rl.cli.chaos import campaign as chaos

    demo.add_parser(commands)
    chaos.add_parser(commands)
    policy_cli.add_parser(commands)
    rollout_cli.add_parser(commands)
    train_cli.add_parser(commands)
    bench.add_parser(commands, with_kinds=benchmarks)
    from belayer_rl.cli import sandbox as sandbox_cli

    sandbox_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Only a command line that names `bench` can run a benchmark (subcommands are never abbreviated);
    # every other command is spared the import of torch its parsers bring.
    args = build_parser(benchmarks="bench" in argv).parse_args(argv)
    try:
        sys.exit(args.run(args))
    except ConfigError as exc:
        print(f"belayer: {exc}", file=sys.stderr)
        sys.exit(2)
