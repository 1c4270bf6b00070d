"""A typed client of the kv-server. Each call is one request on `belayer.<cluster>.kv.<verb>`; failures
arrive as ServiceError with the server's code ("unknown-engine", "shape-mismatch",
"unknown-preset", "too-large", "no-space", "holder-alive", "dead-holder", "stale-epoch") or the
bus's ("timeout", "no-responders")."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from belayer_rl.shared import bus
from belayer_rl.shared.protocol import (
    Ack,
    ArenaHandle,
    KvArenaRequest,
    KvFlush,
    KvRelease,
    KvServerAlive,
    ServerPing,
)
from belayer_rl.shared.subjects import Subjects


class KvClient:
    def __init__(self, nc: NATS, timeout_s: float = 5.0, *, subjects: Subjects = Subjects()) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout_s = timeout_s

    async def ping(self, timeout_s: float | None = None) -> KvServerAlive:
        return await bus.request_struct(
            self.nc, self.subjects.kv_ping, ServerPing(), KvServerAlive, timeout_s or self.timeout_s
        )

    async def arena(
        self, engine_id: str, preset: str, num_blocks: int, block_size: int, *, pid: int,
        watch_pid: int = 0, timeout_s: float = 60.0,
    ) -> ArenaHandle:  # fmt: skip
        """The engine's arena handle for process `pid` (a shadow: behind main `watch_pid`): created
        zeroed on the first call (which may take a while for a big arena: every page is allocated),
        the same one after."""
        request = KvArenaRequest(
            engine_id=engine_id, preset=preset, num_blocks=num_blocks, block_size=block_size, pid=pid,
            watch_pid=watch_pid,
        )  # fmt: skip
        return await bus.request_struct(
            self.nc, self.subjects.kv_arena(engine_id), request, ArenaHandle, timeout_s
        )

    async def flush(self, engine_id: str, epoch: int, timeout_s: float = 30.0) -> Ack:
        """Zero the engine's arena after epoch `epoch`'s main died; returns once every byte is written."""
        flush = KvFlush(engine_id=engine_id, epoch=epoch)
        return await bus.request(self.nc, self.subjects.kv_flush(engine_id), flush, timeout_s)

    async def release(self, engine_id: str) -> Ack:
        return await bus.request(
            self.nc, self.subjects.kv_release, KvRelease(engine_id=engine_id), self.timeout_s
        )

    async def why_not_owned(self, handle: ArenaHandle, timeout_s: float | None = None) -> str | None:
        """None if the server that made `handle` still answers and still owns that arena; else why
        not. A restarted kv-server answers pings too, but the arena mapped from its predecessor is
        an orphan (unlinked): reuse must check the instance."""
        try:
            alive = await self.ping(timeout_s)
        except bus.ServiceError as exc:
            return f"kv-server not answering ({exc.code})"
        if alive.instance != handle.manifest.instance:
            return f"kv-server restarted (instance {handle.manifest.instance} -> {alive.instance})"
        if alive.segments.get(handle.engine_id) != handle.segment:
            return f"the arena of {handle.engine_id} was released ({handle.segment} is gone)"
        return None
