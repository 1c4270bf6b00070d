"""GRPO on agentic trajectories, end to end on real components: the trainer samples lookup
trajectories through the router, runs their actions in the checkpointer's Docker sandboxes (the
policy service deciding checkpoints), and trains a 2-rank actor group under the fault manager,
the reward group scoring each trajectory again from its tokens. Without Docker and CRIU this
skips, except under CI=true, where it fails."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.rollout.agent import RolloutSettings
from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
from belayer_rl.services.trainer.tasks import Lookup
from belayer_rl.services.trainer.trainer import GroupBackend, StepResult, Trainer, TrainSettings
from belayer_rl.shared.config import TrainerGroupConfig, hostname_id
from tests.agent.conftest import sandbox_image
from tests.support import Cluster, NatsServer, running_cluster

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
async def sandbox_cluster(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Cluster]:
    """The trainer's cluster (tiny; the weight server comes with the shadows) with the checkpointer on
    the real dockerd and the policy service."""
    await sandbox_image("the agentic training test")
    options = {"engines": 1, "shadows": True, "sandboxes": True, "preset": "tiny"}
    async with running_cluster(nats_server, tmp_path / "cluster", **options) as cluster:
        yield cluster


async def test_the_trainer_trains_on_trajectories_in_docker_sandboxes(
    sandbox_cluster: Cluster, tmp_path: Path
) -> None:
    task = Lookup()
    host_id = hostname_id()
    settings = TrainSettings(
        run="agentic",
        steps=2,
        prompts_per_step=2,
        group_size=4,
        seed=4,
        concurrency=8,
        rollout=RolloutSettings(host_id=host_id, scripted=False),  # the adaptive policy decides
    )
    worker = TrainerGroupConfig(
        nats_url=sandbox_cluster.nats.url,
        metrics_port=-1,
        run=settings.run,
        world=2,
        rendezvous=tmp_path / "rendezvous",
        seed=settings.seed,
        workload="lookup",
        length=task.length,
        allowed=TrainerGroupConfig.allowed_of(task.allowed_sets),
        heartbeat_s=0.2,
    )
    faults = FaultManagerConfig(call_timeout_s=120.0, start_timeout_s=120.0)
    backend = GroupBackend.create("local", sandbox_cluster.client, worker, tmp_path / "groups", faults)
    trainer = Trainer(sandbox_cluster.client, task, settings, backend)
    assert trainer.services is not None and isinstance(trainer.services.sandboxes, SandboxClient)
    steps: list[StepResult] = []
    await trainer.run(steps.append)

    assert [s.event.step for s in steps] == [1, 2]
    for result in steps:
        assert len(result.samples) == 8
        for sample in result.samples:
            trajectory = sample.trajectory
            assert trajectory is not None and trajectory.status == "done", trajectory
            # The reward group scored the trajectory's tokens as the sandbox's check did.
            assert sample.reward == trajectory.reward
            assert sample.prompt + sample.answer == trajectory.context_tokens
            assert sum(sample.loss_mask) == 4  # one menu token and three digits
            assert [k.kind for k in trajectory.timeline if k.kind == "action"] == ["action"] * 3
        assert result.event.response_tokens == 8 * 4
    # Every trajectory's sandbox is gone once it ended.
    assert isinstance(trainer.services.sandboxes, SandboxClient)
    listing = await trainer.services.sandboxes.list()
    assert [s.sandbox for s in listing.sandboxes if s.sandbox.startswith("agentic-")] == []
