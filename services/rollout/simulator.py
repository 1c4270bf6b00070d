"""A discrete-event simulator of a rollout batch under sandbox failures: the figures of
`belayer bench env-recovery` at the paper's scale (64 prompts × 8 samples, up to 20 rounds),
driven by distributions measured in the real runs (LLM response times, action times, checkpoint
and restore costs), and deciding with the same arithmetic as the policy service
(services/policy/decision.py), its estimates learnt online in the order events happen.

A trajectory starts with its setup action, then alternates: an LLM turn of T seconds, during which the policy is consulted at
x = 0, Δ, 2Δ, ... and may start a checkpoint of c seconds (one in flight); then its action, which
waits for the checkpoint first (the visible part), and takes d seconds. Each step fails with
probability p, its kill landing u·D after the action starts (u uniform, D the stated step wall
time, as the chaos injector does): a kill inside the action is seen at once; a later one kills the
checkpoint in flight if it is still running and is seen when the next action starts. A failure
costs a restore (r) and everything since the latest ready checkpoint but the response to its own
context, which the driver keeps (agent.KeptResponse); or a restart from the base image (b) and
everything. Work done again takes what it took the first time: the scripted agent generates the
same tokens and runs the same actions. The batch ends with its last trajectory.

Contention: trajectories share machines, `machine_trajectories` to a machine, and a checkpoint
takes CPU from the responses generated on its machine. A response drawn as T lasts
T·(1 + κ·L), κ the measured slowdown (seconds a response loses per second of checkpoint beside
it, Measured.slowdown) and L the mean number of checkpoints that ran on its machine over the last
CONTENTION_LOOKBACK_S. The adaptive policy learns K from the simulated responses and checkpoints,
as the policy service does from real ones.

Engine load: a machine's engine shares its decode steps among the trajectories alive on it, so a
response generated while fewer are alive (a trajectory redoing its work after the others ended)
is faster. The real runs fit seconds per token as a + b·n, n the trajectories alive
(Measured.token_s_base, token_s_per_alive); a response sample measured with n₀ alive, drawn when
n are, lasts T·(a + b·n)/(a + b·n₀). n is counted when the response starts: trajectories that end
during it do not speed it up.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from belayer_rl.services.policy.decision import (
    CheckpointCost,
    Contention,
    FailureRate,
    Guards,
    Interval,
    Policy,
    ResponseTimes,
    Situation,
    decide,
    step_failure_probability,
)
from belayer_rl.services.rollout.workloads import seeded


@dataclass(frozen=True)
class Measured:
    """Samples of each duration, in seconds, from real runs."""

    response_s: Sequence[float]
    action_s: Sequence[float]
    checkpoint_s: Sequence[float]
    restore_s: Sequence[float]
    base_restart_s: Sequence[float]
    step_wall_s: float = 0.0  # D of the chaos injector: the failure-free runs' mean step (0: unknown)
    slowdown: float = 0.0  # κ: seconds a response loses per second of checkpoint beside it
    # Engine load (none when token_s_per_alive is 0): each response sample's trajectories alive
    # when it started, and seconds per token = token_s_base + token_s_per_alive · alive.
    response_alive: Sequence[int] = ()
    token_s_base: float = 0.0
    token_s_per_alive: float = 0.0

    def __post_init__(self) -> None:
        for name in ("response_s", "action_s", "checkpoint_s", "restore_s", "base_restart_s"):
            if not getattr(self, name):
                raise ValueError(f"no samples of {name}")
        if not (self.slowdown >= 0 and math.isfinite(self.slowdown)):
            raise ValueError(f"slowdown must be a finite number >= 0, got {self.slowdown}")
        if self.token_s_per_alive:
            if not (self.token_s_per_alive > 0 and self.token_s_base >= 0):
                raise ValueError(
                    f"engine load must be a >= 0 and b > 0, got {self.token_s_base}, {self.token_s_per_alive}"
                )
            if len(self.response_alive) != len(self.response_s) or min(self.response_alive) < 1:
                raise ValueError("response_alive needs a count >= 1 for every response sample")

    def response(self, index: int, alive: int) -> float:
        """Response sample `index`, generated with `alive` trajectories on its engine."""
        seconds = self.response_s[index]
        if not self.token_s_per_alive:
            return seconds
        measured_at = self.response_alive[index]
        return seconds * self.token_s(alive) / self.token_s(measured_at)

    def token_s(self, alive: int) -> float:
        return self.token_s_base + self.token_s_per_alive * alive


@dataclass(frozen=True)
class SimConfig:
    policy: str
    p_per_step: float
    trajectories: int = 512  # 64 prompts × 8 samples
    turns: int = 20  # LLM turns (rounds); a trajectory's actions are its setup and one per turn
    seed: int = 0
    consult_every_s: float = 1.0
    step_wall_s: float = 0.0  # D; 0: the mean of a response and an action
    max_recoveries: int = 50  # per trajectory, the driver's default bound: past it the trajectory gives up
    machine_trajectories: int = 0  # trajectories sharing a machine's CPUs; 0: all of them
    guards: Guards = Guards()  # the adaptive policy's, as the policy service's --min-step and --min-env-work


@dataclass
class SimResult:
    policy: str
    p_per_step: float
    wall_s: float  # the batch's rollout time: its last trajectory's end
    mean_trajectory_s: float
    failures: int
    recoveries_from_checkpoint: int
    restarts_from_base: int
    checkpoints: int
    checkpoint_s: float
    exposed_checkpoint_s: float
    gave_up: int = 0  # trajectories past max_recoveries

    @property
    def hidden_fraction(self) -> float:
        return 1.0 - self.exposed_checkpoint_s / self.checkpoint_s if self.checkpoint_s > 0 else 1.0


@dataclass
class SimTrajectory:
    index: int
    k: int = 0  # actions completed
    ready_k: int = -1
    ready_at_work: float = 0.0  # work a recovery keeps: up to the ready checkpoint, and its response
    work: float = 0.0  # LLM and environment seconds of the current prefix
    env_work: float = 0.0
    ready_env_work: float = 0.0
    last_action_s: float = 0.0
    attempts: dict[int, int] = field(default_factory=dict)
    kill_pending_at: float | None = None  # a kill past its action, seen at the next action
    failures: int = 0


CONTENTION_LOOKBACK_S = 10.0


class MachineLoad:
    """The checkpoints that ran on one machine, for the mean number running over a past window."""

    def __init__(self) -> None:
        self.checkpoints: list[Interval] = []

    def add(self, start: float, end: float) -> None:
        self.checkpoints.append(Interval(start, end))

    def before(self, now: float) -> float:
        """L: the mean number of checkpoints running over [now - CONTENTION_LOOKBACK_S, now]."""
        window = Interval(now - CONTENTION_LOOKBACK_S, now)
        self.checkpoints = [c for c in self.checkpoints if c.end > window.start]
        return sum(window.overlap(c) for c in self.checkpoints) / CONTENTION_LOOKBACK_S


def draw(samples: Sequence[float], *key: object) -> float:
    return samples[pick(len(samples), *key)]


def pick(n: int, *key: object) -> int:
    return seeded(*key).randrange(n)


def simulate(config: SimConfig, measured: Measured) -> SimResult:
    policy = Policy.parse(config.policy)
    rate = FailureRate()
    responses = ResponseTimes()
    cost = CheckpointCost(statistics.median(measured.checkpoint_s))
    # Only the adaptive policy weighs contention; the others need not learn it.
    contention = Contention() if policy.kind == "adaptive" else Contention(fixed=0.0)
    per_machine = config.machine_trajectories or config.trajectories
    machines = [MachineLoad() for _ in range(-(-config.trajectories // per_machine))]
    # Trajectories alive per machine, for the engine load: each machine's share, less those ended.
    alive = [min(per_machine, config.trajectories - m * per_machine) for m in range(len(machines))]
    step_wall = (
        config.step_wall_s
        or measured.step_wall_s
        or (statistics.fmean(measured.response_s) + statistics.fmean(measured.action_s))
    )
    result = SimResult(config.policy, config.p_per_step, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0)
    ends: list[float] = []
    actions = config.turns + 1  # the setup action first, then a turn and an action per round
    # (time, tie-breaker, trajectory): each trajectory's next step, in time order, so the shared
    # estimates learn in the order the events happen.
    queue = [(0.0, i, SimTrajectory(i)) for i in range(config.trajectories)]
    heapq.heapify(queue)
    seed = config.seed

    def fail(t: SimTrajectory, seen_at: float, attempt: int) -> None:
        rate.observe(0.0, failed=True)
        heapq.heappush(queue, (recover(t, result, measured, config, seen_at, attempt), t.index, t))

    while queue:
        now, _, t = heapq.heappop(queue)
        if t.k >= actions or t.failures > config.max_recoveries:
            result.gave_up += t.k < actions
            ends.append(now)
            alive[t.index // per_machine] -= 1
            continue
        # The LLM turn that follows k actions (none before the setup, none for the response a
        # recovery to checkpoint k keeps), and the consults while it runs.
        turn = t.attempts.get(t.k, 0)
        on = t.index // per_machine  # its machine
        machine = machines[on]
        generated = t.k > 0 and t.k != t.ready_k
        sample = pick(len(measured.response_s), "T", seed, t.index, t.k)
        undisturbed = measured.response(sample, alive[on]) if generated else 0.0
        response = undisturbed * (1.0 + measured.slowdown * machine.before(now))
        checkpoint_start = checkpoint_end = None
        if generated:  # the base image (k = 0) needs no checkpoint
            x = 0.0
            while x < response:
                verdict = decide(
                    policy,
                    Situation(
                        step=t.k,
                        exposure_s=t.work - t.ready_at_work + x + responses.expected_rest(x),
                        env_work_s=t.env_work - t.ready_env_work,
                        elapsed_s=x,
                    ),
                    p=step_failure_probability(rate.per_second, t.last_action_s),
                    responses=responses,
                    cost_s=cost.seconds,
                    contention=contention.per_checkpoint_second,
                    guards=config.guards,
                )
                if verdict.checkpoint:
                    checkpoint_start = now + x
                    checkpoint_end = checkpoint_start + draw(
                        measured.checkpoint_s, "c", seed, t.index, t.k, turn
                    )
                    machine.add(checkpoint_start, checkpoint_end)
                    break
                x += config.consult_every_s
        if generated:
            responses.add(response)
            contention.add_response(now + response, response, undisturbed)
        turn_end = now + response
        action_start = max(turn_end, checkpoint_end or 0.0)
        # A kill from the previous step that landed before this action: it killed the checkpoint
        # if that was still running, and the failure is seen when this action would start.
        pending, t.kill_pending_at = t.kill_pending_at, None
        if pending is not None and pending < action_start:
            seen_at = turn_end
            if checkpoint_start is not None and checkpoint_end is not None:
                if checkpoint_end <= pending:  # it made it: the recovery restores it
                    ready(t, result, cost, contention, checkpoint_start, checkpoint_end, turn_end, response)
                    seen_at = max(turn_end, checkpoint_end)
                else:
                    failed_at = max(pending, checkpoint_start)
                    result.checkpoint_s += failed_at - checkpoint_start
                    result.exposed_checkpoint_s += max(0.0, failed_at - turn_end)
                    seen_at = max(turn_end, failed_at)
            fail(t, seen_at, turn)
            continue
        if checkpoint_start is not None and checkpoint_end is not None:
            ready(t, result, cost, contention, checkpoint_start, checkpoint_end, turn_end, response)
        t.work += response
        # The action, and whether its step fails: its own kill, or a later one still pending.
        step = t.k + 1
        attempt = t.attempts.get(step, 0)
        t.attempts[step] = attempt + 1
        action = draw(measured.action_s, "d", seed, t.index, step)
        kill = seeded("kill", seed, t.index, step, attempt)
        fails, u = kill.random() < config.p_per_step, kill.random()
        kills = [k for k in (pending, action_start + u * step_wall if fails else None) if k is not None]
        first = min(kills, default=None)
        if first is not None and first < action_start + action:  # inside the action: seen at once
            rate.observe(first - action_start, failed=False)
            fail(t, first, attempt)
            continue
        rate.observe(action, failed=False)
        t.kill_pending_at = first
        t.k = step
        t.work += action
        t.env_work += action
        t.last_action_s = action
        heapq.heappush(queue, (action_start + action, t.index, t))
    result.wall_s = max(ends, default=0.0)
    result.mean_trajectory_s = statistics.fmean(ends) if ends else 0.0
    return result


def ready(
    t: SimTrajectory,
    result: SimResult,
    cost: CheckpointCost,
    contention: Contention,
    start: float,
    end: float,
    turn_end: float,
    response: float,
) -> None:
    """Checkpoint k is ready; the response generated beside it answered its L_k, so a recovery to
    it keeps that response as well."""
    result.checkpoints += 1
    result.checkpoint_s += end - start
    result.exposed_checkpoint_s += max(0.0, end - turn_end)
    cost.add(end - start)
    contention.add_checkpoint(end, end - start)
    t.ready_k = t.k
    t.ready_at_work = t.work + response
    t.ready_env_work = t.env_work


def recover(
    t: SimTrajectory, result: SimResult, measured: Measured, config: SimConfig, seen_at: float, attempt: int
) -> float:
    """A failure seen at `seen_at`: back to the latest ready checkpoint, or to the base image.
    Returns when the trajectory goes on (at once past max_recoveries: it gives up there)."""
    result.failures += 1
    t.failures += 1
    if t.failures > config.max_recoveries:
        return seen_at
    if t.ready_k >= 0:
        result.recoveries_from_checkpoint += 1
        t.k, t.work, t.env_work = t.ready_k, t.ready_at_work, t.ready_env_work
        return seen_at + draw(measured.restore_s, "r", config.seed, t.index, t.k, attempt, result.failures)
    result.restarts_from_base += 1
    t.k, t.work, t.env_work = 0, 0.0, 0.0
    return seen_at + draw(measured.base_restart_s, "b", config.seed, t.index, attempt, result.failures)
