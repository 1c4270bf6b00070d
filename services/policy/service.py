"""The policy service: what it listens to and what it publishes; `setup` is what the runtime runs
(shared/runtime.py).

Answers PolicyDecide on `belayer.<cluster>.policy.decide` and publishes each answer as
`belayer.<cluster>.evt.policy_decision.<trajectory>`. Learns from `env_step` and `llm_response`
(the rollout driver), `checkpoint_ready` (the checkpointers) and `checkpoint_timeout` events.
One instance per cluster: its estimates are the cluster's (no queue group, like every service).
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
