"""The weight server as a service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Stopping removes every segment it made; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

from belayer_rl.services.weight_server.declaration import WEIGHT_SERVER
from belayer_rl.services.weight_server.server import WeightServer
from belayer_rl.shared import bus
from belayer_rl.shared.config import WeightServerConfig
from belayer_rl.shared.runtime import Runtime

WEIGHTS_BUCKET_BYTES = 8 << 30  # weights in transit from trainers; each is deleted once loaded


async def setup(rt: Runtime, config: WeightServerConfig) -> None:
    server = WeightServer(config)
    rt.on_close(server.close)  # closed after every handler: nothing stays in /dev/shm
    await server.load_initial()
    server.nc = nc = await rt.connect()
    server.objects = await bus.with_retries(
        "declare the weights bucket",
        lambda: bus.object_store(nc.jetstream(), rt.subjects.weights_object_bucket, WEIGHTS_BUCKET_BYTES),
    )
    await rt.serve(
        *WEIGHT_SERVER.endpoints(
            rt.subjects,
            config,
            list=server.on_list,
            handles=server.on_handles,
            pin=server.on_pin,
            unpin=server.on_unpin,
            publish=server.on_publish,
            ping=server.on_ping,
        )
    )
    rt.every(config.sweep_interval_s, server.sweep, "sweep")  # pins of dead holders
    rt.ready(f"{server.instance} serving {server.newest} from {server.lock.prefix}* ({server.device})")
