"""The arithmetic of `belayer bench env-recovery` (cli/bench_env_recovery.py) on hand-made
timelines: what it hands the simulator, the responses it fits the slowdown on, its validation
verdict, and its refusal of a baseline that broke. Fast: no cluster."""

from __future__ import annotations

import pytest

from belayer_rl.cli.bench_env_recovery import (
    fit_engine_load,
    loaded_turns,
    measure,
    measure_batches,
    read_batches,
    refuse_broken,
    timed_responses,
    validation,
)
from belayer_rl.services.rollout.agent import TimelineEntry, TrajectoryResult
from belayer_rl.services.rollout.driver import write_results


def trajectory(
    timeline: list[TimelineEntry], status: str = "done", error: str = "", name: str = "t"
) -> TrajectoryResult:
    return TrajectoryResult(
        trajectory=name,
        task="shell-0",
        status=status,  # type: ignore[arg-type]
        reward=0.0,
        error=error,
        scripted=True,
        actions=[],
        observations=[],
        context_tokens=[],
        prompt_len=0,
        loss_mask=[],
        turns=0,
        failures=0,
        recoveries=0,
        restores_from_base=0,
        checkpoints=0,
        checkpoint_s=0.0,
        exposed_checkpoint_s=0.0,
        fallback_decisions=0,
        wall_s=0.0,
        timeline=timeline,
    )


def entry(kind: str, start: float, end: float, detail: str = "", tokens: int = 0) -> TimelineEntry:
    return TimelineEntry(kind=kind, start_s=start, end_s=end, step=1, detail=detail, tokens=tokens)  # type: ignore[arg-type]


def test_responses_carry_the_checkpoint_seconds_beside_them_from_any_trajectory() -> None:
    a = trajectory([entry("turn", 0.0, 4.0, tokens=100), entry("checkpoint", 3.0, 5.0)])
    b = trajectory(
        [
            entry("checkpoint-failed", 1.0, 2.0),  # a failed checkpoint took CPU too
            entry("turn", 4.5, 6.0, tokens=50),
            entry("turn", 6.0, 6.5, "failed (attempt 1)"),  # no tokens: no sample of a response
        ]
    )
    responses = timed_responses([a, b])
    assert [(r.work, r.beside_s) for r in responses] == [(100, 1.0 + 1.0), (50, 0.5)]


def test_the_simulator_gets_failure_free_responses_and_every_batchs_other_durations() -> None:
    ff = trajectory([entry("turn", 0.0, 3.0, tokens=90), entry("action", 3.0, 3.5)])
    chaos = trajectory(
        [
            entry("turn", 0.0, 9.0, tokens=90),  # slowed beside checkpoints: not a sample of T
            entry("checkpoint", 0.0, 1.2),
            entry("checkpoint", 2.0, 2.4, "failed after"),  # not a completed checkpoint
            entry("action", 9.0, 9.4),
            entry("recovery", 10.0, 10.8, "from checkpoint k=3, keeping its response (env-failure)"),
            entry("recovery", 12.0, 12.5, "from the base image (env-failure)"),
        ]
    )
    measured = measure([[ff], [chaos]], [[ff]], step_wall_s=4.0, slowdown=0.0)
    assert measured.response_s == [3.0]
    assert measured.action_s == pytest.approx([0.5, 0.4])
    assert measured.checkpoint_s == pytest.approx([1.2])
    assert measured.restore_s == pytest.approx([0.8]) and measured.base_restart_s == pytest.approx([0.5])
    # No recovery at all: each kind borrows its nearest kin rather than leave the simulator empty.
    quiet = measure([[ff], [trajectory([entry("checkpoint", 0.0, 1.0)])]], [[ff]], 4.0, 0.0)
    assert quiet.restore_s == quiet.base_restart_s == [1.0]
    with pytest.raises(SystemExit, match="no checkpoint completed"):
        measure([[ff]], [[ff]], 4.0, 0.0)


def failure_free_pair() -> list[TrajectoryResult]:
    """Two trajectories: A lives 0-10 s, B 1-4 s. A's responses start with two alive (at 1.0 s)
    and with one (at 5.0 s); B's with two. Seconds per token: 0.02 with two alive, 0.01 with one."""
    a = trajectory(
        [
            entry("action", 0.0, 1.0),
            entry("turn", 1.0, 3.0, tokens=100),
            entry("checkpoint", 3.0, 3.5),
            entry("turn", 5.0, 6.0, tokens=100),
            entry("turn", 6.0, 6.2, "failed (attempt 1)"),
            entry("action", 6.2, 10.0),
        ],
        name="s0-ff-a",
    )
    b = trajectory(
        [entry("action", 1.0, 2.0), entry("turn", 2.0, 3.0, tokens=50), entry("action", 3.0, 4.0)],
        name="s0-ff-b",
    )
    return [a, b]


