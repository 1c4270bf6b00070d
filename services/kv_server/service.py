"""The kv server as a service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Stopping removes every arena segment; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

from nats.js.kv import KeyValue

from belayer_rl.services.kv_server.declaration import KV_SERVER
from belayer_rl.services.kv_server.server import KvServer
from belayer_rl.shared import bus
from belayer_rl.shared.config import KvServerConfig
from belayer_rl.shared.runtime import Runtime

REGISTRY_WAIT_S = 2.0  # a flush waits this long for the registry, then fails (the cold path runs)


async def setup(rt: Runtime, config: KvServerConfig) -> None:
    registry_kv: KeyValue | None = None

    async def registry() -> KeyValue:
        """The engine registry, found once the router has declared it (a flush needs it)."""
        nonlocal registry_kv
        if registry_kv is None:
            registry_kv = await bus.engine_registry(nc.jetstream(), rt.subjects, wait_s=REGISTRY_WAIT_S)
        return registry_kv

    server = KvServer(config, registry)
    rt.on_close(server.close)  # closed after every handler: nothing stays in /dev/shm
    nc = await rt.connect()
    await rt.serve(
        *KV_SERVER.endpoints(
            rt.subjects,
            config,
            arena=server.on_arena,
            flush=server.on_flush,
            release=server.on_release,
            ping=server.on_ping,
        )
    )
    rt.ready(f"{server.instance} serving from {server.lock.prefix}* ({server.device})")
