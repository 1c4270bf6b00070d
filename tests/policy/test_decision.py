"""The checkpoint decision's arithmetic (services/policy/decision.py) and `belayer policy explain`.

The expected visible cost is checked against its definition, the integral of 1 - q(x; u) over
[0, c], computed by brute force over the same samples; a wrong formula (the unconditional
expectation, which forgets T > x) must fail that comparison. Bad inputs (NaN, infinities,
negatives, no samples, c = 0, λ = 0) must each give a decision, never an exception.
"""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from belayer_rl.services.policy.decision import (
    MAX_CONTENTION,
    MIN_CONTENTION_SAMPLES,
    CheckpointCost,
    Contention,
    FailureRate,
    Guards,
    Policy,
    ResponseTimes,
    Situation,
    decide,
    fit_slowdown,
    step_failure_probability,
)
from belayer_rl.services.policy.wire import situation_of
from belayer_rl.shared.protocol import PolicyDecide
from tests.cli.helpers import belayer

seconds = st.floats(min_value=0.0, max_value=50.0, allow_nan=False)
samples = st.lists(seconds, min_size=3, max_size=40)
any_float = st.floats(allow_nan=True, allow_infinity=True)


def integral_of_one_minus_q(times: list[float], x: float, c: float, steps: int = 4000) -> float:
    """∫₀^c (1 - q(x; u)) du by the midpoint rule, q counted sample by sample."""
    beyond = [t for t in times if t > x]
    du = c / steps
    total = 0.0
    for i in range(steps):
        u = (i + 0.5) * du
        q = sum(1 for t in beyond if t > x + u) / len(beyond)
        total += (1 - q) * du
    return total


def unconditional_cost(times: list[float], x: float, c: float) -> float:
    """A wrong answer on purpose: E[max(c - (T - x), 0)] over every sample, forgetting T > x."""
    return sum(min(max(c - (t - x), 0.0), c) for t in times) / len(times)


@settings(max_examples=60, deadline=None)
@given(times=samples, x=seconds, c=st.floats(min_value=0.01, max_value=20.0))
def test_expected_visible_cost_is_the_integral_of_one_minus_q(times: list[float], x: float, c: float) -> None:
    responses = ResponseTimes.of(times)
    if not [t for t in times if t > x]:
        assert responses.expected_visible_cost(x, c) == c  # nothing known to hide it
        return
    exact = responses.expected_visible_cost(x, c)
    assert exact == pytest.approx(integral_of_one_minus_q(times, x, c), abs=c * 2e-3 + 1e-9)
    assert 0.0 <= exact <= c


def test_the_integral_check_catches_the_unconditional_expectation() -> None:
    """Mutation check: the test above would fail a formula that forgets the conditioning."""
    times, x, c = [0.5, 1.0, 4.0, 6.0], 2.0, 3.0
    truth = integral_of_one_minus_q(times, x, c)
    assert ResponseTimes.of(times).expected_visible_cost(x, c) == pytest.approx(truth, abs=1e-2)
    assert unconditional_cost(times, x, c) != pytest.approx(truth, abs=1e-2)


def test_hand_worked_example() -> None:
    # Samples 2, 4, 6 s, waited 1 s, c = 2 s: every response outlasts x + c except none; the
    # 2-s response leaves 1 s, so it hides 1 s of the 2: visible (1 + 0 + 0) / 3.
    responses = ResponseTimes.of([2.0, 4.0, 6.0])
    assert responses.expected_visible_cost(1.0, 2.0) == pytest.approx(1 / 3)
    assert responses.survival(1.0, 2.0) == pytest.approx(2 / 3)  # P(T > 3 | T > 1)
    # Waited 5 s: only the 6-s response is still running, with 1 s left of c = 2.
    assert responses.expected_visible_cost(5.0, 2.0) == pytest.approx(1.0)
    # Waited 7 s: no sample beyond x, nothing is known to hide it.
    assert responses.expected_visible_cost(7.0, 2.0) == 2.0
    verdict = decide(
        Policy(),
        Situation(step=5, exposure_s=40.0, env_work_s=3.0, elapsed_s=1.0),
        p=0.01,
        responses=responses,
        cost_s=2.0,
    )
    assert verdict.checkpoint and verdict.benefit_s == pytest.approx(0.4)
    assert verdict.expected_visible_cost_s == pytest.approx(1 / 3)
    tighter = decide(
        Policy(),
        Situation(step=5, exposure_s=20.0, env_work_s=3.0, elapsed_s=1.0),
        p=0.01,
        responses=responses,
        cost_s=2.0,
    )
    assert not tighter.checkpoint  # 0.2 < 1/3


