"""`belayer demo` as a user runs it, from a folder of its own: one seeded schedule with a fault of
every kind in the first steps (workers, the router, sandbox containers, the checkpointer,
nats-server, and the trainer's actor, reference and reward groups at their named points), each
at work in flight; the run trained on; a fault-free twin on a fresh cluster; the verdict. The
faulted steps' first trajectories run in the checkpointer's Docker sandboxes. Without Docker and
CRIU this skips, except under CI=true, where it fails. One learning step keeps it short: what the
demo learns is a figure (docs/benchmarks.md), not a test.

The oracle (services/trainer/oracle.py) is checked to catch a wrong answer: the twin's checkpoint
with one weight moved to the next float, and the run's record with a flipped reward, a trajectory
trained twice, or an observation carrying an infrastructure error's text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiodocker
import msgspec
import pytest
import torch

from belayer_rl.cli.demo.training import FAULTED_STEPS
from belayer_rl.services.checkpointer.sandbox import LABEL_SANDBOX
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

    # The record's mutations: the run's with one wrong thing in step 2, each caught and named.
    run, twin = tmp_path / "shown" / "run", tmp_path / "shown" / "twin"
    assert oracle.compare(run, twin, through=FAULTED_STEPS) == []
    for mutate, named in MUTATIONS.items():
        mutant_dir = tmp_path / f"mutant-{named}"
        mutant_dir.mkdir()
        lineage = oracle.lineage(run)
        lineage[2] = msgspec.structs.replace(lineage[2], samples=mutate(lineage[2].samples))
        (mutant_dir / oracle.RECORD).write_bytes(
            b"".join(msgspec.json.encode(x) + b"\n" for x in lineage.values())
        )
        found = oracle.compare(mutant_dir, twin, through=FAULTED_STEPS)
        assert found and all(x.startswith("step 2: ") for x in found), (named, found)
        assert any(named in x for x in found), (named, found)

    # Every trajectory's sandbox is gone once it ended.
    async with aiodocker.Docker() as docker:
        left = await docker.containers.list(all=True, filters={"label": [LABEL_SANDBOX]})
    assert [c["Labels"][LABEL_SANDBOX] for c in left if c["Labels"][LABEL_SANDBOX].startswith("demo-")] == []


def flip_reward(samples: list[oracle.TrainedSample]) -> list[oracle.TrainedSample]:
    return [msgspec.structs.replace(samples[0], reward=0.0 if samples[0].reward else 1.0), *samples[1:]]


def train_twice(samples: list[oracle.TrainedSample]) -> list[oracle.TrainedSample]:
    return [samples[0], samples[0], *samples[2:]]


def error_in_observation(samples: list[oracle.TrainedSample]) -> list[oracle.TrainedSample]:
    first = samples[0]
    observations = [*first.observations[:-1], "sandbox-gone: the container was killed"]
    return [msgspec.structs.replace(first, observations=observations), *samples[1:]]


MUTATIONS = {flip_reward: "reward", train_twice: "trained twice", error_in_observation: "observations"}
