"""Chaos for sandboxes: kill trajectories' containers through the Docker API (as Pumba does), on a
seeded schedule, so that policies are compared on the same failures.

Each step (an action and what follows it until the next action: the next LLM turn and the
checkpoint that overlaps it) fails with probability p. The draw is keyed by (seed, trajectory
seed, step, attempt): the attempt counts how often the trajectory has started that step, so a
step redone after a recovery draws anew, and the same seed gives the same schedule under every
policy. A failing step's kill lands at u·D after its action starts, u uniform on [0, 1) and D the
stated step wall time (the failure-free run's mean): mid-action, mid-turn and mid-checkpoint alike.
Each kill is a `chaos_kill` event and a timeline entry.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import aiodocker
from nats.aio.client import Client as NATS

from belayer_rl.services.checkpointer.client import container_name
from belayer_rl.services.rollout.agent import Trajectory
from belayer_rl.services.rollout.workloads import seeded
from belayer_rl.shared import bus
from belayer_rl.shared.protocol import ChaosKill
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.chaos")


class KillSchedule:
    """The seeded draws alone: when each attempt of each step is killed."""

    def __init__(self, seed: int, p_per_step: float, step_wall_s: float) -> None:
        if not 0.0 <= p_per_step <= 1.0:
            raise ValueError(f"the failure probability per step must be in [0, 1], got {p_per_step}")
        self.seed = seed
        self.p = p_per_step
        self.step_wall_s = step_wall_s
        self.attempts: Counter[tuple[int, int]] = Counter()

    def next(self, trajectory_seed: int, step: int) -> float | None:
        """The delay of this attempt's kill after its action starts, or None: no kill."""
        self.attempts[(trajectory_seed, step)] += 1
        rng = seeded("chaos", self.seed, trajectory_seed, step, self.attempts[(trajectory_seed, step)])
        fails, u = rng.random() < self.p, rng.random()
        return u * self.step_wall_s if fails else None


class SandboxChaos:
    def __init__(
        self,
        schedule: KillSchedule,
        *,
        host_id: str,
        nc: NATS,
        subjects: Subjects,
        docker_url: str | None = None,
    ) -> None:
        self.schedule = schedule
        self.host_id = host_id
        self.nc = nc
        self.subjects = subjects
        self.docker = aiodocker.Docker(url=docker_url)
        self.kills: set[asyncio.Task[None]] = set()
        self.killed = 0

    def on_action(self, trajectory: Trajectory, step: int) -> None:
        """The agent's hook: action `step` of `trajectory` is about to run."""
        delay = self.schedule.next(trajectory.seed, step)
        if delay is None:
            return
        task = asyncio.ensure_future(self.kill_later(trajectory, step, delay))
        self.kills.add(task)
        task.add_done_callback(self.kills.discard)

    async def kill_later(self, trajectory: Trajectory, step: int, delay_s: float) -> None:
        """Kill the container that runs this attempt of the step: resolved now, killed by id, so a
        kill whose attempt already failed otherwise finds that container gone and kills nothing
        else (a restored container is a new one)."""
        name = container_name(self.host_id, trajectory.sandbox)
        try:
            container_id = (await self.docker.containers.get(name)).id
            await asyncio.sleep(delay_s)
            at = trajectory.clock()
            await self.docker.containers.container(container_id).kill()
        except aiodocker.DockerError as exc:  # gone already (a recovery in progress, the end)
            log.info("chaos: no kill of %s at step %d: %s", name, step, exc.message)
            return
        self.killed += 1
        trajectory.mark(
            "kill", at, f"SIGKILL {container_id[:12]} {delay_s:.3f} s into step {step}", step=step
        )
        event = ChaosKill(
            trajectory=trajectory.trajectory_id,
            sandbox=trajectory.sandbox,
            host_id=self.host_id,
            container_id=container_id,
            step=step,
            delay_s=delay_s,
        )
        try:
            await bus.publish(self.nc, self.subjects.event("chaos_kill", trajectory.trajectory_id), event)
        except Exception as exc:  # the kill happened; only its event is lost
            log.warning("chaos: the event of a kill was lost: %s", exc)

    async def close(self) -> None:
        for task in list(self.kills):
            task.cancel()
        for task in list(self.kills):
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("chaos: a kill failed")
        await self.docker.close()
