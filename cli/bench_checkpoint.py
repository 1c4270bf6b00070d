"""`belayer bench checkpoint`: what a sandbox checkpoint costs and what a restore saves.

For each scenario (process memory of 10/100/500 MiB held by `memhold`; a writable layer of
1/100/500 MiB or of 10,000 small files) it runs the scenario's actions in a fresh sandbox, takes a
full checkpoint, kills the container and restores it; the baseline, in the same run, restarts from
the base image and replays the same actions. Reports freeze time, checkpoint time, restore time,
bytes written and the ratio restore / replay. Runs its own nats-server and checkpointer against
the local Docker engine; needs the test image (built on the fly).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import aiodocker
import uvloop

from belayer_rl.cli.bench_report import Report
from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.services.checkpointer.sandbox import LABEL_HOST
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from belayer_rl.shared.protocol import SandboxSpec

MIB = 1 << 20


@dataclass(frozen=True)
class Scenario:
    name: str
    actions: list[str]
    memory_mb: int = 256


def hold_memory(mib: int) -> Scenario:
    # start memhold and return once it is resident, so the replay pays the same as the original
    action = (
        f"(exec memhold {mib}) >/dev/null 2>&1 </dev/null & p=$!; "
        f"while [ $(awk '/VmRSS/{{print $2}}' /proc/$p/status) -lt {mib * 1024 * 95 // 100} ]; do sleep 0.02; done"
    )
    return Scenario(f"memory {mib} MiB", [action], memory_mb=mib + 256)


def write_layer(mib: int) -> Scenario:
    return Scenario(f"layer {mib} MiB", [f"head -c {mib * MIB} /dev/urandom > /tmp/data.bin && sync"])


def small_files(count: int) -> Scenario:
    action = (
        f"mkdir /many && i=0 && while [ $i -lt {count} ]; do echo $i > /many/f$i; i=$((i+1)); done && sync"
    )
    return Scenario(f"layer {count} small files", [action])


def scenarios(quick: bool) -> list[Scenario]:
    if quick:
        return [hold_memory(10), write_layer(1), small_files(1000)]
    return [hold_memory(10), hold_memory(100), hold_memory(500), write_layer(1), write_layer(100), write_layer(500),
            small_files(10_000)]  # fmt: skip


@dataclass
class Row:
    scenario: str
    actions_s: float  # running the actions the first time
    freeze_s: float  # container frozen: layer archive + CRIU dump
    checkpoint_s: float  # the whole full_checkpoint, as the caller sees it
    bytes_written: int
    restore_s: float  # full_restore after a kill, as the caller sees it
    replay_s: float  # baseline: fresh container from the base image + the same actions
    ratio: float  # restore_s / replay_s


# ---------------------------------------------------------------- one scenario


async def measure(
    client: SandboxClient, image: str, scenario: Scenario, kill: Callable[[str], Awaitable[None]]
) -> Row:
    # root: memhold outlives its action, and CRIU may not dump another user's process on a host
    # whose root lacks CAP_SYS_RESOURCE (the checkpointer's README)
    spec = SandboxSpec(image=image, memory_mb=scenario.memory_mb, user="0")
    name = f"b{secrets.token_hex(3)}"
    trajectory = f"bench-{name}"
    info = await client.create(spec, sandbox=name)
    started = time.monotonic()
    for action in scenario.actions:
        out = await client.exec(name, action, timeout_s=600)
        if out.exit_code != 0:
            raise RuntimeError(f"{scenario.name}: action failed: {out.stderr[-300:]}")
    actions_s = time.monotonic() - started
    started = time.monotonic()
    checkpoint = await client.checkpoint(name, trajectory, k=len(scenario.actions), timeout_s=600)
    checkpoint_s = time.monotonic() - started
    await kill(info.container_id)
    started = time.monotonic()
    restored = await client.restore(trajectory, timeout_s=600)
    restore_s = time.monotonic() - started
    if restored.source != "latest":
        raise RuntimeError(f"{scenario.name}: restore used {restored.source}: {restored.rejected}")
    await client.end(trajectory)
    await client.destroy(name)

    started = time.monotonic()  # the baseline: from the base image, the same actions again
    await client.create(spec, sandbox=f"{name}-replay")
    for action in scenario.actions:
        await client.exec(f"{name}-replay", action, timeout_s=600)
    replay_s = time.monotonic() - started
    await client.destroy(f"{name}-replay")
    return Row(
        scenario=scenario.name, actions_s=actions_s, freeze_s=checkpoint.freeze_s, checkpoint_s=checkpoint_s,
        bytes_written=checkpoint.bytes_written, restore_s=restore_s, replay_s=replay_s,
        ratio=restore_s / replay_s if replay_s > 0 else float("inf"),
    )  # fmt: skip


# ---------------------------------------------------------------- harness


async def bench(args: argparse.Namespace) -> Report:
    docker = aiodocker.Docker()
    try:
        image = await ensure_image(docker, DEFAULT_IMAGE)
    finally:
        await docker.close()
    host_id = f"bench{secrets.token_hex(3)}"
    state = Path(tempfile.mkdtemp(prefix="belayer-bench-checkpoint-", dir=args.state_parent))
    port = free_port()
    nats = await start_nats_server(state / "jetstream", port, state / "nats-server.log")
    url = f"nats://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "belayer_rl.services.checkpointer", "--nats", url, "--host-id", host_id,
            "--state-dir", str(state / "checkpointer"), "--disk-budget-gb", "0", "--allow-root-user"]  # fmt: skip
    with (state / "checkpointer.log").open("ab") as log:
        service = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
    docker = aiodocker.Docker()
    nc = await bus.connect(url, "bench-checkpoint")
    rows: list[Row] = []
    try:
        client = SandboxClient(nc, host_id)
        for _ in range(200):
            try:
                await client.list(timeout_s=1.0)
                break
            except ServiceError:
                await asyncio.sleep(0.1)

        async def kill(container_id: str) -> None:
            await docker.containers.container(container_id).kill()

        for scenario in scenarios(args.quick):
            row = await measure(client, image, scenario, kill)
            rows.append(row)
            if not args.json:
                if len(rows) == 1:
                    print(HEADER)
                print_row(row, flush=True)
    finally:
        await nc.close()
        await stop_process(service)
        for c in await docker.containers.list(all=True, filters={"label": [f"{LABEL_HOST}={host_id}"]}):
            with contextlib.suppress(aiodocker.DockerError):
                await c.delete(force=True)
        await docker.close()
        await stop_process(nats)
        shutil.rmtree(state, ignore_errors=True)
    return {"image": DEFAULT_IMAGE, "quick": args.quick, "rows": [asdict(r) for r in rows]}


HEADER = f"{'scenario':<26}{'actions':>9}{'freeze':>9}{'ckpt':>9}{'MiB written':>13}{'restore':>9}{'replay':>9}{'restore/replay':>16}"


def print_row(row: Row, flush: bool = False) -> None:
    print(
        f"{row.scenario:<26}{row.actions_s:>8.2f}s{row.freeze_s:>8.2f}s{row.checkpoint_s:>8.2f}s"
        f"{row.bytes_written / MIB:>13.1f}{row.restore_s:>8.2f}s{row.replay_s:>8.2f}s{row.ratio:>16.2f}",
        flush=flush,
    )


def add_parser(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("checkpoint", help="sandbox checkpoint/restore cost vs restart and replay")
    parser.add_argument("--quick", action="store_true", help="a small subset (10 MiB, 1 MiB, 1000 files)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--state-parent", default=None, help="where the temporary store goes (default: $TMPDIR)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = uvloop.run(bench(args))
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="belayer-bench-checkpoint")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["checkpoint", *(argv if argv is not None else sys.argv[1:])])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
