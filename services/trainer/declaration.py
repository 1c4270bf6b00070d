"""The trainer, declared (shared/declaration.py): no process of its own but the library `belayer
train` runs, under the same credential as its group workers (services/trainer_group). It calls
the groups, generates its samples through the router as a client, restarts the engines on a
rollout rebuild and reports its steps and its fault manager's decisions. An agentic workload's
samples are trajectories: it calls the checkpointer and the policy service as the rollout side does."""

from __future__ import annotations

from belayer_rl.shared.declaration import ANY, Compose, Service, Variable, event

TRAINER = Service(
    name="trainer",
    summary="Train a policy from rollouts, rebuilding failed groups.",
    runs="driver",
    client=True,  # it generates its samples through the router
    subscribes=(
        event("router_started"),  # the client re-attaches after a router restart
        event("group_heartbeat"),
        event("worker_failed"),  # the rollout side failing with the actor: reschedule
        event("handover"),
    ),
    publishes=(
        lambda s, x: s.trainer_group(ANY, ANY, ANY, "update"),  # calls to its group workers
        lambda s, x: s.trainer_group(ANY, ANY, ANY, "logprobs"),
        lambda s, x: s.trainer_group(ANY, ANY, ANY, "reward"),
        lambda s, x: s.weights_list,
        lambda s, x: s.weights_ping,
        event("trainer_step"),
        event("group_failed"),
        event("group_rebuilt"),
        event("reschedule"),
        lambda s, x: s.engine_restart(ANY),  # a rollout rebuild: the engines restarted by the cold path
        lambda s, x: s.router_generate(x.client),
        lambda s, x: s.router_attach(x.client),
        lambda s, x: s.router_cancel(x.client),
        lambda s, x: s.router_status,
        lambda s, x: s.router_keepalive(x.client),
        # An agentic workload's trajectories: the rollout side's calls and reports, in its own name.
        lambda s, x: s.sandbox_rpc(ANY, ANY, x.client),
        lambda s, x: s.policy_decide,
        event("env_step"),
        event("llm_response"),
        event("checkpoint_timeout"),
        event("policy_fallback"),
    ),
    compose=Compose(
        uid=2005,
        note="""A GRPO training run (README, "Training"): a job, not a daemon, started on demand:
  docker compose --profile train run --rm trainer [--steps N --chaos actor@3:kill ...]
  docker compose --profile train run --rm trainer --workload lookup   (agentic: the Compose
    checkpointer's sandboxes, the policy service's checkpoints; their image first, on the
    Docker host: python -m belayer_rl.services.checkpointer.image)
Its worker groups (actor ranks, reward) are processes inside its container, under its fault
manager. The step log, reward curve and checkpoints go to the volume `train`, so a rerun with
the same flags resumes from its last checkpoint; a run of other settings needs --out
/var/lib/belayer/<another folder>. Metrics and /healthz on :9100 while it runs.""",
        variables={"BELAYER_TRAIN_STEPS": Variable("100", "the steps of `--profile train run trainer`")},
        after=("router", "weight-server", "shadow-supervisor", "checkpointer", "policy"),
        keys={
            "profiles": ["train"],
            "restart": "no",
            "entrypoint": [
                "belayer",
                "train",
                "--metrics-port",
                "9100",
                "--metrics-host",
                "0.0.0.0",
                "--no-progress",
                "--out",
                "/var/lib/belayer/run",
                "--checkpoint-every",
                "5",
                "--host-id",  # an agentic workload's sandboxes: the Compose checkpointer's
                "$BELAYER_HOST_ID",
            ],
            "command": ["--steps", "$BELAYER_TRAIN_STEPS"],
            "volumes": [
                "train:/var/lib/belayer"
            ],  # a fresh volume takes the image's folder: writable by any uid
        },
    ),
)