def test_c_counts_the_running_response_in_whole() -> None:
    # A checkpoint taken now keeps the response that is running, so C counts all of it: the
    # driver reports the work so far (x included), the service adds E[T - x | T > x].
    responses = ResponseTimes.of([2.0, 4.0, 6.0])
    assert responses.expected_rest(1.0) == pytest.approx(4.0 - 1.0)  # all three still running
    assert responses.expected_rest(3.0) == pytest.approx(5.0 - 3.0)  # the 4-s and 6-s ones
    assert responses.expected_rest(6.0) == 0.0  # none beyond x: nothing more is known
    assert ResponseTimes.of([5.0]).expected_rest(0.0) == 0.0  # too few samples to use
    asked = PolicyDecide(
        trajectory="t",
        host_id="h",
        step=5,
        step_duration_s=1.0,
        exposure_s=20.0,
        env_work_s=3.0,
        elapsed_s=1.0,
    )
    situation = situation_of(asked, responses)
    assert situation.exposure_s == pytest.approx(23.0)
    verdict = decide(Policy(), situation, p=0.01, responses=responses, cost_s=2.0)
    # 0.23 ≥ 1/3 fails, where the work so far alone (0.2) would have failed too; at p = 0.015 the
    # whole response tips it: 0.345 ≥ 1/3 > 0.3.
    assert not verdict.checkpoint and verdict.exposure_s == pytest.approx(23.0)
    assert decide(Policy(), situation, p=0.015, responses=responses, cost_s=2.0).checkpoint
    assert not decide(
        Policy(), replace(situation, exposure_s=20.0), p=0.015, responses=responses, cost_s=2.0
    ).checkpoint


@settings(max_examples=300, deadline=None)
@given(
    p=any_float,
    exposure=any_float,
    env_work=any_float,
    elapsed=any_float,
    cost=any_float,
    cooldown=any_float,
    contention=any_float,
    step=st.integers(min_value=-5, max_value=1000),
    times=st.lists(any_float, max_size=10),
    policy=st.sampled_from(["adaptive", "never", "always", "every-3"]),
)
def test_bad_inputs_give_a_defined_decision(
    p: float,
    exposure: float,
    env_work: float,
    elapsed: float,
    cost: float,
    cooldown: float,
    contention: float,
    step: int,
    times: list[float],
    policy: str,
) -> None:
    verdict = decide(
        Policy.parse(policy),
        Situation(
            step=step, exposure_s=exposure, env_work_s=env_work, elapsed_s=elapsed, cooldown_left_s=cooldown
        ),
        p=p,
        responses=ResponseTimes.of(times),
        cost_s=cost,
        contention=contention,
    )
    assert isinstance(verdict.checkpoint, bool) and verdict.reason
    assert 0.0 <= verdict.p <= 1.0
    values = (verdict.benefit_s, verdict.expected_visible_cost_s, verdict.cost_s, verdict.contention_cost_s)
    for value in values:
        assert not math.isnan(value) and value >= 0.0


def test_named_bad_inputs() -> None:
    assert step_failure_probability(0.0, 10.0) == 0.0  # λ = 0
    assert step_failure_probability(0.01, -3.0) == 0.0  # a negative duration
    assert step_failure_probability(math.nan, 1.0) == 0.0
    assert step_failure_probability(0.01, math.inf) == 1.0
    empty = ResponseTimes()
    base = Situation(step=5, exposure_s=10.0, env_work_s=1.0, elapsed_s=0.0)
    # No samples yet: the visible cost is c.
    assert decide(Policy(), base, p=0.01, responses=empty, cost_s=0.5).expected_visible_cost_s == 0.5
    # c = 0: a free checkpoint is always worth it.
    assert decide(Policy(), base, p=0.01, responses=empty, cost_s=0.0).checkpoint
    # λ = 0, so p = 0: no benefit against a real cost.
    assert not decide(Policy(), base, p=0.0, responses=empty, cost_s=0.5).checkpoint


