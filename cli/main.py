"""The `belayer` command: up, down, status, events, generate, demo, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import uvloop

from belayer_rl.cli.cluster import ClusterFile
from belayer_rl.shared import bus, protocol, subjects
from belayer_rl.shared.client import Client, GenerationError
from belayer_rl.shared.config import ConfigError, default_state_dir, resolve_nats_url
from belayer_rl.shared.protocol import Event, Heartbeat

UP_TIMEOUT_S = 120.0


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
    argv = [
        sys.executable, "-m", "belayer_rl.cli.cluster",
        "--state-dir", str(state_dir),
        "--engines", str(args.engines),
        "--model", args.model,
        "--weights-seed", str(args.weights_seed),
        "--chunk-tokens", str(args.chunk_tokens),
        "--heartbeat-timeout", str(args.heartbeat_timeout),
        "--no-worker-deadline", str(args.no_worker_deadline),
        "--client-timeout", str(args.client_timeout),
    ]  # fmt: skip
    if args.nats:
        argv += ["--nats", args.nats]
    if args.no_shadows:
        argv.append("--no-shadows")
    with (state_dir / "logs" / "cluster.log").open("ab") as out:
        supervisor = subprocess.Popen(
            argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        engines = uvloop.run(wait_until_serving(state_dir, args.engines, supervisor))
    except (TimeoutError, RuntimeError) as exc:
        print(f"belayer up failed: {exc}; logs in {state_dir / 'logs'}", file=sys.stderr)
        return 1
    cluster = read_cluster(state_dir)
    assert cluster is not None
    print(f"belayer is up: NATS {cluster.nats_url}, {engines} engine(s) serving, state in {state_dir}")
    print(f"  export BELAYER_NATS_URL={cluster.nats_url}")
    return 0


async def wait_until_serving(state_dir: Path, engines: int, supervisor: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while (cluster := read_cluster(state_dir)) is None:
        if supervisor.poll() is not None:
            raise RuntimeError(f"the supervisor exited with {supervisor.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no cluster within {UP_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.1)
    async with Client(await bus.connect(cluster.nats_url, "belayer-up")) as client:
        status = await client.wait_for_engines(engines, deadline - time.monotonic())
    return sum(e.alive for e in status.engines)


def cmd_down(args: argparse.Namespace) -> int:
    cluster = read_cluster(args.state_dir)
    if cluster is None or not pid_alive(cluster.supervisor_pid):
        print("not running")
        return 0
    os.kill(cluster.supervisor_pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while pid_alive(cluster.supervisor_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(cluster.supervisor_pid):
        os.kill(cluster.supervisor_pid, signal.SIGKILL)
    print(f"belayer is down (supervisor pid {cluster.supervisor_pid})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    cluster = read_cluster(args.state_dir)
    processes = []
    if cluster is not None and pid_alive(cluster.supervisor_pid):
        processes = [{"name": "supervisor", "pid": cluster.supervisor_pid, "state": "running"}] + [
            {"name": p.name, "pid": p.pid, "state": p.state} for p in cluster.processes
        ]
    engines: list[dict[str, object]] = []
    router_error = ""
    try:
        url = resolve_nats_url(args.nats, args.state_dir)
        status = uvloop.run(router_status(url))
        shadows = read_shadows(args.state_dir)
        engines = [
            {
                "id": e.engine_id,
                "worker_pid": e.pid,
                "epoch": e.epoch,
                "alive": e.alive,
                "shadow_pid": shadows.get(e.engine_id, 0),
                "weight_version": e.weight_version,
            }
            for e in status.engines
        ]
        requests = len(status.requests)
    except (ConfigError, bus.ServiceError, OSError, TimeoutError) as exc:
        router_error, requests = str(exc), 0
    report = {"processes": processes, "engines": engines, "requests_in_flight": requests}
    if router_error:
        report["router_error"] = router_error
    if args.json:
        print(json.dumps(report))
        return 0
    for p in processes:
        print(f"process {p['name']:<14} pid {p['pid']:<8} {p['state']}")
    for e in engines:
        print(
            f"engine  {e['id']:<14} pid {e['worker_pid']:<8} epoch {e['epoch']}  alive={e['alive']}"
            f"  shadow pid {e['shadow_pid'] or '-'}  weights {e['weight_version'] or '-'}"
        )
    print(f"requests in flight: {requests}" + (f"  (router: {router_error})" if router_error else ""))
    return 0


def read_shadows(state_dir: Path) -> dict[str, int]:
    """Engine id -> its idle shadow's pid, from the shadow supervisor's state file."""
    path = state_dir / "workers" / "engines.json"
    if not path.exists():
        return {}
    return {engine: int(pids["shadow"]) for engine, pids in json.loads(path.read_text()).items()}


async def router_status(url: str) -> protocol.RouterStatus:
    async with Client(await bus.connect(url, "belayer-status")) as client:
        return await client.status()


# ---------------------------------------------------------------- events


def cmd_events(args: argparse.Namespace) -> int:
    url = resolve_nats_url(args.nats, args.state_dir)
    try:
        uvloop.run(follow_events(url, args.json, args.heartbeats, args.count))
    except KeyboardInterrupt:
        pass
    return 0


def describe(event: msgspec.Struct) -> str:
    fields = " ".join(
        f"{name}={getattr(event, name)}" for name in event.__struct_fields__ if name not in ("v", "type")
    )
    return f"{event.__struct_config__.tag:<16} {fields}"


async def follow_events(url: str, as_json: bool, heartbeats: bool, count: int) -> None:
    decoder = protocol.decoder_for(Event)
    nc = await bus.connect(url, "belayer-events")
    seen = 0
    done = asyncio.Event()

    async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
        nonlocal seen
        try:
            event = protocol.decode(decoder, msg.data)
        except protocol.BadMessage as exc:
            print(f"{msg.subject}: undecodable event ({exc})", flush=True)
            return
        if isinstance(event, Heartbeat) and not heartbeats:
            return
        if as_json:
            print(msg.data.decode(), flush=True)
        else:
            print(f"{time.strftime('%H:%M:%S')} {describe(event)}", flush=True)
        seen += 1
        if count and seen >= count:
            done.set()

    await nc.subscribe(subjects.EVENTS_ALL, cb=on_message)
    try:
        await done.wait()
    finally:
        await nc.close()


# ---------------------------------------------------------------- generate


def cmd_generate(args: argparse.Namespace) -> int:
    url = resolve_nats_url(args.nats, args.state_dir)
    try:
        result = uvloop.run(generate(url, args))
    except GenerationError as exc:
        print(
            json.dumps(
                {"request_id": exc.error.request_id, "error": exc.error.code, "message": exc.error.message}
            )
        )
        return 2
    print(json.dumps(result) if args.json else result["text"])
    return 0


async def generate(url: str, args: argparse.Namespace) -> dict[str, object]:
    async with Client(await bus.connect(url, "belayer-generate")) as client:
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
    url = resolve_nats_url(args.nats, args.state_dir)
    try:
        result = uvloop.run(weights(url, args))
    except bus.ServiceError as exc:
        print(f"belayer weights {args.action}: {exc}", file=sys.stderr)
        return 2
    print(result)
    return 0


async def weights(url: str, args: argparse.Namespace) -> str:
    from belayer_rl.services.weight_server.client import WeightClient

    nc = await bus.connect(url, "belayer-weights")
    try:
        client = WeightClient(nc)
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


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer", description="Fault tolerance for agentic RL rollouts.")
    parser.add_argument(
        "--state-dir", type=Path, default=default_state_dir(), help="local cluster state (default .belayer)"
    )
    parser.add_argument("--nats", help="NATS URL of an external cluster (or $BELAYER_NATS_URL)")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start a local cluster in the background")
    up.add_argument("--engines", type=int, default=2, help="rollout workers to start")
    up.add_argument("--model", default="tiny", help="model preset (tiny, small, medium, base)")
    up.add_argument("--weights-seed", type=int, default=0, help="seed of the random weights")
    up.add_argument("--chunk-tokens", type=int, default=256, help="token-log chunk size k")
    up.add_argument("--heartbeat-timeout", type=float, default=1.0, help="worker silence before failover (s)")
    up.add_argument("--no-worker-deadline", type=float, default=30.0, help="wait for a healthy engine (s)")
    up.add_argument(
        "--client-timeout", type=float, default=60.0, help="cancel a request nobody follows this long (s)"
    )
    up.add_argument(
        "--no-shadows", action="store_true", help="start workers directly: no shadows, weight or KV servers"
    )
    up.set_defaults(run=cmd_up)

    down = commands.add_parser("down", help="stop the local cluster")
    down.set_defaults(run=cmd_down)

    status = commands.add_parser("status", help="processes and engines")
    status.add_argument("--json", action="store_true")
    status.set_defaults(run=cmd_status)

    events = commands.add_parser("events", help="follow the event stream, one line per event")
    events.add_argument("--json", action="store_true", help="print each event as JSON")
    events.add_argument("--heartbeats", action="store_true", help="include heartbeats")
    events.add_argument("--count", type=int, default=0, help="stop after this many events")
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

    from belayer_rl.cli import bench, demo

    demo.add_parser(commands)
    bench.add_parser(commands)
    from belayer_rl.cli import sandbox as sandbox_cli

    sandbox_cli.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        sys.exit(args.run(args))
    except ConfigError as exc:
        print(f"belayer: {exc}", file=sys.stderr)
        sys.exit(2)
