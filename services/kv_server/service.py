"""The kv server as a service: what it listens to and what it starts; `setup` is what
the runtime runs (shared/runtime.py).

Stopping removes every arena segment; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

from belayer_rl.services.kv_server.server import KvServer
from belayer_rl.shared.config import KvServerConfig
from belayer_rl.shared.protocol import KvArenaRequest, KvFlush, KvRelease, ServerPing
from belayer_rl.shared.runtime import Endpoint, Runtime


async def setup(rt: Runtime, config: KvServerConfig) -> None:
    server = KvServer(config)
    rt.on_close(server.close)  # closed after every handler: nothing stays in /dev/shm
    await rt.connect()
    await rt.serve(
        Endpoint(rt.subjects.kv_arena, KvArenaRequest, server.on_arena),
        Endpoint(rt.subjects.kv_flush, KvFlush, server.on_flush),
        Endpoint(rt.subjects.kv_release, KvRelease, server.on_release),
        Endpoint(rt.subjects.kv_ping, ServerPing, server.on_ping),
    )
    rt.ready(f"{server.instance} serving from {server.lock.prefix}* ({server.device})")
