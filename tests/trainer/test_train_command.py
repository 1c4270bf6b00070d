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
        "reward" in line and "tok/s" in line and "resumed" in line for line in lines
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

    # Another seed in the same folder is another run: a clear error, and nothing of this one touched.
    other = await asyncio.to_thread(
        belayer, "--nats", url, "train", "--steps", "13", "--prompts", "4", "--group-size", "4",
        "--checkpoint-every", "1", "--seed", "5", "--out", "run", timeout_s=120, cwd=tmp_path,
    )  # fmt: skip
    assert other.returncode != 0 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "another run's checkpoint" in other.stderr and "seed '4' there, '5' here" in other.stderr, (
        other.stderr
    )
    assert len((out / "steps.jsonl").read_bytes().splitlines()) == 12


def test_a_bad_chaos_spec_is_a_clear_error() -> None:
    done = belayer("--nats", "nats://127.0.0.1:1", "train", "--chaos", "actor@x:explode")
    assert (
        done.returncode != 0 and "is not GROUP@STEP:ACTION" in done.stderr and "Traceback" not in done.stderr
    )


async def test_the_rollout_sides_faults_strike_work_in_flight_and_say_what_they_hit(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    """`--chaos` with the rollout side's faults, against the local cluster read from --state-dir:
    the serving worker killed in step 1 and the router stopped in step 2, each while requests are
    in flight; the run trains through both."""
    state_dir = train_cluster.supervisor.config.state_dir
    done = await asyncio.to_thread(
        belayer, "--state-dir", str(state_dir), "--nats", train_cluster.nats.url, "train", "--backend",
        "inline", "--steps", "3", "--prompts", "8", "--group-size", "8", "--length", "6", "--no-held-out",
        "--out", "run",
        "--chaos", "worker@1:kill,router@2:stop", "--chaos-seed", "1", timeout_s=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    struck = [line for line in done.stdout.splitlines() if line.startswith("chaos: ")]
    assert len(struck) == 2, done.stdout
    assert "kill worker" in struck[0] and "requests in flight" in struck[0], struck
    assert "stop router" in struck[1] and "requests in flight" in struck[1], struck
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("step ")] == [
        "1",
        "2",
        "3",
    ]
    trained = (tmp_path / "run" / "samples.jsonl").read_bytes().splitlines()
    assert len(trained) == 3


def test_rollout_faults_it_cannot_carry_out_are_clear_errors(tmp_path: Path) -> None:
    """No local cluster to strike, and a sandbox fault in a workload without sandboxes."""
    nowhere = belayer("--state-dir", str(tmp_path), "--nats", "nats://127.0.0.1:1", "train", "--chaos",
                      "worker@1:kill")  # fmt: skip
    assert nowhere.returncode != 0 and "none is recorded in" in nowhere.stderr, nowhere.stderr
    assert "Traceback" not in nowhere.stderr
    wrong = belayer("--nats", "nats://127.0.0.1:1", "train", "--chaos", "sandbox@1:explode")
    assert wrong.returncode != 0 and "sandbox takes kill, pause" in wrong.stderr, wrong.stderr
