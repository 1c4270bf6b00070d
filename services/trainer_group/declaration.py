"""A trainer group worker, declared (shared/declaration.py): one rank of the actor, reference or
reward group, under the trainer's credential. Rank 0 of the actor publishes each new version to
the weight server through the weights bucket."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.declaration import (
    STREAM_NAMES,
    Listen,
    Scope,
    Service,
    event,
    object_put,
    object_stream,
)


def group_call(verb: str, accepts: type[p.Message], reply: type[p.Message]) -> Listen:
    return Listen(lambda s, x: s.trainer_group(x.run, x.group, x.rank, verb), accepts, reply)


TRAINER_GROUP = Service(
    name="trainer-group",
    summary="Run one trainer group worker.",
    runs="group",
    role="trainer",
    config=TrainerGroupConfig,
    setup="belayer_rl.services.trainer_group.service:setup",
    listens={
        "update": group_call("update", p.ActorUpdate, p.ActorUpdated),  # the actor
        "logprobs": group_call("logprobs", p.RefLogprobsRequest, p.RefLogprobs),  # the reference
        "reward": group_call("reward", p.RewardRequest, p.Rewards),  # the reward
    },
    publishes=(
        event("group_heartbeat", lambda x: x.run),
        lambda s, x: s.weights_publish,
        lambda s, x: object_put(s.weights_object_bucket),
        lambda s, x: STREAM_NAMES,
    ),
    reads=(lambda s: object_stream(s.weights_object_bucket),),
    scopes=lambda config: (Scope(run=config.run, group=config.group, rank=str(config.rank)),),
    process=lambda x: f"trainer-{x.group}-{x.rank}",
    stats=lambda x: f"trainer.{x.group}.{x.rank}",  # the trainer's credential answers for every rank
)
