"""A typed client of the policy service: what the rollout driver calls. `decide` asks, the
`report_*` calls publish what the driver saw (the events the service learns from)."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from belayer_rl.shared import bus
from belayer_rl.shared.protocol import CheckpointTimeout, EnvStep, LlmResponse, PolicyDecide, PolicyDecision
from belayer_rl.shared.subjects import Subjects


class PolicyClient:
    def __init__(self, nc: NATS, *, subjects: Subjects = Subjects(), timeout_s: float = 0.5) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout_s = timeout_s  # a decision is arithmetic: an answer this late means no service

    async def decide(self, request: PolicyDecide) -> PolicyDecision:
        """The service's decision; raises ServiceError ("timeout", "no-responders", ...) without one."""
        return await bus.request_struct(
            self.nc, self.subjects.policy_decide, request, PolicyDecision, self.timeout_s
        )

    async def report_step(self, step: EnvStep) -> None:
        await bus.publish(self.nc, self.subjects.event("env_step", step.trajectory), step)

    async def report_response(self, response: LlmResponse) -> None:
        await bus.publish(self.nc, self.subjects.event("llm_response", response.trajectory), response)

    async def report_timeout(self, event: CheckpointTimeout) -> None:
        await bus.publish(self.nc, self.subjects.event("checkpoint_timeout", event.host_id), event)
