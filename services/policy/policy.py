"""The policy service's state: what it has learnt, and the decision it answers with.

It owns four estimates, fed by events: the failure rate λ (EnvStep: environment time and
failures, from the rollout driver), the LLM response-time distribution T (LlmResponse), the
checkpoint cost c (CheckpointReady, from the checkpointers: the median of recent whole times, so
it follows the current load), and the contention K (which responses ran beside which
checkpoints: both events, timed at their arrival). A CheckpointTimeout starts its host's cooldown. Every answer is
also published as a `policy_decision` event with its inputs and terms.
"""

from __future__ import annotations

import logging
import time

from belayer_rl.services.policy.decision import (
    CheckpointCost,
    Contention,
    FailureRate,
    Guards,
    Policy,
    ResponseTimes,
    decide,
    step_failure_probability,
)
from belayer_rl.services.policy.wire import decision_message, situation_of
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import PolicyConfig
from belayer_rl.shared.metrics import PolicyMetrics
from belayer_rl.shared.protocol import (
    CheckpointReady,
    CheckpointTimeout,
    EnvStep,
    LlmResponse,
    PolicyDecide,
    PolicyDecision,
)

log = logging.getLogger("belayer.policy")


class PolicyState:
    def __init__(self, config: PolicyConfig, metrics: PolicyMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.default = Policy.parse(config.policy)
        self.guards = Guards(min_step=config.min_step, min_env_work_s=config.min_env_work_s)
        self.rate = FailureRate(
            prior_failures=config.prior_failures,
            prior_seconds=config.prior_seconds,
            fixed=config.failure_rate,
        )
        window = {"window": config.response_window, "min_samples": config.min_samples}
        self.responses = (
            ResponseTimes.seeded_from(config.response_times, **window)
            if config.response_times is not None
            else ResponseTimes(**window)
        )
        self.cost = CheckpointCost(config.initial_cost_s)
        self.contention = Contention(prior=config.contention_prior, fixed=config.contention)
        self.cooldown_until: dict[str, float] = {}  # host id -> monotonic time its cooldown ends

    # ------------------------------------------------------------ what it listens to

    async def on_env_step(self, step: EnvStep) -> None:
        self.rate.observe(step.duration_s, step.failed)
        self.metrics.observations.labels("env-failure" if step.failed else "env-step").inc()

    async def on_llm_response(self, response: LlmResponse) -> None:
        self.responses.add(response.seconds)
        self.contention.add_response(time.monotonic(), response.seconds, response.tokens)
        self.metrics.observations.labels("llm-response").inc()

    async def on_checkpoint_ready(self, ready: CheckpointReady) -> None:
        self.cost.add(ready.total_s)
        self.contention.add_checkpoint(time.monotonic(), ready.total_s)
        self.metrics.observations.labels("checkpoint").inc()

    async def on_checkpoint_timeout(self, event: CheckpointTimeout) -> None:
        self.cooldown_until[event.host_id] = time.monotonic() + self.config.cooldown_s
        self.metrics.observations.labels("checkpoint-timeout").inc()
        log.warning(
            "checkpoint of %s at step %d timed out after %.1f s: host %s cools down for %.0f s",
            event.trajectory,
            event.k,
            event.waited_s,
            event.host_id,
            self.config.cooldown_s,
        )

    def cooldown_left(self, host_id: str) -> float:
        until = self.cooldown_until.get(host_id)
        if until is None:
            return 0.0
        left = until - time.monotonic()
        if left <= 0:
            del self.cooldown_until[host_id]
            return 0.0
        return left

    # ------------------------------------------------------------ what it answers

    def decision(self, request: PolicyDecide) -> PolicyDecision:
        try:
            policy = Policy.parse(request.policy) if request.policy else self.default
        except ValueError as exc:  # the wire's pattern already refuses it; kept should the two drift
            raise ServiceError("bad-request", str(exc)) from None
        rate = self.rate.per_second
        verdict = decide(
            policy,
            situation_of(request, self.responses, self.cooldown_left(request.host_id)),
            p=step_failure_probability(rate, request.step_duration_s),
            responses=self.responses,
            cost_s=self.cost.seconds,
            contention=self.contention.per_checkpoint_second,
            guards=self.guards,
        )
        label = "checkpoint" if verdict.checkpoint else "busy" if verdict.busy_s else "skip"
        self.metrics.decisions.labels(policy.name, label).inc()
        if policy.kind == "adaptive":
            self.metrics.visible_cost.observe(verdict.expected_visible_cost_s)
            self.metrics.contention.set(verdict.contention)
        return decision_message(request, policy, verdict, rate)