def test_guards_name_themselves() -> None:
    responses = ResponseTimes.of([5.0, 6.0, 7.0])
    kwargs = {"p": 0.5, "responses": responses, "cost_s": 0.1}
    early = decide(Policy(), Situation(step=2, exposure_s=100, env_work_s=5, elapsed_s=0), **kwargs)
    assert not early.checkpoint and early.reason.startswith("guard min-step")
    busy = decide(
        Policy(), Situation(step=5, exposure_s=100, env_work_s=5, elapsed_s=0, in_flight=True), **kwargs
    )
    assert not busy.checkpoint and busy.reason.startswith("guard in-flight")
    little = decide(Policy(), Situation(step=5, exposure_s=100, env_work_s=0.001, elapsed_s=0), **kwargs)
    assert not little.checkpoint and little.reason.startswith("guard min-env-work")
    cooling = decide(
        Policy.parse("always"),
        Situation(step=5, exposure_s=1, env_work_s=1, elapsed_s=0, cooldown_left_s=12.5),
        **kwargs,
    )
    assert not cooling.checkpoint and cooling.reason.startswith("busy") and cooling.busy_s == 12.5
    ok = decide(Policy(), Situation(step=5, exposure_s=100, env_work_s=5, elapsed_s=0), **kwargs)
    assert ok.checkpoint, ok.reason
    custom = decide(
        Policy(),
        Situation(step=2, exposure_s=100, env_work_s=5, elapsed_s=0),
        guards=Guards(min_step=1),
        **kwargs,
    )
    assert custom.checkpoint


def test_comparison_policies() -> None:
    responses = ResponseTimes()
    every = Policy.parse("every-3")
    taken = [
        k
        for k in range(1, 10)
        if decide(
            every,
            Situation(step=k, exposure_s=1, env_work_s=1, elapsed_s=0),
            p=0,
            responses=responses,
            cost_s=1,
        ).checkpoint
    ]
    assert taken == [3, 6, 9]
    never = decide(
        Policy.parse("never"),
        Situation(step=9, exposure_s=1e9, env_work_s=9, elapsed_s=0),
        p=1,
        responses=responses,
        cost_s=0,
    )
    assert not never.checkpoint
    always = decide(
        Policy.parse("always"),
        Situation(step=1, exposure_s=0, env_work_s=0, elapsed_s=0),
        p=0,
        responses=responses,
        cost_s=9,
    )
    assert always.checkpoint
    for wrong in ("every-0", "every-x", "sometimes", ""):
        with pytest.raises(ValueError, match="unknown policy"):
            Policy.parse(wrong)


def test_response_times_are_bounded_and_follow_drift() -> None:
    times = ResponseTimes(window=50)
    for _ in range(200):
        times.add(1.0)
    for _ in range(50):
        times.add(10.0)  # the load changed: responses now take 10 s
    assert len(times) == 50 and times.sorted == [10.0] * 50
    assert times.expected_visible_cost(0.0, 2.0) == 0.0  # every recent response hides a 2-s checkpoint
    for bad in (math.nan, math.inf, -1.0):
        times.add(bad)
    assert len(times) == 50
    assert not ResponseTimes.of([1.0, 2.0]).usable  # two samples are not enough yet
    assert ResponseTimes.of([1.0, 2.0]).expected_visible_cost(0.0, 3.0) == 3.0


def test_response_times_seeded_from_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    listed = tmp_path / "times.json"
    listed.write_text("[1.5, 2.5, 3.5]")
    assert ResponseTimes.seeded_from(listed).sorted == [1.5, 2.5, 3.5]
    lines = tmp_path / "times.jsonl"
    lines.write_text("2\n1\n\n3\n")
    assert ResponseTimes.seeded_from(lines).sorted == [1.0, 2.0, 3.0]
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON list of seconds"):
        ResponseTimes.seeded_from(bad)


def test_failure_rate_learns_from_failures() -> None:
    rate = FailureRate(prior_failures=1.0, prior_seconds=600.0)
    assert rate.per_second == pytest.approx(1 / 600)
    for step in range(1000):
        rate.observe(0.5, failed=step % 50 == 0)  # 20 failures in 500 s: 0.04 per second
    assert rate.per_second == pytest.approx(21 / 1100)
    rate.observe(math.nan, failed=False)
    rate.observe(-5, failed=False)
    assert rate.per_second == pytest.approx(21 / 1100)
    assert FailureRate(fixed=0.2).per_second == 0.2


