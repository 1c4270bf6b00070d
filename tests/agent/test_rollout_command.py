"""`belayer rollout` as a user runs it, against a real cluster: a shell batch under chaos (real
container kills) and a math batch, their results and timelines on disk, and `--plot` drawing
them as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from belayer_rl.services.rollout.agent import TrajectoryResult
from tests.agent.conftest import AgentCluster
from tests.cli.helpers import belayer

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]


async def test_rollout_runs_a_batch_under_chaos_and_plots_it(
    agent_cluster: AgentCluster, tmp_path: Path
) -> None:
    url = agent_cluster.cluster.nats.url
    out = tmp_path / "batch"
    run = await _belayer(
        "--nats", url, "rollout", "--workload", "shell", "--tasks", "2", "--turns", "3", "--action-s", "0.2",
        "--policy", "always", "--chaos-p", "0.4", "--chaos-step-s", "0.8", "--chaos-seed", "3",
        "--host-id", agent_cluster.host_id, "--out", str(out), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout)
    assert summary["trajectories"] == 2 and summary["infra_errors"] == 0 and summary["scripted"] is True
    assert summary["kills"] >= 1 and summary["recoveries"] == summary["failures"] >= 1, summary
    results = [
        msgspec.json.decode(line, type=TrajectoryResult)
        for line in (out / "results.jsonl").read_bytes().splitlines()
    ]
    assert {r.status for r in results} == {"done"} and all(len(r.actions) == 4 for r in results)
    timelines = sorted((out / "timelines").glob("*.jsonl"))
    assert len(timelines) == 2
    kinds = {json.loads(line)["kind"] for path in timelines for line in path.read_text().splitlines()}
    assert {"turn", "action", "checkpoint", "kill", "failure", "recovery"} <= kinds, kinds

    plotted = await _belayer("rollout", "--plot", str(out))
    assert plotted.returncode == 0, plotted.stderr
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    maths = await _belayer(
        "--nats", url, "rollout", "--workload", "math", "--tasks", "1", "--out", str(tmp_path / "m"), "--json"
    )
    assert maths.returncode == 0, maths.stderr[-2000:]
    assert json.loads(maths.stdout)["trajectories"] == 1

    wrong = await _belayer("--nats", url, "rollout", "--policy", "sometimes", "--out", str(tmp_path / "w"))
    assert wrong.returncode != 0 and "unknown policy" in wrong.stderr


async def _belayer(*args: str):  # type: ignore[no-untyped-def]
    import asyncio

    return await asyncio.to_thread(belayer, *args, timeout_s=400)
