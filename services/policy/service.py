"""The policy service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Answers each decision request and publishes the answer as an event. Learns from what the rollout
driver and the checkpointers report. One instance per cluster: its estimates are the cluster's (no queue group, like every service).
"""

from __future__ import annotations

from belayer_rl.services.policy.declaration import POLICY
from belayer_rl.services.policy.policy import PolicyState
from belayer_rl.shared.config import PolicyConfig
from belayer_rl.shared.metrics import PolicyMetrics
from belayer_rl.shared.protocol import PolicyDecide, PolicyDecision
from belayer_rl.shared.runtime import Runtime


async def setup(rt: Runtime, config: PolicyConfig) -> None:
    await rt.connect()
    state = PolicyState(config, PolicyMetrics(rt.metrics))
    names = rt.subjects

    async def on_decide(request: PolicyDecide) -> PolicyDecision:
        decision = state.decision(request)
        await rt.publish(names.event("policy_decision", request.trajectory), decision)
        return decision

    await rt.serve(
        *POLICY.endpoints(
            names,
            config,
            decide=on_decide,
            env_step=state.on_env_step,
            llm_response=state.on_llm_response,
            checkpoint_ready=state.on_checkpoint_ready,
            checkpoint_timeout=state.on_checkpoint_timeout,
        )
    )
    rt.ready(
        f"policy {state.default.name}; λ {state.rate.per_second:.3g}/s;"
        f" {len(state.responses)} response times seeded; cost {state.cost.seconds:.2f} s until measured"
    )