def test_checkpoint_cost_is_the_recent_median() -> None:
    cost = CheckpointCost(initial_s=0.5, window=5)
    assert cost.seconds == 0.5
    for s in (1.0, 9.0, 2.0, 3.0, 1.5, 2.5):  # the first drops out of the window
        cost.add(s)
    assert cost.seconds == 2.5
    cost.add(math.nan)
    assert cost.seconds == 2.5


def contention_run(kappa: float, other_machine: bool = False) -> Contention:
    """64 responses at 10 ms a token, every other one longer (200-350 tokens against 50-200) and beside a 0.5 s checkpoint
    that slows it by `kappa` s a second (none when the checkpoint ran on another machine), and a
    0.5 s checkpoint after each response, beside none: 96 checkpoints, 48 s, beside 16 s of responses."""
    contention = Contention()
    now = 0.0
    for i in range(64):
        tokens = (150 if i % 2 else 0) + 50 + (i * 37) % 150
        seconds = 0.01 * tokens
        if i % 2:
            contention.add_checkpoint(now + 1.0, 0.5)  # runs from 0.5 s into the response to 1.0 s
            seconds += 0.0 if other_machine else kappa * 0.5
        now += seconds
        contention.add_response(now, seconds, tokens)
        now += 2.0
        contention.add_checkpoint(now - 0.5, 0.5)  # between responses: slows nothing
    return contention


def test_contention_is_fitted_from_responses_beside_checkpoints() -> None:
    # κ = 0.8 s a second for each response beside a checkpoint; a checkpoint runs beside
    # 16 s / 48 s of responses on average, so K = 0.8 / 3.
    assert contention_run(0.8).per_checkpoint_second == pytest.approx(0.8 * 16 / 48, rel=1e-6)
    # The same overlaps with checkpoints that slow nothing (another machine's): K = 0.
    assert contention_run(0.8, other_machine=True).per_checkpoint_second == pytest.approx(0.0, abs=1e-9)
    # Mutation check: sizes paired with the wrong responses (each with the next one's) leave the
    # longer responses unexplained, and the fit blames the checkpoints beside them.
    slow = contention_run(0.0)
    assert slow.per_checkpoint_second == pytest.approx(0.0, abs=1e-9)
    kept = list(slow.responses)
    misaligned = [replace(r, work=kept[(i + 1) % len(kept)].work) for i, r in enumerate(kept)]
    wrong = fit_slowdown(misaligned)
    assert wrong is not None and wrong.kappa > 0.5 and wrong.shown  # a slowdown where there is none


def test_a_slowdown_within_noise_is_not_taken_for_contention() -> None:
    # Response times that vary by ±40% whatever runs beside them: κ is fitted, but within noise.
    noisy = Contention(prior=0.25)
    now = 0.0
    for i in range(64):
        tokens = 50 + (i * 37) % 150
        seconds = 0.01 * tokens * (1.4 if (i * 7) % 5 < 2 else 0.6)
        if i % 2:
            noisy.add_checkpoint(now + 0.5, 0.3)
        now += seconds
        noisy.add_response(now, seconds, tokens)
        now += 2.0
    slowdown = fit_slowdown(noisy.responses)
    assert slowdown is not None and not slowdown.shown, slowdown
    assert noisy.per_checkpoint_second == 0.25  # the prior: the data do not tell


def test_contention_prior_fixed_and_bad_events() -> None:
    few = Contention(prior=0.7)
    for i in range(MIN_CONTENTION_SAMPLES):  # no checkpoint beside any of them: nothing to fit
        few.add_response(float(i), 0.5 + i / 100, 10 + i)
    assert few.per_checkpoint_second == 0.7
    few.add_checkpoint(1.0, 0.5)
    assert few.per_checkpoint_second == 0.7  # too few responses beside one to tell: 0.7 still

    assert Contention(fixed=2.5).per_checkpoint_second == 2.5
    assert Contention(fixed=math.inf).per_checkpoint_second == MAX_CONTENTION
    bad = contention_run(0.8)
    k = bad.per_checkpoint_second
    bad.add_response(math.nan, 1.0, 5)
    bad.add_response(100.0, -1.0, 5)
    bad.add_checkpoint(math.inf, 0.5)
    assert bad.per_checkpoint_second == k and len(bad.responses) == 64


