"""`belayer train` as a user runs it, against a real cluster: a line per step, the step log, the
reward curve, and a rerun with more steps resuming from the run's checkpoints. As the README writes
it, `--out` is a relative path, here taken from a folder other than the one the tests run in (a
relative rendezvous once made the ranks wait for a file:// URL that named a host)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import msgspec

from belayer_rl.shared.protocol import TrainerStep
from tests.cli.helpers import belayer
from tests.support import Cluster


async def run_train(url: str, folder: Path, steps: int, *more: str) -> str:
    """`belayer train ... --out run`, run in `folder`."""
    done = await asyncio.to_thread(
        belayer, "--nats", url, "train", "--steps", str(steps), "--prompts", "4", "--group-size", "4",
        "--checkpoint-every", "1", "--seed", "4", "--out", "run", *more, timeout_s=300, cwd=folder,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


async def test_train_prints_steps_draws_the_curve_and_resumes(train_cluster: Cluster, tmp_path: Path) -> None:
    url = train_cluster.nats.url
    out = tmp_path / "run"
    first = await run_train(url, tmp_path, 3)
    lines = [line for line in first.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all(
        "reward" in line and "tok/s" in line and "recoveries" in line for line in lines
    )
    assert "held-out exact match" in first
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resumes after step 3; the kill lands a seeded 0.956 s after step 4, some steps later.
    second = await run_train(url, tmp_path, 12, "--chaos", "actor@4:kill", "--chaos-seed", "2")
    assert "chaos (seed 2): kill actor" in second and "chaos: kill actor" in second, second
    assert [line.split()[1] for line in second.splitlines() if line.startswith("step ")] == [
        str(n) for n in range(4, 13)
    ]
    logged = [
        msgspec.json.decode(line, type=TrainerStep)
        for line in (out / "steps.jsonl").read_bytes().splitlines()
    ]
    assert [e.step for e in logged] == list(range(1, 13))
    assert all(e.generated_with == [previous.weight_version] for previous, e in itertools.pairwise(logged))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["weight_version"] == logged[-1].weight_version


def test_a_bad_chaos_spec_is_a_clear_error() -> None:
    done = belayer("--nats", "nats://127.0.0.1:1", "train", "--chaos", "actor@x:explode")
    assert (
        done.returncode != 0 and "is not GROUP@STEP:ACTION" in done.stderr and "Traceback" not in done.stderr
    )
