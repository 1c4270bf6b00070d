"""The weight server as a service: what it listens to and what it starts; `setup` is what
the runtime runs (shared/runtime.py).

Stopping removes every segment it made; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

from belayer_rl.services.weight_server.server import WeightServer
from belayer_rl.shared import bus
from belayer_rl.shared.config import WeightServerConfig
from belayer_rl.shared.protocol import (
    ServerPing,
    WeightsHandlesRequest,
    WeightsList,
    WeightsPin,
    WeightsPublish,
    WeightsUnpin,
)
from belayer_rl.shared.runtime import Endpoint, Runtime

WEIGHTS_BUCKET_BYTES = 8 << 30  # weights in transit from trainers; each is deleted once loaded


async def setup(rt: Runtime, config: WeightServerConfig) -> None:
    server = WeightServer(config)
    rt.on_close(server.close)  # closed after every handler: nothing stays in /dev/shm
    await server.load_initial()
    server.nc = await rt.connect()
    server.objects = await bus.with_retries(
        "declare the weights bucket",
        lambda: bus.object_store(
            server.nc.jetstream(), rt.subjects.weights_object_bucket, WEIGHTS_BUCKET_BYTES
        ),
    )
    await rt.serve(
        Endpoint(rt.subjects.weights_list, WeightsList, server.on_list),
        Endpoint(rt.subjects.weights_handles, WeightsHandlesRequest, server.on_handles),
        Endpoint(rt.subjects.weights_pins, WeightsPin, server.on_pin, with_subject=True),
        Endpoint(rt.subjects.weights_unpins, WeightsUnpin, server.on_unpin, with_subject=True),
        Endpoint(rt.subjects.weights_publish, WeightsPublish, server.on_publish),
        Endpoint(rt.subjects.weights_ping, ServerPing, server.on_ping),
    )
    rt.every(config.sweep_interval_s, server.sweep, "sweep")  # pins of dead holders
    rt.ready(f"{server.instance} serving {server.newest} from {server.lock.prefix}* ({server.device})")
