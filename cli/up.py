"""`belayer up` and `belayer down`: the local cluster (cli/cluster.py) started in the background,
waited for until it serves, and stopped."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import uvloop

from belayer_rl.cli.cluster import ClusterConfig, ClusterFile
from belayer_rl.cli.target import cluster_id_of, resolve_target
from belayer_rl.shared import config as flags
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import ConfigError

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


def add_parser(commands: argparse._SubParsersAction) -> None:
    up = commands.add_parser("up", help="start a local cluster in the background")
    flags.add_flags(up, ClusterConfig, skip=UP_SKIP)  # --state-dir and --nats are global flags
    up.set_defaults(run=cmd_up)

    down = commands.add_parser("down", help="stop the local cluster")
    down.set_defaults(run=cmd_down)
