"""The KV server, declared (shared/declaration.py): one per host, it owns the engines' KV-cache
arenas in shared memory. A flush must name the engine's current epoch: it reads the registry."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import KvServerConfig
from belayer_rl.shared.declaration import Listen, Service, kv_stream

KV_SERVER = Service(
    name="kv-server",
    summary="Own this host's KV-cache arenas in shared memory.",
    runs="host",
    config=KvServerConfig,
    setup="belayer_rl.services.kv_server.service:setup",
    listens={
        "arena": Listen(lambda s, x: s.kv_arenas, p.KvArenaRequest, p.ArenaHandle, with_subject=True),
        "flush": Listen(lambda s, x: s.kv_flushes, p.KvFlush, p.Ack, with_subject=True),
        "release": Listen(lambda s, x: s.kv_release, p.KvRelease, p.Ack),
        "ping": Listen(lambda s, x: s.kv_ping, p.ServerPing, p.KvServerAlive),
    },
    reads=(lambda s: kv_stream(s.engine_registry_bucket),),
)
