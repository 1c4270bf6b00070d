"""The arithmetic of `belayer bench train-recovery`'s local cost: where its faults go, and what a
fault's window charges, a reschedule's steps done again included."""

from __future__ import annotations

import itertools

import pytest

from belayer_rl.cli.bench_train_recovery import (
    FAULT_SPACING,
    LOCAL_AFTER,
    LOCAL_BEFORE,
    LOCAL_EARLY,
    Run,
    fault_steps,
    local_cost,
)
from belayer_rl.shared.protocol import TrainerStep


def step_event(step: int) -> TrainerStep:
    return TrainerStep(
        run="bench", step=step, weight_version="v1", generated_with=["v1"], reward_mean=0.0, loss=0.0,
        kl=0.0, clipped_fraction=0.0, samples=1, response_tokens=1, tokens_per_s=1.0, resumes=0,
        rollout_s=0.0, update_s=0.0, publish_s=0.0,
    )  # fmt: skip


def run_of(numbers: list[int], seconds: dict[int, float]) -> Run:
    """A run whose steps end in the order `numbers`, each taking 1 s unless `seconds` says (by its
    position in `numbers`)."""
    durations = [seconds.get(i, 1.0) for i in range(len(numbers))]
    marks = list(itertools.accumulate(durations))
    return Run(wall=marks[-1], seen=[], marks=marks, steps=[step_event(n) for n in numbers])


@pytest.mark.parametrize("steps", [10, 2 * FAULT_SPACING - 1, 2 * FAULT_SPACING, 677, 5000])
def test_faults_are_spaced_so_that_no_window_holds_another(steps: int) -> None:
    at = fault_steps(steps, wanted=5)
    assert 1 <= len(at) <= 5
    if len(at) == 1 and steps < 2 * FAULT_SPACING:
        assert at == [steps // 2]  # too short to space: one fault, half way
        return
    window_starts = [fault + 1 - LOCAL_EARLY - LOCAL_BEFORE for fault in at]
    window_ends = [fault + 1 + LOCAL_AFTER for fault in at]
    assert window_starts[0] >= 1 and window_ends[-1] <= steps
    for previous_end, next_start in zip(window_ends, window_starts[1:], strict=False):
        assert next_start > previous_end, (at, previous_end, next_start)


def test_a_slow_step_and_the_steps_done_again_are_charged_once_each() -> None:
    steps, fault = 400, 200
    # Steps 1..205 at 1 s, then a reschedule back to the checkpoint of step 200: steps 201..205
    # again, the first of them 4 s longer (the restart), then on to the end.
    numbers = list(range(1, 206)) + list(range(201, steps + 1))
    restart_at = 205  # position of the second step 201
    run = run_of(numbers, {restart_at: 5.0})
    # Charged: the restart's 4 s and the 5 steps done again. (Mutation check, run: a window taken
    # by position, not by step number, charges 4 s: the steps done again go uncounted.)
    assert local_cost(run, fault) == pytest.approx(4.0 + 5.0)
    assert local_cost(run_of(list(range(1, steps + 1)), {}), fault) == pytest.approx(0.0)


def test_the_pace_is_the_median_of_the_steps_before_the_window() -> None:
    fault = 200
    numbers = list(range(1, 400))
    # Steps before the window at 2 s (with one outlier the median ignores), the window's at 3 s.
    first = fault + 1 - LOCAL_EARLY
    seconds = {i: 2.0 for i in range(len(numbers))}
    seconds[first - 10] = 60.0
    for i in range(first - 1, fault + LOCAL_AFTER + 1):
        seconds[i] = 3.0
    window = LOCAL_EARLY + 1 + LOCAL_AFTER
    assert local_cost(run_of(numbers, seconds), fault) == pytest.approx(window * 1.0)
