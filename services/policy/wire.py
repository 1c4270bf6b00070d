"""The decision on the wire: a PolicyDecide read as a Situation, and a Verdict written back as a
PolicyDecision, for the service and for the rollout driver's fallback alike."""

from __future__ import annotations

import dataclasses
from typing import Literal

from belayer_rl.services.policy.decision import Policy, Situation, Verdict
from belayer_rl.shared.protocol import PolicyDecide, PolicyDecision


def situation_of(request: PolicyDecide, cooldown_left_s: float = 0.0) -> Situation:
    return Situation(
        step=request.step,
        exposure_s=request.exposure_s,
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
    """The verdict's fields and the request's inputs, by the same names."""
    return PolicyDecision(
        trajectory=request.trajectory,
        host_id=request.host_id,
        step=request.step,
        policy=policy.name,
        rate_per_s=rate_per_s,
        step_duration_s=request.step_duration_s,
        exposure_s=request.exposure_s,
        elapsed_s=request.elapsed_s,
        source=source,
        **dataclasses.asdict(verdict),
    )
