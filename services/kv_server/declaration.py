"""The KV server, declared (shared/declaration.py): one per host, it owns the engines' KV-cache
arenas in shared memory. A flush must name the engine's current epoch: it reads the registry."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import KvServerConfig
from belayer_rl.shared.declaration import Compose, Deployment, Listen, Planned, Service, Variable, kv_stream


def up(cluster: Deployment) -> list[Planned]:
    if not cluster.shadows or cluster.engine_kind != "builtin":  # the workers keep their own caches
        return []
    settings = cluster.settings(KvServerConfig, "kv-server") | {"shm_prefix": cluster.shm_prefix}
    return [Planned("kv-server", KvServerConfig(**settings))]


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
    compose=Compose(
        uid=2003,
        args=("--shm-prefix", "belayer"),
        groups=("shadow-supervisor",),  # each engine's own group: an arena is shared with its engine alone
        shares_namespaces="""each engine's KV arena is its segment in /dev/shm, which the engine maps (576 MiB
an engine at base: 12 layers x K,V x 512 blocks x 16 slots x 768 x 4 bytes, for the shadow
supervisor's default --num-blocks). Two engines and two weight versions at base need 1,816 MiB,
under the default BELAYER_SHM_SIZE; add 576m per engine beyond two. tmpfs holds only what is
written, so an unused limit costs nothing.""",
        variables={"BELAYER_SHM_SIZE": Variable("2g", "the /dev/shm the servers and engines share")},
    ),
    up=up,
)
