"""The actor group on Ray: Ray actors in a placement group, under the same fault manager, against
a real local Ray cluster the tests start (`ray start --head`) and a real Belayer cluster. Faults
are real: SIGKILL of a rank's Ray worker process at a seeded point, SIGSTOP of one (a hang), and a
placement group that cannot be placed. With CI=true and no Ray these tests fail; they never skip."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer_rl.services.trainer.fault_manager import FaultManagerConfig, GroupFault
from belayer_rl.services.trainer.ray_groups import RayGroup
from belayer_rl.services.trainer.tasks import DIGIT_TOKENS, ReverseDigits
from belayer_rl.services.trainer.trainer import GroupBackend, Trainer, TrainSettings
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.processes import free_port
from tests.support import Cluster, EventLog
from tests.trainer.test_fault_manager import (
    FAULTY_STEP,
    fault_during,
    final_state,
    run_the_schedule,
    same,
    settings,
)

pytestmark = pytest.mark.timeout(600)

TASK = ReverseDigits(length=2)
FAST = FaultManagerConfig(hang_timeout_s=3.0, call_timeout_s=60.0, start_timeout_s=120.0)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        import ray
    except ImportError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and Ray is not installed: {exc}")
        pytest.skip(f"Ray is not installed: {exc}")
    binary = shutil.which("ray")
    assert binary is not None, "the ray package is installed without its `ray` command"
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    # `ray start` turns token authentication on wherever ~/.ray/auth_token exists (a local ray.init,
    # `belayer train --backend ray` without an address, writes one), while a driver joins without
    # the token unless RAY_AUTH_MODE=token: the test's own cluster, on 127.0.0.1, runs without it,
    # whatever an earlier Ray left in the home folder.
    started = subprocess.run(
        [binary, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
         "--object-store-memory=200000000", "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=120, check=False, env=os.environ | {"RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    address = f"127.0.0.1:{port}"
    ray.init(address=address, logging_level="WARNING")
    try:
        yield address
    finally:
        ray.shutdown()
        subprocess.run([binary, "stop", "--force"], capture_output=True, timeout=120, check=False)


def ray_trainer(
    cluster: Cluster,
    folder: Path,
    train: TrainSettings,
    faults: FaultManagerConfig,
    step_delay_s: float = 0.0,
    kl_beta: float = 0.0,
    fault_points: str = "",
) -> Trainer:
    worker = TrainerGroupConfig(
        nats_url=cluster.nats.url,
        metrics_port=-1,
        run=train.run,
        world=2,
        rendezvous=folder / "rendezvous",
        preset=train.preset,
        seed=train.seed,
        lr=train.actor.lr,
        ppo_epochs=train.actor.ppo_epochs,
        allowed=",".join(map(str, DIGIT_TOKENS)),
        step_delay_s=step_delay_s,
        kl_beta=kl_beta,
        fault_points=fault_points,
    )
    return Trainer(
        cluster.client, TASK, train, GroupBackend.create("ray", cluster.client, worker, folder, faults)
    )


async def test_on_ray_a_killed_rank_is_seen_dead_rebuilt_and_the_run_matches_its_twin(
    ray_cluster: str, train_cluster: Cluster, tmp_path: Path
) -> None:
    twin = ray_trainer(train_cluster, tmp_path / "twin", settings("raytwin"), FAST)
    await twin.run()
    expected = final_state(twin)

    seed = 3
    rng = random.Random(seed)
    delay, rank = rng.uniform(0.0, 1.2), rng.randrange(2)
    print(f"seed {seed}: SIGKILL rank {rank}'s Ray worker {delay:.3f} s into step {FAULTY_STEP}")
    failed = await EventLog.start(train_cluster.client, "group_failed")
    rebuilt = await EventLog.start(train_cluster.client, "group_rebuilt")
    faulty = ray_trainer(train_cluster, tmp_path / "faulty", settings("rayfaulty"), FAST, step_delay_s=0.3)
    chaos = asyncio.create_task(fault_during(faulty, FAULTY_STEP, delay, signal.SIGKILL, rank))
    await faulty.run()
    await chaos
    assert [e.kind for e in failed.events] == ["exit"] and "died" in failed.events[0].cause, failed.events
    assert len(rebuilt.events) == 1
    assert same(final_state(faulty), expected)

    # A stopped Ray worker is a hang, rebuilt the same way.
    failed.events.clear()
    hung = ray_trainer(train_cluster, tmp_path / "hung", settings("rayhung"), FAST, step_delay_s=0.3)
    chaos = asyncio.create_task(fault_during(hung, FAULTY_STEP, 0.4, signal.SIGSTOP, 1))
    await hung.run()
    await chaos
    assert [e.kind for e in failed.events] == ["hang"], failed.events
    assert same(final_state(hung), expected)


async def test_on_ray_the_printed_schedule_hits_every_group_at_every_point_and_matches_its_twin(
    ray_cluster: str, train_cluster: Cluster, tmp_path: Path
) -> None:
    """The local backend's schedule on Ray. The reward's death is Ray's to recover: its actor is
    restarted and the interrupted call retried (max_restarts, max_task_retries), so the fault
    manager sees nothing of it; every other fault is a targeted rebuild of the actor with the
    reference, placement groups removed and made again."""
    trainer, failed = await run_the_schedule(train_cluster, tmp_path, ray_trainer, "raysched")
    assert failed == [
        ("actor", "exit", 0), ("reference", "exit", 1), ("actor", "exit", 1), ("actor", "exit", 2),
        ("actor", "exit", 3), ("actor", "hang", 4),
    ]  # fmt: skip
    assert trainer.group is not None and trainer.group.reward is not None
    assert trainer.group.reward.builds == 1  # restarted by Ray, not rebuilt


async def test_a_placement_group_that_cannot_be_placed_fails_the_start_in_time(
    ray_cluster: str, train_cluster: Cluster, tmp_path: Path
) -> None:
    """8 ranks of half a CPU on a 2-CPU Ray cluster: the start fails after its timeout, clearly."""
    worker = TrainerGroupConfig(
        nats_url=train_cluster.nats.url, run="toobig", world=8, rendezvous=tmp_path / "r"
    )

    async def publish(_: object) -> str:
        raise AssertionError("nothing is published")

    group = RayGroup(worker, tmp_path, FAST, publish, placement_timeout_s=3.0)  # type: ignore[arg-type]
    with pytest.raises(GroupFault) as failed:
        await group.start()
    await group.stop()
    assert failed.value.kind == "start" and "not ready in 3.0 s" in failed.value.cause
