"""The checkpoint decision: whether to checkpoint a trajectory's sandbox now. Pure arithmetic,
no I/O: the policy service feeds it, the rollout driver falls back to it, and `belayer policy
explain` prints it.

The adaptive rule weighs what a failure would cost against what a checkpoint would cost the
rollout, where a checkpoint taken while the next LLM response is still being generated costs only
the part that outlasts that response:

- p = 1 - exp(-λ·d): the chance that a step of d seconds of environment time fails, λ the failure
  rate per second of environment time (FailureRate, estimated online from a stated prior);
- C: the seconds of LLM and environment work that a failure would make the trajectory redo (its
  "exposure"): the work since the last ready checkpoint, less the response to that checkpoint's
  context, which a recovery keeps (services/rollout/agent.py), and with the response now running
  in whole. A failure is seen at the next action, once that response has ended, and a checkpoint
  taken now would keep it; its length is expected to be E[T | T > x] (x without samples);
- T: the LLM response time, an empirical distribution of recent responses (ResponseTimes);
- x: the seconds already waited for the current response; c: the checkpoint cost;
- q(x; u) = P(T > x + u | T > x), and the expected visible cost
  ∫₀^c (1 - q(x; u)) du = E[max(c - (T - x), 0) | T > x], the checkpoint time that the response
  does not hide. With no samples, or none beyond x, nothing is known to hide it: it is c.

A checkpoint that is hidden is still not free where the engine and the checkpointer share CPUs:
CRIU, tar and the checkpointer take cores the engine would use, and every response running
meanwhile slows down. K, the seconds of LLM work the rollout loses per second a checkpoint runs,
is estimated online from which responses ran alongside which checkpoints (Contention); a
checkpoint's contention cost is K·c.

Checkpoint when p·C ≥ the expected visible cost + K·c, and p·C > 0. Inputs that are not numbers
a person would give (NaN, infinities, negatives) still get a decision: a duration, a wait, a cost,
an exposure or a contention that is NaN or negative counts as 0, an infinite duration makes p = 1,
and samples that are not finite and non-negative are left out. Every decision says why, and a guard that decided names itself.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy

from belayer_rl.shared.protocol import POLICY_PATTERN

PolicyKind = Literal["adaptive", "never", "always", "every"]

# The prior of the failure rate: as if PRIOR_FAILURES had been seen in PRIOR_SECONDS of
# environment time (one failure in ten minutes). Weak on purpose: a few real failures outweigh it.
PRIOR_FAILURES = 1.0
PRIOR_SECONDS = 600.0
RESPONSE_WINDOW = 512  # response times kept: bounded memory, and the oldest drop out as load drifts
MIN_RESPONSE_SAMPLES = 3  # fewer than this: the distribution is not used yet (the cost is c)
COST_WINDOW = 16  # recent checkpoint costs whose median is c: "under the current load"
CONTENTION_WINDOW = 256  # responses, and checkpoints, that the contention estimate is fitted on
# Responses before K is fitted, of which some ran beside a checkpoint; and they must differ both in
# size and in the checkpoint time beside them, or the fit cannot tell a checkpoint's effect from a
# response's own length.
MIN_CONTENTION_SAMPLES = 16
MIN_BESIDE_SAMPLES = 8
MAX_CONTENTION = 100.0  # K beyond this is a fit gone wrong, not a machine


def finite_or_zero(value: float) -> float:
    """A duration, wait, cost or exposure: NaN and negatives count as 0; +inf stays."""
    return value if value > 0 else 0.0  # NaN > 0 is False


def step_failure_probability(rate_per_s: float, duration_s: float) -> float:
    """p = 1 - exp(-λ·d), defined for every input: a NaN or negative rate or duration is 0."""
    rate, duration = finite_or_zero(rate_per_s), finite_or_zero(duration_s)
    if rate == 0.0 or duration == 0.0:
        return 0.0
    return -math.expm1(-rate * duration)  # exp(-inf) = 0, so an infinite product gives p = 1


@dataclass
class FailureRate:
    """λ, failures per second of environment time: a Gamma-Poisson estimate, (prior failures +
    failures seen) / (prior seconds + environment seconds seen). `fixed` replaces the estimate."""

    prior_failures: float = PRIOR_FAILURES
    prior_seconds: float = PRIOR_SECONDS
    failures: int = 0
    env_seconds: float = 0.0
    fixed: float | None = None

    def observe(self, duration_s: float, failed: bool) -> None:
        self.env_seconds += min(finite_or_zero(duration_s), 86400.0)  # one absurd step cannot zero λ
        self.failures += int(failed)

    @property
    def per_second(self) -> float:
        if self.fixed is not None:
            return finite_or_zero(self.fixed)
        return (self.prior_failures + self.failures) / (self.prior_seconds + self.env_seconds)


class ResponseTimes:
    """The LLM response time T as the empirical distribution of the last `window` responses,
    kept sorted for the tail sums; seeded from earlier runs if given."""

    def __init__(self, window: int = RESPONSE_WINDOW, min_samples: int = MIN_RESPONSE_SAMPLES) -> None:
        self.window = window
        self.min_samples = min_samples
        self.recent: deque[float] = deque()  # arrival order, for dropping the oldest
        self.sorted: list[float] = []

    @classmethod
    def of(cls, samples: Iterable[float], **kwargs: int) -> ResponseTimes:
        times = cls(**kwargs)
        for sample in samples:
            times.add(sample)
        return times

    @classmethod
    def seeded_from(cls, path: Path, **kwargs: int) -> ResponseTimes:
        """A file of earlier runs: a JSON list of seconds, or one JSON number per line."""
        text = path.read_text()
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            values = [json.loads(line) for line in text.splitlines() if line.strip()]
        if isinstance(values, (int, float)) and not isinstance(values, bool):
            values = [values]
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise ValueError(f"{path}: expected a JSON list of seconds or one number per line")
        return cls.of((float(v) for v in values), **kwargs)

    def add(self, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self.recent.append(seconds)
        bisect.insort(self.sorted, seconds)
        if len(self.recent) > self.window:
            oldest = self.recent.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, oldest)]

    def __len__(self) -> int:
        return len(self.recent)

    @property
    def usable(self) -> bool:
        return len(self.recent) >= self.min_samples

    def beyond(self, elapsed_s: float) -> list[float]:
        """The samples t with t > x: the responses that would still be running after x seconds."""
        return self.sorted[bisect.bisect_right(self.sorted, elapsed_s) :]

    def survival(self, elapsed_s: float, u: float) -> float:
        """q(x; u) = P(T > x + u | T > x); 0 with no sample beyond x."""
        tail = self.beyond(elapsed_s)
        if not tail:
            return 0.0
        return (len(tail) - bisect.bisect_right(tail, elapsed_s + u)) / len(tail)

    def expected_rest(self, elapsed_s: float) -> float:
        """E[T - x | T > x], exactly over the samples beyond x: what a response that has run x
        seconds still has to go; 0 without them."""
        x = finite_or_zero(elapsed_s)
        tail = self.beyond(x) if self.usable else []
        return sum(tail) / len(tail) - x if tail else 0.0

    def expected_visible_cost(self, elapsed_s: float, cost_s: float) -> float:
        """E[max(c - (T - x), 0) | T > x], exactly over the samples beyond x; c without them."""
        x, c = finite_or_zero(elapsed_s), finite_or_zero(cost_s)
        tail = self.beyond(x) if self.usable else []
        if not tail or c == 0.0 or math.isinf(c):
            return c
        return sum(max(c - (t - x), 0.0) for t in tail) / len(tail)


class CheckpointCost:
    """c: the median whole time of the last COST_WINDOW checkpoints, or `initial` before any."""

    def __init__(self, initial_s: float, window: int = COST_WINDOW) -> None:
        self.initial_s = initial_s
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self.recent.append(seconds)

    @property
    def seconds(self) -> float:
        if not self.recent:
            return self.initial_s
        ordered = sorted(self.recent)
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True)
class Interval:
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def overlap(self, other: Interval) -> float:
        return max(0.0, min(self.end, other.end) - max(self.start, other.start))


@dataclass
class TimedResponse:
    when: Interval
    work: float  # its size: tokens generated (the simulator, without tokens, gives its undisturbed seconds)
    beside_s: float  # seconds of checkpoints that ran during it


@dataclass(frozen=True)
class Slowdown:
    kappa: float  # seconds a response loses per second of checkpoint beside it
    standard_error: float

    @property
    def shown(self) -> bool:
        """The data show a slowdown: κ is positive by more than twice its standard error."""
        return self.kappa > 2 * self.standard_error


def fit_slowdown(responses: Iterable[TimedResponse]) -> Slowdown | None:
    """κ by least squares, with its standard error:
        seconds_i ≈ b + a·work_i + κ·beside_i
    The work term matters: a longer response has more checkpoint time beside it whatever the
    contention. None with fewer than MIN_CONTENTION_SAMPLES responses or MIN_BESIDE_SAMPLES beside a
    checkpoint, or while the three columns do not vary independently."""
    rows = [(1.0, r.work, r.beside_s, r.when.seconds) for r in responses]
    beside = sum(1 for row in rows if row[2] > 0)
    if len(rows) < MIN_CONTENTION_SAMPLES or beside < MIN_BESIDE_SAMPLES:
        return None
    table = numpy.array(rows)  # [n, 4]: 1, work, beside, seconds
    x, y = table[:, :3], table[:, 3]
    coefficients, _, rank, _ = numpy.linalg.lstsq(x, y, rcond=None)
    if rank < 3:
        return None
    residuals = y - x @ coefficients
    variance = float(residuals @ residuals) / (len(rows) - 3)
    covariance = variance * numpy.linalg.inv(x.T @ x)  # [3, 3]
    return Slowdown(float(coefficients[2]), math.sqrt(max(float(covariance[2, 2]), 0.0)))


class Contention:
    """K: seconds of LLM work lost per second a checkpoint runs, through the CPU it takes.

    Each response is explained by its size and by the seconds of checkpoints that ran during it
    (any trajectory's, so any checkpointer's on the same machine), which gives κ (fit_slowdown). A
    checkpoint runs beside Σ beside / Σ checkpoint seconds responses on average, so K = κ · that.
    Checkpoints on another machine overlap responses without slowing them: their κ comes out near 0.
    K is `prior` until the data show a slowdown (Slowdown.shown): a κ within noise of 0, or below
    it, is no evidence of contention. `fixed` replaces the estimate, and then no event is kept.
    Times are the caller's clock at each event's arrival, an event's end; a response's overlaps
    are kept up to date as checkpoints arrive, so a fit costs one small least-squares solve."""

    def __init__(
        self, prior: float = 0.0, fixed: float | None = None, window: int = CONTENTION_WINDOW
    ) -> None:
        self.prior = prior
        self.fixed = fixed
        self.responses: deque[TimedResponse] = deque(maxlen=window)
        self.checkpoints: deque[Interval] = deque(maxlen=window)
        self._fitted: float | None = None  # the last fit's K; None: the data show no slowdown
        self._stale = True  # events came since the last fit

    def add_response(self, now: float, seconds: float, work: float) -> None:
        if (
            self.fixed is None
            and seconds >= 0
            and math.isfinite(seconds)
            and math.isfinite(now)
            and math.isfinite(work)
        ):
            when = Interval(now - seconds, now)
            beside = sum(when.overlap(c) for c in self.checkpoints)
            self.responses.append(TimedResponse(when, max(work, 0.0), beside))
            self._stale = True

    def add_checkpoint(self, now: float, seconds: float) -> None:
        if self.fixed is None and seconds >= 0 and math.isfinite(seconds) and math.isfinite(now):
            checkpoint = Interval(now - seconds, now)
            for response in self.responses:
                response.beside_s += response.when.overlap(checkpoint)
            self.checkpoints.append(checkpoint)
            self._stale = True

    @property
    def per_checkpoint_second(self) -> float:
        if self.fixed is not None:
            return min(finite_or_zero(self.fixed), MAX_CONTENTION)
        if self._stale:
            self._fitted, self._stale = self.fit(), False
        return self._fitted if self._fitted is not None else min(finite_or_zero(self.prior), MAX_CONTENTION)

    def fit(self) -> float | None:
        """K from the kept events; None while they show no slowdown."""
        slowdown = fit_slowdown(self.responses)
        if slowdown is None or not slowdown.shown:
            return None
        # Checkpoint seconds over the same stretch of time as the kept responses: with checkpoints
        # rarer than responses, the kept checkpoints reach further back.
        span = Interval(min(r.when.start for r in self.responses), math.inf)
        checkpoint_s = sum(span.overlap(c) for c in self.checkpoints)
        if checkpoint_s <= 0:
            return None
        beside = sum(r.beside_s for r in self.responses) / checkpoint_s  # responses a checkpoint runs beside
        return min(slowdown.kappa * beside, MAX_CONTENTION)


@dataclass(frozen=True)
class Guards:
    min_step: int = 3  # no checkpoint before this step (adaptive only)
    min_env_work_s: float = (
        0.05  # nor with less environment work than this since the last one (adaptive only)
    )


@dataclass(frozen=True)
class Situation:
    """What the driver knows about a trajectory when it asks."""

    step: int  # actions completed: the checkpoint would be labelled k = step
    exposure_s: float  # C: LLM and environment seconds a failure would make the trajectory redo
    env_work_s: float  # environment seconds since the last ready checkpoint
    elapsed_s: float  # x: seconds already waited for the current LLM response
    in_flight: bool = False  # a checkpoint of this trajectory is still running
    cooldown_left_s: float = 0.0  # the host's cooldown after a checkpoint timeout


@dataclass(frozen=True)
class Verdict:
    checkpoint: bool
    reason: str
    p: float
    exposure_s: float  # C
    benefit_s: float  # p·C
    expected_visible_cost_s: float
    survival: float  # q(x; c)
    cost_s: float  # c
    samples: int
    busy_s: float = 0.0  # seconds of cooldown left when the answer is "busy"
    contention: float = 0.0  # K
    contention_cost_s: float = 0.0  # K·c


@dataclass(frozen=True)
class Policy:
    """A named policy: adaptive, never, always, or every-N (a checkpoint after every Nth action)."""

    kind: PolicyKind = "adaptive"
    every: int = 0

    @classmethod
    def parse(cls, name: str) -> Policy:
        if not re.fullmatch(POLICY_PATTERN, name, flags=re.ASCII):
            raise ValueError(f"unknown policy {name!r}: adaptive, never, always or every-N (1 <= N < 10^6)")
        if name.startswith("every-"):
            return cls(kind="every", every=int(name[6:]))
        return cls(kind=name)  # type: ignore[arg-type]  # POLICY_PATTERN lets only the kinds' names here

    @property
    def name(self) -> str:
        return f"every-{self.every}" if self.kind == "every" else self.kind


def decide(
    policy: Policy,
    situation: Situation,
    *,
    p: float,
    responses: ResponseTimes,
    cost_s: float,
    contention: float = 0.0,
    guards: Guards = Guards(),
) -> Verdict:
    """The verdict for `situation`, p being the step's failure probability (step_failure_probability)
    and `contention` K (Contention.per_checkpoint_second).

    The guards and the host's cooldown come first, in that order: never; a checkpoint in flight;
    the cooldown (answered "busy" with the seconds left); then always and every-N; then the
    adaptive policy's own guards (min step, min environment work) and its rule."""
    s = situation
    p = min(finite_or_zero(p), 1.0)
    c = finite_or_zero(cost_s)
    exposure = finite_or_zero(s.exposure_s)
    x = finite_or_zero(s.elapsed_s)
    benefit = p * exposure if p and exposure else 0.0  # inf·0 would be NaN
    visible = responses.expected_visible_cost(x, c)
    survival = responses.survival(x, c) if responses.usable else 0.0
    k = min(finite_or_zero(contention), MAX_CONTENTION)
    contention_cost = k * c if k and c else 0.0  # inf·0 would be NaN

    def verdict(checkpoint: bool, reason: str, busy_s: float = 0.0) -> Verdict:
        return Verdict(
            checkpoint=checkpoint,
            reason=reason,
            p=p,
            exposure_s=exposure,
            benefit_s=benefit,
            expected_visible_cost_s=visible,
            survival=survival,
            cost_s=c,
            samples=len(responses),
            busy_s=busy_s,
            contention=k,
            contention_cost_s=contention_cost,
        )

    cooldown = finite_or_zero(s.cooldown_left_s)
    if policy.kind == "never":
        return verdict(False, "policy never")
    if s.in_flight:
        return verdict(False, "guard in-flight: a checkpoint of this trajectory is still running")
    if cooldown > 0:
        return verdict(
            False, f"busy: the host cools down after a checkpoint timeout, {cooldown:.1f} s left", cooldown
        )
    if policy.kind == "always":
        return verdict(True, "policy always")
    if policy.kind == "every":
        if s.step >= 1 and s.step % policy.every == 0:
            return verdict(True, f"policy {policy.name}: step {s.step}")
        return verdict(False, f"policy {policy.name}: step {s.step} is not a multiple of {policy.every}")
    if s.step < guards.min_step:
        return verdict(False, f"guard min-step: step {s.step} < {guards.min_step}")
    env_work = finite_or_zero(s.env_work_s)
    if env_work < guards.min_env_work_s:
        return verdict(
            False, f"guard min-env-work: {env_work:.3f} s of environment work < {guards.min_env_work_s:.3f} s"
        )
    # No benefit is never worth a checkpoint, even a free one.
    take = benefit >= visible + contention_cost and benefit > 0
    basis = (
        f"{len(responses)} samples"
        if responses.usable and responses.beyond(x)
        else "no sample beyond x: cost c"
    )
    relation = "≥" if take else "<"
    return verdict(
        take,
        f"benefit p·C {benefit:.4g} s {relation} expected visible cost {visible:.4g} s ({basis})"
        f" + contention K·c {contention_cost:.4g} s",
    )
