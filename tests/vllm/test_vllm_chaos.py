"""`belayer chaos` on vLLM engines: worker kills while generations run, with the campaign's oracle.

The oracle's reference for vLLM is each finished generation run again on the same cluster after the
faults (its uninterrupted twin): tokens equal, logprobs within 1e-4 (docs/benchmarks.md: 400
resumes out of 400 drew the same tokens), and the token log continuous. One kill: the issue bounds
the vLLM tests to three, and tests/vllm/test_vllm_engine.py makes two.
"""

from __future__ import annotations

from pathlib import Path

from belayer_rl.cli.chaos.campaign import render, run_campaign
from belayer_rl.cli.chaos.config import ChaosConfig
from belayer_rl.cli.model import make_tiny
from tests.vllm.test_vllm_engine import vllm_python


async def test_a_worker_kill_on_a_vllm_engine_passes_the_oracle(tmp_path: Path, seed: int) -> None:
    python = vllm_python()
    config = ChaosConfig(
        faults=1, seed=seed, interval_s=4.0, kinds=("worker-kill",), engines=1, generators=4,
        trajectories=0, max_tokens=200, engine="vllm", model_path=make_tiny(tmp_path / "tiny"),
        engine_python=python,
    )  # fmt: skip
    summary = await run_campaign(config)
    assert summary.passed, render(summary)
    assert summary.faults == {"worker-kill": 1}
    assert summary.hits["worker-kill"] >= 1  # it struck requests in flight
    assert summary.generations_completed >= 4
    assert not summary.leaks  # no vLLM process outlived its worker, no container, no consumer
