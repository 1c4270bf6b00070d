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
import os
import signal
from dataclasses import replace
from pathlib import Path

import aiodocker
import msgspec
import pytest

from belayer_rl.cli.chaos.training import LocalCluster, RolloutChaos
from belayer_rl.services.checkpointer.client import SandboxClient, container_name
from belayer_rl.services.rollout.agent import RolloutSettings, Trajectory
from belayer_rl.services.trainer import group_faults, oracle
from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
from belayer_rl.services.trainer.tasks import Lookup
from belayer_rl.services.trainer.trainer import (
    GroupBackend,
    StepResult,
    Trainer,
    TrainSettings,
    TrajectoryFailed,
)
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


class KillBeforeTheMenuAction(Trainer):
    """Each trajectory's container is SIGKILLed as its second action (the menu's) starts: after the
    setup's checkpoint (the policy `always`) is ready, so the restore is of that checkpoint. The
    kill is a signal to the container's init, sent from the hook itself: nothing runs between it and
    the action."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.inits: dict[str, int] = {}  # sandbox -> its container's init pid, read at the setup
        self.reading: list[asyncio.Task[None]] = []
        self.killed: list[str] = []

    def trajectory(self, *args: object, **kwargs: object) -> Trajectory:
        trajectory = super().trajectory(*args, **kwargs)  # type: ignore[arg-type]
        progress = trajectory.on_action

        def on_action(t: Trajectory, step: int) -> None:
            if progress is not None:
                progress(t, step)
            if step == 1:
                self.reading.append(asyncio.ensure_future(self.read_init(t.sandbox)))
            elif step == 2 and t.sandbox not in self.killed:
                assert t.ready_k == 1, t.ready_k  # the setup's checkpoint is the one restored
                os.kill(self.inits[t.sandbox], signal.SIGKILL)
                self.killed.append(t.sandbox)

        trajectory.on_action = on_action
        return trajectory

    async def read_init(self, sandbox: str) -> None:
        assert self.settings.rollout is not None
        async with aiodocker.Docker() as docker:
            container = await docker.containers.get(container_name(self.settings.rollout.host_id, sandbox))
            self.inits[sandbox] = int((await container.show())["State"]["Pid"])


async def test_the_oracle_catches_a_restore_that_gives_the_older_environment_with_the_newer_context(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The mutation: the checkpointer's debug flag restores E_{k-1} with L_k. Every trajectory's
    container is killed after the setup's checkpoint. Restored as built, the run is its twin's.
    With the flag, the base image comes back without the setup's files: the trajectory ends as an
    infrastructure error, its step is not trained (never on a wrong reward), and the oracle
    reports the step missing."""
    await sandbox_image("the agentic training test")
    options = {"engines": 1, "shadows": True, "sandboxes": True, "preset": "tiny"}
    settings = TrainSettings(
        run="restored", steps=1, prompts_per_step=1, group_size=2, seed=8,
        rollout=RolloutSettings(host_id=hostname_id(), scripted=False, policy="always"),
    )  # fmt: skip
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    async with running_cluster(nats_server, tmp_path / "twin-cluster", **options) as cluster:
        await Trainer(cluster.client, Lookup(), replace(settings, record=twin_dir / oracle.RECORD)).run()
    found: dict[bool, list[str]] = {}
    for older_environment in (False, True):
        folder = tmp_path / f"older-{older_environment}"
        folder.mkdir()
        options["debug_older_environment"] = older_environment
        async with running_cluster(nats_server, folder / "cluster", **options) as cluster:
            faulty = KillBeforeTheMenuAction(
                cluster.client, Lookup(), replace(settings, record=folder / oracle.RECORD)
            )
            try:
                await faulty.run()
            except ExceptionGroup as failed:
                errors = [str(e) for e in failed.exceptions]
                assert older_environment, errors
                assert all(isinstance(e, TrajectoryFailed) for e in failed.exceptions), errors
                # The base image has neither the code nor the check: the check prints no score.
                assert all("the check printed no score" in e for e in errors), errors
        assert len(faulty.killed) >= 1
        found[older_environment] = oracle.compare(folder, twin_dir)
    assert found[False] == []
    assert found[True] == ["steps trained: [] against the twin's [0]"]
