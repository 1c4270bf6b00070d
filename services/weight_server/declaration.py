"""The weight server, declared (shared/declaration.py): one per host, it owns the weight versions
in shared memory that the host's engines map, and the bucket trainers send new versions through."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import WeightServerConfig
from belayer_rl.shared.declaration import STREAM_NAMES, Listen, Service, event, object_put, object_stream

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
)
