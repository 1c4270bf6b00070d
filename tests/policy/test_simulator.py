"""The rollout simulator (services/rollout/simulator.py) on cases worked out by hand: constant
durations, so every figure has one right value; then properties that any answer must keep.
Fast: pure Python, no cluster."""

from __future__ import annotations

import dataclasses

import pytest

from belayer_rl.services.policy.decision import Guards, decide
from belayer_rl.services.rollout import simulator
from belayer_rl.services.rollout.simulator import Measured, SimConfig, SimResult, simulate


def constant(response: float = 2.0, action: float = 1.0, checkpoint: float = 0.5) -> Measured:
    return Measured(
        response_s=[response],
        action_s=[action],
        checkpoint_s=[checkpoint],
        restore_s=[0.3],
        base_restart_s=[0.2],
    )


def test_failure_free_without_checkpoints_is_the_sum_of_the_steps() -> None:
    result = simulate(SimConfig("never", 0.0, trajectories=3, turns=5), constant())
    assert result.wall_s == pytest.approx(1.0 + 5 * (2.0 + 1.0))  # the setup action, then 5 rounds
    assert result.failures == 0 and result.checkpoints == 0 and result.hidden_fraction == 1.0


def test_a_checkpoint_shorter_than_the_response_is_hidden_a_longer_one_shows() -> None:
    hidden = simulate(SimConfig("always", 0.0, trajectories=1, turns=5), constant(checkpoint=0.5))
    # Boundaries 1..5, before each turn, are checkpointed (k = 0, the base image, is not): 5 × 0.5 s,
    # none of it visible.
    assert hidden.checkpoints == 5 and hidden.checkpoint_s == pytest.approx(2.5)
    assert hidden.exposed_checkpoint_s == 0.0 and hidden.wall_s == pytest.approx(16.0)
    shown = simulate(SimConfig("always", 0.0, trajectories=1, turns=5), constant(checkpoint=3.0))
    assert shown.exposed_checkpoint_s == pytest.approx(5 * 1.0)  # 3-s checkpoints behind 2-s responses
    assert shown.wall_s == pytest.approx(16.0 + 5.0)
    assert shown.hidden_fraction == pytest.approx(1 - 5 / 15)
    every = simulate(SimConfig("every-2", 0.0, trajectories=1, turns=5), constant())
    assert every.checkpoints == 2  # boundaries 2 and 4


def test_failures_cost_more_without_checkpoints_and_the_batch_still_ends() -> None:
    measured = constant()
    for p in (0.05, 0.2):
        never = simulate(SimConfig("never", p, trajectories=64, turns=10, seed=3), measured)
        always = simulate(SimConfig("always", p, trajectories=64, turns=10, seed=3), measured)
        assert never.failures > 0 and always.failures > 0
        # Every failure restarts from the base image, but one past a trajectory's bound (it gives up).
        assert (
            never.restarts_from_base == never.failures - never.gave_up
            and always.recoveries_from_checkpoint > 0
        )
        assert never.mean_trajectory_s > always.mean_trajectory_s
    # Every action fails (each kill lands inside its action): each trajectory stops at its bound.
    certain = simulate(
        SimConfig("always", 1.0, trajectories=2, turns=3, step_wall_s=0.5, max_recoveries=5), measured
    )
    assert certain.gave_up == 2 and certain.failures == 2 * 6


