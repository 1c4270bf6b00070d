"""The trainer on a real cluster (router, weight server, shadow supervisor, one tiny worker): it
really learns, one-step off-policy samples are clipped, a resumed run repeats its failure-free
twin bit for bit, and a non-finite step is never published."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from belayer_rl.services.trainer import checkpoint
from belayer_rl.services.trainer.actor import ActorSettings, NonFiniteUpdate
from belayer_rl.services.trainer.tasks import ReverseDigits
from belayer_rl.services.trainer.trainer import AnotherRun, Sample, StepResult, Trainer, TrainSettings
from belayer_rl.services.weight_server.client import WeightClient
from tests.support import Cluster

TASK = ReverseDigits(length=2)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)  # bitwise-repeatable updates


def learned(before: float, after: float) -> bool:
    """Clearly above chance (1%) and the untrained model."""
    return after >= 0.5 and after >= before + 0.3


async def train(cluster: Cluster, settings: TrainSettings) -> tuple[float, float, Trainer]:
    trainer = Trainer(cluster.client, TASK, settings)
    await trainer.publish()
    before = await trainer.accuracy(TASK.held_out)
    await trainer.run()
    return before, await trainer.accuracy(TASK.held_out), trainer


async def test_learning_is_real_and_learning_rate_zero_is_not(train_cluster: Cluster) -> None:
    """Three seeds learn to reverse held-out digit strings; the first seed's run at lr 0 does not
    (one control is enough, and 5 of its steps: at lr 0 the weights, and so the accuracy, cannot
    move, however many steps it takes)."""
    runs = {
        (seed, lr): TrainSettings(
            run=f"learn-{seed}-{int(lr > 0)}", steps=45 if lr else 5, seed=seed, actor=ActorSettings(lr=lr)
        )
        for seed, lr in ((0, 3e-3), (1, 3e-3), (2, 3e-3), (0, 0.0))
    }
    results = await asyncio.gather(*(train(train_cluster, settings) for settings in runs.values()))
    accuracy = {key: (before, after) for key, (before, after, _) in zip(runs, results, strict=True)}
    print("held-out accuracy (before, after):", accuracy)
    for seed in (0, 1, 2):
        assert learned(*accuracy[seed, 3e-3]), (seed, accuracy[seed, 3e-3])
    assert not learned(*accuracy[0, 0.0]), accuracy[0, 0.0]
    assert accuracy[0, 0.0][0] == accuracy[0, 0.0][1]  # lr 0: the same weights


async def test_one_step_off_policy_samples_come_from_the_previous_version_and_are_clipped(
    train_cluster: Cluster,
) -> None:
    events: list[StepResult] = []
    settings = TrainSettings(
        run="offpolicy", steps=4, seed=3, off_policy=True, actor=ActorSettings(lr=3e-2, ppo_epochs=1)
    )
    trainer = Trainer(train_cluster.client, TASK, settings)
    await trainer.run(events.append)
    published = [e.event.weight_version for e in events]
    assert events[2].event.generated_with == [published[0]]  # step 2 sampled on the weights of step 0
    assert events[3].event.generated_with == [published[1]]
    assert max(e.stats.ratio_max for e in events[1:]) > 1.0
    assert sum(e.stats.clipped_fraction for e in events[1:]) > 0

    # The control: synchronous with one pass per batch, the ratio is 1 and nothing is clipped.
    sync: list[StepResult] = []
    on_policy = dataclasses.replace(settings, run="onpolicy", off_policy=False)
    await Trainer(train_cluster.client, TASK, on_policy).run(sync.append)
    assert all(e.stats.clipped_fraction == 0 and e.stats.ratio_max == 1.0 for e in sync)


def final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = trainer.actor.state()
    flat = {f"param.{k}": v for k, v in state["params"].items()}  # type: ignore[union-attr]
    for index, slots in state["optimizer"]["state"].items():  # type: ignore[index]
        for name, value in slots.items():
            flat[f"opt.{index}.{name}"] = torch.as_tensor(value)
    return flat


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_a_resumed_run_ends_bitwise_equal_to_its_twin(train_cluster: Cluster, tmp_path: Path) -> None:
    """8 steps of 12 prompts over 80 training strings cross an epoch boundary (after step 6). The
    twin runs straight through; the resumed run stops after 3 steps, its newest checkpoint is
    damaged, and a new trainer resumes from the one before it. Mutation: a run that skips one
    sample's update at step 4 ends different, so the comparison can fail."""
    base = TrainSettings(run="twin", steps=8, prompts_per_step=12, group_size=4, seed=5)
    twin = Trainer(train_cluster.client, TASK, base)
    await twin.run()

    folder = tmp_path / "ckpt"
    resumed = dataclasses.replace(base, run="twin", checkpoint_every=1, checkpoint_dir=folder)
    first = Trainer(train_cluster.client, TASK, dataclasses.replace(resumed, steps=3))
    await first.run()
    newest = checkpoint.path_for(folder, 3)
    newest.write_bytes(newest.read_bytes()[:1000])  # a half-written file
    second = Trainer(train_cluster.client, TASK, resumed)
    # The same folder under another seed is another run's: refused, and nothing loaded.
    other = Trainer(train_cluster.client, TASK, dataclasses.replace(resumed, seed=6))
    with pytest.raises(AnotherRun, match="seed '5' there, '6' here"):
        await other.resume()
    assert other.step == 0 and other.version == ""
    skipped = await second.resume()
    assert second.step == 2 and len(skipped) == 1 and "digest mismatch" in skipped[0]
    await second.run()
    assert second.position == twin.position and second.position.epoch == 1
    assert second.version == twin.version
    assert same(final_state(second), final_state(twin))

    class SkipsOne(Trainer):
        def update(self, samples: list[Sample]):  # type: ignore[no-untyped-def]
            if self.step == 4:
                samples = [dataclasses.replace(samples[0], reward=1.0 - samples[0].reward), *samples[1:]]
            return super().update(samples)

    mutant = SkipsOne(train_cluster.client, TASK, dataclasses.replace(base, run="mutant"))
    await mutant.run()
    assert not same(final_state(mutant), final_state(twin))


async def test_a_non_finite_step_is_never_published(train_cluster: Cluster) -> None:
    """A reward function that returns NaN at step 2 (a fault injected through the reward, the way a
    buggy reward would) fails the step: the error surfaces, the actor is back at its last good
    weights and the weight server's newest version is still the one published after step 1."""

    class NanReward(ReverseDigits):
        armed = False

        def reward(self, item: str, answer: list[int]) -> float:
            return float("nan") if self.armed else super().reward(item, answer)

    task = NanReward(length=2)
    settings = TrainSettings(run="nan", steps=4, seed=7)
    trainer = Trainer(train_cluster.client, task, settings)

    def arm(result: StepResult) -> None:
        if result.event.step == 2:
            object.__setattr__(task, "armed", True)

    with pytest.raises(NonFiniteUpdate):
        await trainer.run(arm)
    assert trainer.step == 2
    newest = (
        await WeightClient(train_cluster.client.nc, subjects=train_cluster.client.subjects).ping()
    ).newest
    assert newest == trainer.version
    assert all(bool(torch.isfinite(t).all()) for t in trainer.actor.weights().values())
