"""GRPO on agentic trajectories, end to end on real components: the trainer samples lookup
trajectories through the router, runs their actions in the checkpointer's Docker sandboxes (the
policy service deciding checkpoints), and trains a 2-rank actor group under the fault manager,
the reward group scoring each trajectory again from its tokens. Without Docker and CRIU this
skips, except under CI=true, where it fails.

Under one seeded schedule of faults in every layer (services/trainer/group_faults.py: workers,
routers, sandboxes, the checkpointer, nats-server, and the actor and reward groups at their named
points), a run ends as its fault-free twin on a fresh cluster: the same weights and AdamW state,
bitwise, and the same samples trained at every step (services/trainer/oracle.py). The oracle's
mutation checks: a flipped reward, a trajectory trained twice, an observation carrying an
infrastructure error's text."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiodocker
import msgspec
import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.rollout.agent import RolloutSettings
from belayer_rl.services.trainer import group_faults, oracle
from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
from belayer_rl.services.trainer.rollout_faults import LocalCluster, RolloutChaos
from belayer_rl.services.trainer.tasks import Lookup
from belayer_rl.services.trainer.trainer import GroupBackend, StepResult, Trainer, TrainSettings
from belayer_rl.shared.config import TrainerGroupConfig, hostname_id
from tests.agent.conftest import sandbox_image
from tests.support import Cluster, NatsServer, running_cluster

pytestmark = pytest.mark.timeout(600)


# One fault of every kind, early: the rollout side's at whatever the step has in flight, the
# trainer's at its named points, and a hang of the actor.
SCHEDULE = (
    "worker@0:kill,reward@0:kill@forward,sandbox@1:kill,actor@1:kill@forward,router@2:kill,"
    "actor@2:kill@backward,sandbox@3:pause,worker@3:stop,actor@3:kill@publish,checkpointer@4:kill,"
    "actor@4:kill@state-write,router@5:stop,nats@5:restart,actor@5:stop@forward"
)
SCHEDULE_SEED = 3
STEPS = 6


@dataclasses.dataclass
class OwnNats(LocalCluster):
    """The test's cluster: its nats-server is the test's, restarted by the test."""

    nats: NatsServer | None = None

    async def restart_nats(self) -> None:
        assert self.nats is not None
        await self.nats.restart(down_s=0.5)


def lookup_trainer(cluster: Cluster, folder: Path, fault_points: str = "") -> Trainer:
    """The same run, on whichever cluster: the same run id, so the same trajectory ids."""
    task = Lookup()
    settings = TrainSettings(
        run="mixed",
        steps=STEPS,
        prompts_per_step=2,
        group_size=4,
        seed=6,
        concurrency=8,
        rollout=RolloutSettings(host_id=hostname_id(), scripted=False),
        record=folder / oracle.RECORD,
        # A group failing with the rollout side (an actor fault within the joint window of a
        # worker's) reschedules from the latest checkpoint.
        checkpoint_every=1,
        checkpoint_dir=folder / "checkpoints",
    )
    worker = TrainerGroupConfig(
        nats_url=cluster.nats.url,
        metrics_port=-1,
        run=settings.run,
        world=2,
        rendezvous=folder / "rendezvous",
        seed=settings.seed,
        workload="lookup",
        length=task.length,
        allowed=TrainerGroupConfig.allowed_of(task.allowed_sets),
        heartbeat_s=0.2,
        fault_points=fault_points,
    )
    faults = dataclasses.replace(
        FaultManagerConfig(hang_timeout_s=3.0, call_timeout_s=120.0, start_timeout_s=120.0),
        actor_max_rebuild_times=8,
        max_reschedule_times=4,  # an actor fault within 30 s of a worker's is a joint one: a reschedule
    )
    backend = GroupBackend.create("local", cluster.client, worker, folder, faults)
    return Trainer(cluster.client, task, settings, backend)


async def test_faults_in_every_layer_end_with_the_fault_free_twins_weights_and_samples(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    await sandbox_image("the agentic training test")
    options = {"engines": 1, "shadows": True, "sandboxes": True, "preset": "tiny"}
    twin_dir, faulty_dir = tmp_path / "twin", tmp_path / "faulty"
    async with running_cluster(nats_server, tmp_path / "twin-cluster", **options) as cluster:
        twin = lookup_trainer(cluster, twin_dir)
        assert twin.services is not None and isinstance(twin.services.sandboxes, SandboxClient)
        steps: list[StepResult] = []
        await twin.run(steps.append)
        listing = await twin.services.sandboxes.list()
    # The fault-free run trained on whole trajectories from Docker sandboxes.
    assert [s.event.step for s in steps] == list(range(1, STEPS + 1))
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
    assert [s.sandbox for s in listing.sandboxes if s.sandbox.startswith("mixed-")] == []
    planned = group_faults.schedule(SCHEDULE, SCHEDULE_SEED)
    for fault in planned:
        print(f"chaos (seed {SCHEDULE_SEED}): {fault}")
    async with (
        running_cluster(nats_server, tmp_path / "faulty-cluster", **options) as cluster,
        aiodocker.Docker() as docker,
    ):
        trainer = lookup_trainer(cluster, faulty_dir, group_faults.armed(planned, 2))
        targets = OwnNats(cluster.client, docker, tmp_path / "faulty-cluster", nats_server)
        chaos = RolloutChaos(trainer, trainer.settings.run, targets, SCHEDULE_SEED)
        injecting = asyncio.create_task(chaos.inject(planned))
        try:
            await trainer.run()
        except BaseException:
            injecting.cancel()
            raise
        await asyncio.wait_for(injecting, 30)
        print(*chaos.log, sep="\n")
    assert [line for line in chaos.log if "not fired" in line] == []
    assert len(chaos.log) == sum(1 for f in planned if f.rollout)
    assert [str(f) for f in planned if f.point and not group_faults.fired(f, faulty_dir, 2)] == []
    assert oracle.compare(faulty_dir, twin_dir) == []
    assert oracle.same_state(trainer.group.actor.state_file, twin.group.actor.state_file)  # type: ignore[union-attr]
    # The mutations: the faulty run's record with one wrong thing in it, each caught and named.
    for mutate, named in MUTATIONS.items():
        mutant = tmp_path / f"mutant-{named}"
        mutant.mkdir()
        lineage = oracle.lineage(faulty_dir)
        lineage[2] = msgspec.structs.replace(lineage[2], samples=mutate(lineage[2].samples))
        (mutant / oracle.RECORD).write_bytes(
            b"".join(msgspec.json.encode(x) + b"\n" for x in lineage.values())
        )
        found = oracle.compare(mutant, twin_dir)
        assert found and all(x.startswith("step 2: ") for x in found), (named, found)
        assert any(named in x for x in found), (named, found)


def flip_reward(samples: list[oracle.TrainedSample]) -> list[oracle.TrainedSample]:
    return [msgspec.structs.replace(samples[0], reward=0.0 if samples[0].reward else 1.0), *samples[1:]]


def train_twice(samples: list[oracle.TrainedSample]) -> list[oracle.TrainedSample]:
    return [samples[0], samples[0], *samples[2:]]


def error_in_observation(samples: list[oracle.TrainedSample]) -> list[oracle.TrainedSample]:
    first = samples[0]
    observations = [*first.observations[:-1], "sandbox-gone: the container was killed"]
    return [msgspec.structs.replace(first, observations=observations), *samples[1:]]


MUTATIONS = {flip_reward: "reward", train_twice: "trained twice", error_in_observation: "observations"}