def test_a_recovery_keeps_the_response_to_its_checkpoints_context() -> None:
    # Every kill lands as its action starts (D ≈ 0): a failure loses none of the action's work.
    def batch(policy: str, seed: int) -> SimResult:
        config = SimConfig(policy, 0.3, trajectories=1, turns=5, step_wall_s=1e-9, seed=seed)
        return simulate(config, constant())

    # `always`: a failure at step s ≥ 2 restores checkpoint s - 1, which was taken beside the
    # response that answered L_(s-1). That response is kept, so the failure costs the restore,
    # 0.3 s, then the action again. At step 1 (no checkpoint yet) it costs the base restart, 0.2 s.
    always = [batch("always", seed) for seed in range(20)]
    assert sum(r.recoveries_from_checkpoint for r in always) >= 10
    for r in always:
        assert r.wall_s == pytest.approx(
            16.0 + 0.3 * r.recoveries_from_checkpoint + 0.2 * r.restarts_from_base
        )
    # `every-2` (boundaries 2 and 4), one failure, restored from a checkpoint: at step 3 or 5 it
    # costs the restore; at step 4 or 6 the restore, an action and a response done again (the one
    # that answered the boundary after the checkpoint's).
    lone = [
        r
        for r in (batch("every-2", seed) for seed in range(60))
        if r.failures == r.recoveries_from_checkpoint == 1
    ]
    assert {round(r.wall_s - 16.0, 6) for r in lone} == {0.3, 0.3 + 1.0 + 2.0}


def test_the_same_seed_gives_the_same_batch() -> None:
    measured = Measured(
        response_s=[1.0, 2.0, 3.5],
        action_s=[0.2, 0.4],
        checkpoint_s=[0.3, 0.6],
        restore_s=[0.5],
        base_restart_s=[0.2],
    )
    a = simulate(SimConfig("adaptive", 0.05, trajectories=32, turns=8, seed=9), measured)
    b = simulate(SimConfig("adaptive", 0.05, trajectories=32, turns=8, seed=9), measured)
    c = simulate(SimConfig("adaptive", 0.05, trajectories=32, turns=8, seed=10), measured)
    assert a == b and a != c


def test_checkpoints_slow_the_responses_on_their_machine() -> None:
    slowed = Measured(**{**constant().__dict__, "slowdown": 1.0})
    # One trajectory, a 0.5 s checkpoint at the start of every response from boundary 1. Each
    # response is slowed by κ = 1 times the checkpoints' mean number over the 10 s before it starts:
    # 0, 0.05, 0.1, 0.15 and 0.15 (the first checkpoint has left the window): 2.0, 2.1, 2.2, 2.3, 2.3 s.
    always = simulate(SimConfig("always", 0.0, trajectories=1, turns=5), slowed)
    assert always.wall_s == pytest.approx(16.0 + 0.1 + 0.2 + 0.3 + 0.3)
    # No checkpoint, no contention.
    assert simulate(SimConfig("never", 0.0, trajectories=1, turns=5), slowed).wall_s == pytest.approx(16.0)
    # A machine of its own for each trajectory: another's checkpoints do not slow it.
    apart = simulate(SimConfig("always", 0.0, trajectories=2, turns=5, machine_trajectories=1), slowed)
    together = simulate(SimConfig("always", 0.0, trajectories=2, turns=5), slowed)
    assert apart.wall_s == pytest.approx(always.wall_s) and together.wall_s > apart.wall_s


def test_a_response_takes_the_engine_share_of_the_trajectories_alive_on_its_machine() -> None:
    # Seconds per token = 0 + 1·alive, and the one response sample, 2.0 s, was measured with two
    # trajectories alive: with two alive it lasts 2.0 s, with one 1.0 s.
    loaded = Measured(**{**constant().__dict__, "response_alive": [2], "token_s_per_alive": 1.0})
    together = simulate(SimConfig("never", 0.0, trajectories=2, turns=3), loaded)
    assert together.wall_s == pytest.approx(1.0 + 3 * (2.0 + 1.0))
    apart = simulate(SimConfig("never", 0.0, trajectories=2, turns=3, machine_trajectories=1), loaded)
    assert apart.wall_s == pytest.approx(1.0 + 3 * (1.0 + 1.0))
    # Three trajectories, two to a machine: the last machine holds one, which generates alone.
    uneven = simulate(SimConfig("never", 0.0, trajectories=3, turns=3, machine_trajectories=2), loaded)
    assert uneven.wall_s == pytest.approx(10.0)
    assert uneven.mean_trajectory_s == pytest.approx((10.0 + 10.0 + 7.0) / 3)
    # Measured with one alive, generated beside another: twice as long.
    alone = Measured(**{**loaded.__dict__, "response_alive": [1]})
    assert simulate(SimConfig("never", 0.0, trajectories=2, turns=3), alone).wall_s == pytest.approx(
        1.0 + 3 * (4.0 + 1.0)
    )
    # A trajectory that redoes its work after the others ended generates it faster. With the
    # samples measured at full load, the load model never lengthens a batch, and it shortens
    # those whose last trajectory ran on after another ended.
    plain = constant()
    loaded_full = Measured(**{**plain.__dict__, "response_alive": [4], "token_s_per_alive": 1.0})
    shorter = 0
    for seed in range(10):
        # Each kill lands as its action starts, so the same steps fail whatever the timing.
        config = SimConfig("never", 0.2, trajectories=4, turns=6, seed=seed, step_wall_s=1e-9)
        with_load, without = simulate(config, loaded_full), simulate(config, plain)
        assert with_load.failures == without.failures and with_load.wall_s <= without.wall_s + 1e-9
        shorter += with_load.wall_s < without.wall_s - 1e-9
    assert shorter >= 5


