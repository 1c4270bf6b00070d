"""The decision on the wire: a PolicyDecide read as a Situation, and a Verdict written back as a
PolicyDecision, for the service and for the rollout driver's fallback alike."""

from __future__ import annotations

import dataclasses
from typing import Literal

from belayer_rl.services.policy.decision import Policy, ResponseTimes, Situation, Verdict
from belayer_rl.shared.protocol import PolicyDecide, PolicyDecision


def situation_of(request: PolicyDecide, responses: ResponseTimes, cooldown_left_s: float = 0.0) -> Situation:
    """The request's situation; C adds to the work the driver reports what the running response is
    expected to take beyond the x seconds it has run."""
    return Situation(
        step=request.step,
        exposure_s=request.exposure_s + responses.expected_rest(request.elapsed_s),
        env_work_s=request.env_work_s,
        elapsed_s=request.elapsed_s,
        in_flight=request.in_flight,
        cooldown_left_s=cooldown_left_s,
    )


def decision_message(
    request: PolicyDecide,
    policy: Policy,
    verdict: Verdict,
    rate_per_s: float,
    source: Literal["service", "fallback"] = "service",
) -> PolicyDecision:
    """The verdict's fields (C among them) and the request's other inputs, by the same names."""
    return PolicyDecision(
        trajectory=request.trajectory,
        host_id=request.host_id,
        step=request.step,
        policy=policy.name,
        rate_per_s=rate_per_s,
        step_duration_s=request.step_duration_s,
        elapsed_s=request.elapsed_s,
        source=source,
        **dataclasses.asdict(verdict),
    )