def test_contention_cost_can_outweigh_a_hidden_checkpoint() -> None:
    responses = ResponseTimes.of([5.0, 6.0, 7.0])  # the 0.5 s checkpoint is always hidden
    situation = Situation(step=5, exposure_s=30.0, env_work_s=1.0, elapsed_s=0.0)
    free = decide(Policy(), situation, p=0.01, responses=responses, cost_s=0.5)
    assert free.checkpoint and free.expected_visible_cost_s == 0.0  # 0.3 s ≥ 0
    busy = decide(Policy(), situation, p=0.01, responses=responses, cost_s=0.5, contention=1.0)
    assert not busy.checkpoint and busy.contention_cost_s == 0.5  # 0.3 s < 0 + 1.0 * 0.5
    assert "contention K·c 0.5 s" in busy.reason
    # The comparison policies do not weigh it.
    assert decide(
        Policy("always"), situation, p=0.01, responses=responses, cost_s=0.5, contention=1.0
    ).checkpoint


def explain(*args: str) -> subprocess.CompletedProcess[str]:
    return belayer("policy", "explain", *args)


def test_explain_prints_the_decision_and_its_terms() -> None:
    run = explain(
        "--samples", "2,4,6", "--elapsed", "1", "--cost", "2", "--p", "0.01", "--exposure", "40", "--json"
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["checkpoint"] is True
    assert report["expected_visible_cost_s"] == pytest.approx(1 / 3)
    assert report["q"] == pytest.approx(2 / 3)
    assert report["benefit_s"] == pytest.approx(0.4)
    assert "benefit" in report["reason"]
    none = json.loads(
        explain(
            "--samples", "", "--elapsed", "0", "--cost", "2", "--p", "0.01", "--exposure", "40", "--json"
        ).stdout
    )
    assert none["samples"] == 0 and none["expected_visible_cost_s"] == 2.0 and none["checkpoint"] is False
    guard = json.loads(
        explain(
            "--samples",
            "2",
            "--elapsed",
            "0",
            "--cost",
            "2",
            "--p",
            "0.5",
            "--exposure",
            "40",
            "--step",
            "1",
            "--json",
        ).stdout
    )
    assert guard["checkpoint"] is False and "min-step" in guard["reason"]
    hostile = explain(
        "--samples",
        "nan,inf,-1",
        "--elapsed",
        "nan",
        "--cost",
        "inf",
        "--p",
        "nan",
        "--exposure=-inf",  # argparse reads a bare "-inf" as a flag
        "--json",
    )
    assert hostile.returncode == 0, hostile.stderr
    assert json.loads(hostile.stdout)["checkpoint"] in (True, False)
    text = explain("--samples", "2,4,6", "--elapsed", "1", "--cost", "2", "--p", "0.01", "--exposure", "40")
    assert "decision: checkpoint" in text.stdout and "expected visible cost" in text.stdout
    wrong = explain("--samples", "a,b", "--elapsed", "1", "--cost", "2", "--p", "0.01", "--exposure", "40")
    assert wrong.returncode != 0 and "--samples must be numbers" in wrong.stderr


def test_k_counts_the_checkpoints_of_the_responses_it_keeps() -> None:
    # One 0.5 s checkpoint inside every third response, each slowing it by κ = 1 s a second: a
    # checkpoint runs beside one response, so K = 1. More events than the window keeps: the
    # checkpoints kept reach further back than the responses, and must not dilute K.
    contention = Contention(window=64)
    now = 0.0
    for i in range(300):
        tokens = 50 + (i * 37) % 150
        seconds = 0.01 * tokens
        if i % 3 == 0:
            contention.add_checkpoint(now + 0.7, 0.5)  # [now + 0.2, now + 0.7], inside the response
            seconds += 0.5
        now += seconds
        contention.add_response(now, seconds, tokens)
        now += 1.0
    assert contention.per_checkpoint_second == pytest.approx(1.0, rel=1e-6)