def test_measured_refuses_an_engine_load_it_cannot_apply() -> None:
    with pytest.raises(ValueError, match="a count >= 1 for every response sample"):
        Measured(**{**constant().__dict__, "token_s_per_alive": 1.0})
    with pytest.raises(ValueError, match="engine load"):
        Measured(**{**constant().__dict__, "response_alive": [1], "token_s_per_alive": -1.0})


def test_the_adaptive_policy_learns_the_contention_and_checkpoints_less() -> None:
    def measured(slowdown: float) -> Measured:
        return Measured(
            response_s=[1.0, 2.0, 3.0, 4.0, 6.0],
            action_s=[0.3, 0.5],
            checkpoint_s=[0.4, 0.8],
            restore_s=[0.5],
            base_restart_s=[0.3],
            slowdown=slowdown,
        )

    config = SimConfig("adaptive", 0.05, trajectories=16, turns=12, seed=4)
    free, contended = simulate(config, measured(0.0)), simulate(config, measured(1.0))
    assert 0 < contended.checkpoints < free.checkpoints


def test_the_adaptive_policy_keeps_the_guards_it_is_given() -> None:
    config = SimConfig("adaptive", 0.05, trajectories=8, turns=8, seed=2)
    assert simulate(config, constant()).checkpoints > 0
    # No checkpoint before step 9 of 9 actions: none at all, for the adaptive policy only.
    late = Guards(min_step=9)
    assert simulate(dataclasses.replace(config, guards=late), constant()).checkpoints == 0
    always = dataclasses.replace(config, policy="always", guards=late)
    assert simulate(always, constant()).checkpoints > 0


def test_c_is_the_work_a_failure_would_make_the_trajectory_redo(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, float]] = []

    def recording(policy, situation, **kwargs):  # type: ignore[no-untyped-def]
        asked.append((situation.step, situation.exposure_s))
        return decide(policy, situation, **kwargs)

    monkeypatch.setattr(simulator, "decide", recording)
    simulate(SimConfig("every-2", 0.0, trajectories=1, turns=5), constant())
    # Consults at x = 0 and 1 s of each 2-s response, until a checkpoint starts (boundaries 2, 4).
    # C = the work since the ready checkpoint, less the response to its own context (kept by a
    # recovery), plus the running response: x until 3 samples are known, then E[T | T > x] = 2 s.
    # Sums of whole and half seconds: exact in binary, so compared exactly.
    assert asked == [
        (1, 1.0),  # the setup action, then x
        (1, 2.0),
        (2, 4.0),  # setup, response 1, action 2: checkpoint 2
        (3, 1.0),  # action 3 (response 2 is kept with checkpoint 2)
        (3, 2.0),
        (4, 1.0 + 2.0 + 1.0 + 2.0),  # action 3, response 3, action 4, response 4 expected whole
        (5, 1.0 + 2.0),  # action 5 and response 5 expected whole, at x = 0 and at x = 1
        (5, 1.0 + 2.0),
    ]
