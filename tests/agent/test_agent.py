"""The agent loop end to end (services/rollout/agent.py), on a real cluster: the router and a
tiny-4k worker in deterministic mode, the checkpointer on the real dockerd with CRIU, the policy
service. Sandbox containers are SIGKILLed through the Docker API mid-step.

- A trajectory that suffers container failures ends with the same actions, observations, context
  tokens and reward as its failure-free run: restored from checkpoints (policy always, seeded
  chaos) and restarted from the base image (policy never).
- A recovery to checkpoint k keeps the response that answered L_k: no response is generated twice.
- Mutation checks: a checkpoint record that pairs E_k with L_{k-1}, or E_{k-1} with L_k, makes
  the comparison fail.
- A container killed mid-action, or OOM-killed, never reaches the context; an action that OOMs
  every time ends the trajectory as an infrastructure error naming the cause, after the bound.
- The policy service stopped (SIGSTOP): the driver falls back to its named policy and says so.
- A checkpoint timeout cools the host down: the policy then answers busy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time
import uuid
from collections.abc import Callable

import aiodocker
import pytest

from belayer_rl.services.checkpointer.client import SandboxClient, container_name
from belayer_rl.services.rollout.agent import RolloutSettings, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.sandbox_faults import KillSchedule, SandboxChaos
from belayer_rl.services.rollout.workloads import Task, shell_tasks
from belayer_rl.shared import bus, tokenizer
from belayer_rl.shared.protocol import CheckpointResult, PolicyDecision, PolicyFallback
from tests.agent.conftest import AgentCluster

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

TASK = shell_tasks(1, turns=6, action_s=0.2)[0]
SEED = 12345  # the trajectory's sampling seed: its turns draw the same tokens in every run


def same_trajectory(a: TrajectoryResult, b: TrajectoryResult) -> bool:
    return (a.actions, a.observations, a.context_tokens, a.logprobs, a.reward) == (
        b.actions,
        b.observations,
        b.context_tokens,
        b.logprobs,
        b.reward,
    )


async def run(
    ac: AgentCluster,
    policy: str,
    *,
    task: Task = TASK,
    on_action: Callable[[Trajectory, int], None] | None = None,
    sandboxes: SandboxClient | None = None,
    **settings: object,
) -> TrajectoryResult:
    services = ac.services if sandboxes is None else dataclasses.replace(ac.services, sandboxes=sandboxes)
    config = RolloutSettings(host_id=ac.host_id, policy=policy, consult_every_s=0.2, **settings)  # type: ignore[arg-type]
    started = time.monotonic()
    trajectory = Trajectory(
        f"t-{uuid.uuid4().hex[:8]}", task, SEED, config, services, lambda: time.monotonic() - started
    )
    trajectory.on_action = on_action
    result = await trajectory.run()
    assert result.status == "done" or settings.get("max_recoveries") is not None, result.error
    return result


class KillAt:
    """Kills the trajectory's container `delay_s` into each step of `steps`, once each (a real
    SIGKILL through the Docker API)."""

    def __init__(self, host_id: str, steps: set[int], delay_s: float) -> None:
        self.host_id, self.pending, self.delay_s = host_id, set(steps), delay_s
        self.tasks: list[asyncio.Task[None]] = []
        self.killed: list[int] = []

    def __call__(self, trajectory: Trajectory, step: int) -> None:
        if step in self.pending:
            self.pending.discard(step)
            self.tasks.append(asyncio.ensure_future(self.kill(trajectory, step)))

    async def kill(self, trajectory: Trajectory, step: int) -> None:
        await asyncio.sleep(self.delay_s)
        docker = aiodocker.Docker()
        try:
            container = await docker.containers.get(container_name(self.host_id, trajectory.sandbox))
            await container.kill()
            self.killed.append(step)
        finally:
            await docker.close()


class RecordingSandboxes(SandboxClient):
    """The real client; remembers the context each checkpoint k was given (L_k), and can lie:
    `shift` -1 labels E_k with L_{k-1}, +1 labels E_k with L_{k+1} (E_{j-1} with L_j), taken from
    `contexts` (a failure-free run's)."""

    def __init__(
        self, base: SandboxClient, shift: int = 0, contexts: dict[int, list[int]] | None = None
    ) -> None:
        super().__init__(base.nc, base.host_id, subjects=base.subjects, client=base.client)
        self.shift = shift
        self.contexts = contexts or {}
        self.sent: dict[int, list[int]] = {}

    async def checkpoint(
        self, sandbox: str, trajectory: str, k: int, context_tokens: list[int] | None = None, **kwargs: object
    ) -> CheckpointResult:  # type: ignore[override]
        tokens = list(context_tokens or [])
        self.sent[k] = tokens
        if self.shift and k + self.shift in self.contexts:
            tokens = self.contexts[k + self.shift]
        return await super().checkpoint(sandbox, trajectory, k, tokens, **kwargs)  # type: ignore[arg-type]


async def test_failures_leave_the_trajectory_unchanged(agent_cluster: AgentCluster, seed: int) -> None:
    ac = agent_cluster
    recorder = RecordingSandboxes(ac.services.sandboxes)
    reference = await run(ac, "always", sandboxes=recorder)  # failure-free, with every L_k recorded
    assert (
        reference.failures == 0
        and reference.checkpoints >= 4
        and len(reference.actions) == TASK.max_turns + 1
    )
    assert set(recorder.sent) >= {2, 3, 4}
    never_reference = await run(ac, "never")
    assert same_trajectory(reference, never_reference), "checkpoints changed a failure-free trajectory"

    # Seeded chaos under policy always: restores from checkpoints (a schedule with a first-attempt
    # kill past step 2, so that a checkpoint exists when it lands).
    chaos_seed = next(
        s
        for s in range(seed, seed + 1000)
        if any(_first_attempt_fails(s, step, 0.35) for step in range(3, 7))
    )
    print(f"chaos seed {chaos_seed} (p = 0.35 per step)")
    chaos = SandboxChaos(
        KillSchedule(chaos_seed, 0.35, 0.6),
        host_id=ac.host_id,
        nc=ac.services.nc,
        subjects=ac.services.subjects,
    )
    try:
        restored = await run(ac, "always", on_action=chaos.on_action)
    finally:
        await chaos.close()
    print(
        f"always + chaos: {chaos.killed} kills, {restored.failures} failures, {restored.recoveries} recoveries"
    )
    assert chaos.killed >= 1 and restored.failures >= 1 and restored.recoveries == restored.failures
    assert restored.restores_from_base < restored.recoveries, "no recovery used a checkpoint"
    assert same_trajectory(reference, restored), "a recovered trajectory differs from its failure-free run"
    # The loss mask: 0 on exactly the observations' tokens, the same after a recovery.
    assert len(reference.loss_mask) == len(reference.context_tokens) - reference.prompt_len
    assert reference.loss_mask.count(0) == sum(len(tokenizer.encode(o)) for o in reference.observations)
    assert restored.loss_mask == reference.loss_mask
    # The logprobs: one per token of the model's, 0.0 on the observations', the same after a recovery.
    assert len(reference.logprobs) == len(reference.loss_mask)
    assert all(x == 0.0 for x, bit in zip(reference.logprobs, reference.loss_mask, strict=True) if not bit)
    assert all(x <= 0.0 for x in reference.logprobs) and min(reference.logprobs) < 0.0

    # A kill mid-action 5 restores checkpoint 4 and keeps the response that answered L_4: no
    # response is generated twice (a recovery that generated it again would add a turn).
    kept = await run(ac, "always", on_action=KillAt(ac.host_id, {5}, 0.05))
    assert kept.failures == kept.recoveries == 1 and kept.restores_from_base == 0
    assert kept.turns == reference.turns, "the response to the restored checkpoint's L_k was generated again"
    assert any("keeping its response" in e.detail for e in kept.timeline if e.kind == "recovery")
    assert same_trajectory(reference, kept), "the kept response changed the trajectory"

    # Policy never: each failure restarts from the base image and the prompt.
    killer = KillAt(ac.host_id, {4}, 0.05)
    restarted = await run(ac, "never", on_action=killer)
    assert killer.killed == [4] and restarted.restores_from_base >= 1 and restarted.checkpoints == 0
    assert same_trajectory(reference, restarted), "a restart from the base image differs"

    # Mutation checks: the same kill with a checkpoint record that pairs the wrong halves.
    for shift, pairing in ((-1, "E_k with L_(k-1)"), (+1, "E_(k-1) with L_k")):
        liar = RecordingSandboxes(ac.services.sandboxes, shift=shift, contexts=recorder.sent)
        wrong = await run(ac, "always", on_action=KillAt(ac.host_id, {5}, 0.05), sandboxes=liar)
        assert wrong.recoveries >= 1
        assert not same_trajectory(reference, wrong), f"restoring {pairing} went unnoticed"


def _first_attempt_fails(chaos_seed: int, step: int, p: float) -> bool:
    return KillSchedule(chaos_seed, p, 1.0).next(SEED, step) is not None


async def test_infrastructure_failures_are_never_observations(agent_cluster: AgentCluster) -> None:
    ac = agent_cluster
    slow = shell_tasks(1, turns=5, action_s=1.0)[0]
    reference = await run(ac, "always", task=slow)
    killer = KillAt(ac.host_id, {3, 5}, 0.5)  # half-way through a one-second action
    killed = await run(ac, "always", task=slow, on_action=killer)
    assert sorted(killer.killed) == [3, 5] and killed.failures == 2
    assert killed.context_tokens == reference.context_tokens, "an environment failure reached the context"
    failures = [e for e in killed.timeline if e.kind == "failure"]
    assert len(failures) == 2 and all("env-failure" in e.detail for e in failures)
    text = tokenizer.decode(killed.context_tokens)
    assert "env-failure" not in text and "Traceback" not in text

    # An action that is OOM-killed every time: the trajectory ends as an infrastructure error naming
    # the cause once the recoveries run out, and the OOM's text never reaches the context.
    hog = dataclasses.replace(slow, task_id="hog", menu=("memhold 400",), max_turns=3)
    oom = await run(ac, "always", task=hog, max_recoveries=2, memory_mb=64)
    assert oom.status == "infra-error" and "oom" in oom.error.lower(), oom.error
    assert oom.failures == 3 and oom.recoveries == 2
    assert all("memhold" not in o for o in oom.observations)
    assert "oom" not in tokenizer.decode(oom.context_tokens).lower()


async def test_policy_unavailable_falls_back_and_timeouts_cool_the_host_down(
    agent_cluster: AgentCluster,
) -> None:
    ac = agent_cluster
    reference = await run(ac, "never")
    fallbacks: list[PolicyFallback] = []
    decisions: list[PolicyDecision] = []

    async def on_fallback(event: PolicyFallback) -> None:
        fallbacks.append(event)

    async def on_decision(event: PolicyDecision) -> None:
        decisions.append(event)

    nc, names = ac.services.nc, ac.services.subjects
    await bus.listen(nc, names.event("policy_fallback", "*"), PolicyFallback, on_fallback)
    await bus.listen(nc, names.event("policy_decision", "*"), PolicyDecision, on_decision)
    policy_pid = ac.cluster.pid_of("policy")
    os.kill(policy_pid, signal.SIGSTOP)
    try:
        stopped = await run(ac, "adaptive", fallback_policy="every-2")
    finally:
        os.kill(policy_pid, signal.SIGCONT)
    assert same_trajectory(reference, stopped)
    assert len(fallbacks) == 1 and fallbacks[0].policy == "every-2", fallbacks
    assert stopped.checkpoints >= 2  # every-2 at steps 2, 4, 6

    # A checkpoint timeout: the host cools down, so the policy answers busy for a while.
    await asyncio.sleep(1.0)  # the stopped service catches up with its backlog
    decisions.clear()
    timed_out = await run(ac, "always", checkpoint_timeout_s=0.001)
    await nc.flush()
    assert any(d.busy_s > 0 and d.reason.startswith("busy") for d in decisions), [d.reason for d in decisions]
    assert same_trajectory(reference, timed_out)


def test_chaos_schedule_is_seeded_and_the_same_for_every_policy() -> None:
    """The draws depend on (seed, trajectory seed, step, attempt) only: two injectors with one seed
    give one schedule, whatever order the steps come in; another seed gives another."""

    def schedule(chaos_seed: int, order: list[tuple[int, int]]) -> dict[tuple[int, int, int], float | None]:
        kills = KillSchedule(chaos_seed, 0.3, 2.0)
        return {(t, step, kills.attempts[(t, step)] + 1): kills.next(t, step) for t, step in order}

    order = [(t, s) for t in (1, 2, 3) for s in range(1, 30)] * 2
    shuffled = order[:]
    random.Random(4).shuffle(shuffled)
    first, again = schedule(7, order), schedule(7, shuffled)
    assert first == again
    kills = [d for d in first.values() if d is not None]
    assert 0.15 < len(kills) / len(first) < 0.45 and all(0 <= d < 2.0 for d in kills)
    assert schedule(8, order) != first