def test_responses_carry_the_trajectories_alive_and_the_engine_load_fits_them() -> None:
    batch = failure_free_pair()
    assert [(e.start_s, alive) for e, alive in loaded_turns(batch)] == [(1.0, 2), (5.0, 1), (2.0, 2)]
    base, per_alive = fit_engine_load(loaded_turns(batch))
    assert base == pytest.approx(0.0, abs=1e-12) and per_alive == pytest.approx(0.01)
    measured = measure([batch], [batch], 4.0, 0.0)
    assert measured.response_s == [2.0, 1.0, 1.0] and measured.response_alive == [2, 1, 2]
    # One count alone, or a load that falls as trajectories are added, is no load to model.
    assert fit_engine_load(loaded_turns(batch)[:1]) == (0.0, 0.0)
    lighter = [(e, 3 - alive) for e, alive in loaded_turns(batch)]
    assert fit_engine_load(lighter) == (0.0, 0.0)
    # 0.03 s/token with one alive, 0.05 with two: a = 0.01, b = 0.02.
    shared = [(entry("turn", 0.0, 3.0, tokens=100), 1), (entry("turn", 0.0, 5.0, tokens=100), 2)]
    assert fit_engine_load(shared) == pytest.approx((0.01, 0.02))
    # 0.01 and 0.05: a would be -0.03, so the fit goes through the origin, b = Σn·s / Σn².
    steep = [(entry("turn", 0.0, 1.0, tokens=100), 1), (entry("turn", 0.0, 5.0, tokens=100), 2)]
    assert fit_engine_load(steep) == pytest.approx((0.0, (0.01 + 2 * 0.05) / 5))


def test_the_simulator_measures_the_same_from_the_timelines_written_to_out(tmp_path) -> None:
    ff = failure_free_pair()
    chaos = [
        trajectory(
            [
                entry("action", 0.0, 1.0),
                entry("turn", 1.0, 4.0, tokens=100),
                entry("checkpoint", 1.0, 1.5),
                entry("action", 4.0, 5.0),
            ],
            name="s0-always-0_01-a",
        )
    ]
    write_results(tmp_path / "s0-ff", ff)
    write_results(tmp_path / "s0-always-0_01", chaos)
    batches = read_batches(tmp_path)
    assert list(batches) == ["s0-always-0_01", "s0-ff"] and batches["s0-ff"] == ff
    _, measured = measure_batches(batches)
    assert measured == measure([chaos, ff], [ff], step_wall_s=(6.2 + 2.0) / 2, slowdown=0.0)
    # In the order the real runs hold them (the failure-free batch first), the same samples in the
    # same places: the simulator draws by place.
    assert measure_batches({"s0-ff": ff, "s0-always-0_01": chaos})[1] == measured
    with pytest.raises(SystemExit, match="no failure-free batch"):
        read_batches(tmp_path / "s0-always-0_01")


def test_validation_needs_every_simulated_median_within_the_real_range() -> None:
    real = {
        "0.01/always": {"added": {"median": 0.02, "min": -0.1, "max": 0.2}},
        "0.01/never": {"added": {"median": 0.05, "min": 0.0, "max": 0.1}},
    }
    inside = {"0.01/always": {"added": {"median": 0.15}}, "0.01/never": {"added": {"median": 0.1}}}
    outside = {"0.01/always": {"added": {"median": 0.15}}, "0.01/never": {"added": {"median": 0.11}}}
    assert validation(real, inside)["validated"] is True
    verdict = validation(real, outside)
    assert verdict["validated"] is False
    assert verdict["cells"]["0.01/never"]["within"] is False and verdict["cells"]["0.01/always"]["within"]
    # A simulation of fewer cells (--policies always) validates those it has.
    fewer = validation(real, {"0.01/always": {"added": {"median": 0.15}}})
    assert list(fewer["cells"]) == ["0.01/always"] and fewer["validated"] is True


def test_a_baseline_with_an_infrastructure_error_stops_the_bench_naming_it() -> None:
    fine = trajectory([])
    refuse_broken("s0-ff", [fine, fine])
    broken = trajectory([], status="infra-error", error="no sandbox: no-image: belayer-sandbox:test")
    with pytest.raises(SystemExit, match=r"1 of 2 trajectories of batch s0-ff.*no-image"):
        refuse_broken("s0-ff", [fine, broken])
