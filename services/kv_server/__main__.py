"""`python -m belayer_rl.services.kv_server`: the kv-server of this host, until SIGTERM/SIGINT.

Stopping removes every arena segment; a start removes those a crashed predecessor with the same
--shm-prefix left behind.
"""

from __future__ import annotations

from belayer_rl.services.kv_server.server import KvServer
from belayer_rl.shared import runtime, subjects
from belayer_rl.shared.config import KvServerConfig, parse_flags
from belayer_rl.shared.protocol import KvArenaRequest, KvFlush, KvRelease, ServerPing
from belayer_rl.shared.runtime import Endpoint, Runtime
from belayer_rl.shared.segments import PrefixBusy


async def setup(rt: Runtime, config: KvServerConfig) -> None:
    server = KvServer(config)
    rt.on_close(server.close)  # runs last: nothing stays in /dev/shm
    await rt.connect()
    await rt.serve(
        Endpoint(subjects.KV_ARENA, KvArenaRequest, server.on_arena),
        Endpoint(subjects.KV_FLUSH, KvFlush, server.on_flush),
        Endpoint(subjects.KV_RELEASE, KvRelease, server.on_release),
        Endpoint(subjects.KV_PING, ServerPing, server.on_ping),
    )
    rt.ready(f"{server.instance} serving from {server.lock.prefix}* ({config.device})")


def main(argv: list[str] | None = None) -> None:
    settings = parse_flags(
        KvServerConfig,
        argv,
        prog="belayer-kv-server",
        description="Own this host's KV-cache arenas in shared memory.",
    )
    runtime.run("kv-server", settings, setup, exits_on=(PrefixBusy,))


if __name__ == "__main__":
    main()
