"""`belayer demo` as a user runs it, from a folder of its own: a fault of every kind in the first
steps (Docker sandboxes: the faulted steps' actions run in the checkpointer's containers), the run
trained on, a fault-free twin on a fresh cluster, and the verdict. Without Docker and CRIU this
skips, except under CI=true, where it fails. One learning step keeps it short: what the demo
learns is a figure (docs/benchmarks.md), not a test.

The verdict is checked to be a real comparison: the twin's checkpoint with one weight nudged no
longer equals the run's (the mutation check)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from belayer_rl.cli.demo.training import FAULTED_STEPS
from belayer_rl.services.trainer import checkpoint, oracle
from tests.agent.conftest import sandbox_image
from tests.cli.helpers import belayer

pytestmark = pytest.mark.timeout(600)


async def test_the_demo_strikes_every_layer_and_ends_with_the_twins_weights(tmp_path: Path) -> None:
    await sandbox_image("the demo test")
    done = await asyncio.to_thread(
        belayer, "demo", "--steps", str(FAULTED_STEPS + 1), "--out", "shown", timeout_s=540, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    out = done.stdout
    assert "checkpointer's Docker sandboxes" in out
    assert "weights and AdamW state after step 3 equal the twin's, bitwise: yes" in out
    assert "equal the twin's (tokens, actions, observations, rewards): yes" in out
    # Every fault of the schedule struck (the demo exits 1 otherwise), and each kind said so.
    struck = [line for line in out.splitlines() if line.startswith("  chaos: ")]
    for kind in ("kill worker", "stop worker", "kill router", "stop router", "kill sandbox", "pause sandbox",
                 "kill checkpointer", "restart nats", "kill actor", "stop actor", "kill reference",
                 "stop reference", "kill reward", "stop reward"):  # fmt: skip
        assert any(line.startswith(f"  chaos: {kind}") for line in struck), (kind, struck)
    assert "not fired" not in out and "not reached" not in out
    assert "recovery: trainer actor rebuilt" in out or "recovery: the run restarts" in out
    assert "held-out accuracy" in out and "training time the faults added" in out
    for png in ("reward.png", "timeline.png"):
        assert (tmp_path / "shown" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The mutation: one weight of the twin's checkpoint moved to the next float.
    ours = checkpoint.path_for(tmp_path / "shown" / "run" / "checkpoints", FAULTED_STEPS)
    theirs = checkpoint.path_for(tmp_path / "shown" / "twin" / "checkpoints", FAULTED_STEPS)
    assert oracle.same_checkpoint(ours, theirs)
    state = checkpoint.read(theirs)
    params = state["actor"]["actor"]["params"]
    name = sorted(params)[0]
    flat = params[name].clone().view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    params[name] = flat.view(params[name].shape)
    mutant = checkpoint.write(tmp_path / "mutant", FAULTED_STEPS, state)
    assert not oracle.same_checkpoint(ours, mutant)
