"""The weight server, declared (shared/declaration.py): one per host, it owns the weight versions
in shared memory that the host's engines map, and the bucket trainers send new versions through."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import WeightServerConfig
from belayer_rl.shared.declaration import (
    STREAM_NAMES,
    Compose,
    Deployment,
    Listen,
    Planned,
    Service,
    Variable,
    event,
    object_put,
    object_stream,
)


def up(cluster: Deployment) -> list[Planned]:
    if not cluster.shadows or cluster.engine_kind != "builtin":  # the workers load their own weights
        return []
    settings = cluster.settings(WeightServerConfig, "weight-server") | {"shm_prefix": cluster.shm_prefix}
    return [Planned("weight-server", WeightServerConfig(**settings))]


WEIGHT_SERVER = Service(
    name="weight-server",
    summary="Own this host's weight versions in shared memory.",
    runs="host",
    config=WeightServerConfig,
    setup="belayer_rl.services.weight_server.service:setup",
    listens={
        "list": Listen(lambda s, x: s.weights_list, p.WeightsList, p.WeightVersions),
        "handles": Listen(lambda s, x: s.weights_handles, p.WeightsHandlesRequest, p.WeightHandles),
        "pin": Listen(lambda s, x: s.weights_pins, p.WeightsPin, p.WeightHandles, with_subject=True),
        "unpin": Listen(lambda s, x: s.weights_unpins, p.WeightsUnpin, p.Ack, with_subject=True),
        "publish": Listen(lambda s, x: s.weights_publish, p.WeightsPublish, p.WeightHandles),
        "ping": Listen(lambda s, x: s.weights_ping, p.ServerPing, p.WeightServerAlive),
    },
    publishes=(
        event("weights_published"),
        lambda s, x: object_put(s.weights_object_bucket),
        lambda s, x: STREAM_NAMES,
    ),
    owns=(lambda s: object_stream(s.weights_object_bucket),),  # declared here; it deletes what it loaded
    compose=Compose(
        uid=2002,
        note="its weight segments are mode 0640: the engines hold its group",
        args=(
            "--shm-prefix",
            "belayer",
            "--preset",
            "$BELAYER_MODEL",
            "--weights-seed",
            "$BELAYER_WEIGHTS_SEED",
        ),
        variables={
            "BELAYER_MODEL": Variable("tiny", "the model preset the weight server and the engines load"),
            "BELAYER_WEIGHTS_SEED": Variable("0", "the seed of the first weights"),
        },
        shares_namespaces="""its weight versions are segments in /dev/shm that the engines map (the largest
preset, base, 87,037,440 parameters, takes 332 MiB of fp32 weights a version; two versions live
while a new one is published and the old one still pinned); it checks that a pin's holder, a
worker's pid, still lives.""",
    ),
    up=up,
)
