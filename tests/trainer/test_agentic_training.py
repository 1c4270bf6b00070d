"""GRPO on agentic trajectories against the checkpointer's Docker sandboxes, and the oracle's
restore mutation: a restore that gives the older environment with the newer context is caught.
Without Docker and CRIU this skips, except under CI=true, where it fails.

The run under a fault in every layer, against its fault-free twin on a fresh cluster, with the
oracle's record mutations (a flipped reward, a trajectory trained twice, an observation carrying
an infrastructure error's text), is `belayer demo`'s: tests/cli/test_demo.py."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path

import aiodocker
import pytest

from belayer_rl.services.checkpointer.client import container_name
from belayer_rl.services.rollout.agent import RolloutSettings, Trajectory
from belayer_rl.services.trainer import oracle
from belayer_rl.services.trainer.tasks import Lookup
from belayer_rl.services.trainer.trainer import (
    Trainer,
    TrainSettings,
    TrajectoryFailed,
)
from belayer_rl.shared.config import hostname_id
from tests.agent.conftest import sandbox_image
from tests.support import NatsServer, running_cluster

pytestmark = pytest.mark.timeout(600)


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
