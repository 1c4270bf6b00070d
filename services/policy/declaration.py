"""The checkpoint policy, declared (shared/declaration.py): one per cluster, it decides at each
action boundary whether to checkpoint the sandbox, from what the rollout side reports."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import PolicyConfig
from belayer_rl.shared.declaration import Compose, Deployment, Listen, Planned, Service, event, on_event


def up(cluster: Deployment) -> list[Planned]:
    return (
        [Planned("policy", PolicyConfig(**cluster.settings(PolicyConfig, "policy")))]
        if cluster.sandboxes
        else []
    )


POLICY = Service(
    name="policy",
    summary="Run the checkpoint policy service.",
    runs="cluster",
    config=PolicyConfig,
    setup="belayer_rl.services.policy.service:setup",
    listens={
        "decide": Listen(lambda s, x: s.policy_decide, p.PolicyDecide, p.PolicyDecision),
        "env_step": on_event("env_step"),
        "llm_response": on_event("llm_response"),
        "checkpoint_ready": on_event("checkpoint_ready"),
        "checkpoint_timeout": on_event("checkpoint_timeout"),
    },
    publishes=(event("policy_decision"),),
    compose=Compose(
        uid=2004,
        note="""The checkpoint policy: decides when trajectories checkpoint, from what the rollout side and the
checkpointer report. Stateless across restarts (its estimates are learnt again).""",
    ),
    up=up,
)
