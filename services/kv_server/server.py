"""The kv-server: owns each engine's KV-cache block arena, one shared-memory segment per engine.

The arena outlives the worker that fills it: the main worker and its shadow map the same segment
(shared/segments.py `map_arena`), and after a handover the new worker flushes it here before
reuse. Creation is idempotent per engine and a different shape for an engine that has one is
refused, so two workers of an engine can never disagree about the layout. On a GPU the arena is
a device buffer exported as a CUDA IPC handle, and the segment holds only its header.

One writer, whatever dies (invariant 8). Every process an arena is handed to is a holder, tracked
by a pidfd until the kernel says it exited. The arena goes to a main only when no earlier holder
lives, and is zeroed first when one ever held it; to a shadow only when the sole live holder is the
main it stands behind. So a stopped main that outlived its supervisor, or one whose kill could not
be confirmed, keeps every later worker off its arena (they take the cold path, with their own).
A flush names the engine and the epoch whose main died: it is refused unless that is the
registry's current epoch and its worker is no live holder, so a late or forged flush cannot zero
the arena under a main that serves.

Knows nothing about blocks, sequences or tokens: an arena is bytes of a known shape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import select
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from nats.js.kv import KeyValue

from belayer_rl.shared import registry, segments
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import KvServerConfig, placement
from belayer_rl.shared.presets import PRESETS, arena_shape
from belayer_rl.shared.protocol import (
    Ack,
    ArenaHandle,
    KvArenaRequest,
    KvFlush,
    KvRelease,
    KvServerAlive,
    ServerPing,
)
from belayer_rl.shared.subjects import sender

log = logging.getLogger("belayer.kv_server")

REGISTRY_TIMEOUT_S = 1.5  # a flush's registry read; the supervisor gives the whole flush 2 s

# ---------------------------------------------------------------------------- config


# ---------------------------------------------------------------------------- state


def same_engine(claimed: str, subject: str, what: str) -> None:
    """The engine is the subject's last token, on which the bus lets only that engine's own
    credential (its workers, or its shadow supervisor) publish; the payload must agree."""
    engine_id = sender(subject)
    if claimed != engine_id:
        raise ServiceError("bad-request", f"{what} for {claimed!r} asked on {engine_id!r}'s subject")


def sharing_group(pid: int) -> int | None:
    """The group through which the engine's worker `pid` maps its arena: None when it runs as this
    server's own uid (the arena stays 0600); otherwise its group, of which this server must be a
    member (under Compose each engine runs as a uid and group of its own, and the KV server holds
    each engine's group, compose.yaml). Neither another engine's uid nor its group can open it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        raise ServiceError("dead-holder", f"pid {pid} is not a live process on this host") from None
    ids = {
        line.split(":")[0]: line.split()[1:]
        for line in status.splitlines()
        if line.startswith(("Uid:", "Gid:"))
    }
    uid, gid = int(ids["Uid"][1]), int(ids["Gid"][1])  # effective ids
    if uid == os.geteuid():
        return None
    if gid != os.getegid() and gid not in os.getgroups():
        raise ServiceError(
            "no-access",
            f"pid {pid} runs as uid {uid}, gid {gid}: the KV server (uid {os.geteuid()}) is not in"
            f" group {gid}, so that worker could not open the arena; give the KV server that group",
        )
    return gid


def exited(pidfd: int) -> bool:
    """Whether the process behind `pidfd` has exited (a pidfd polls readable from then on)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


@dataclass
class Arena:
    handle: ArenaHandle
    segment: segments.Segment
    gpu: torch.Tensor | None = None  # uint8 [size] on the GPU, laid out like the segment
    holders: dict[int, int] = field(default_factory=dict)  # pid -> pidfd, until it exited
    held: bool = False  # handed to a process since it was last zeroed

    def live_holders(self) -> set[int]:
        """The holders still alive; those that exited are dropped."""
        for pid, pidfd in list(self.holders.items()):
            if exited(pidfd):
                os.close(pidfd)
                del self.holders[pid]
        return set(self.holders)

    def forget_holders(self) -> None:
        for pidfd in self.holders.values():
            os.close(pidfd)
        self.holders.clear()

    def zero(self) -> None:
        """Write zeros over every byte of the arena (and wait for the device to finish)."""
        if self.gpu is not None:
            self.gpu.zero_()
            torch.cuda.synchronize(self.gpu.device)
        else:
            self.segment.tensors["arena"].zero_()


class KvServer:
    """State lives on the event loop; creating and zeroing arenas run in threads, one at a time."""

    def __init__(self, config: KvServerConfig, registry_kv: Callable[[], Awaitable[KeyValue]]) -> None:
        self.config = config
        self.registry_kv = registry_kv  # the engine registry, looked up when a flush needs it
        self.device = placement(config.device)  # "auto" decided here, in the server's own process
        self.instance = secrets.token_hex(8)
        self.lock = segments.PrefixLock(f"{config.shm_prefix}.kv.")
        if self.lock.removed:
            log.warning(
                "removed %d segments left by an earlier instance: %s",
                len(self.lock.removed),
                self.lock.removed,
            )
        self.arenas: dict[str, Arena] = {}
        self._serial = 0
        self._busy = asyncio.Lock()  # arena creation, flush and release never overlap

    def build(self, request: KvArenaRequest, serial: int) -> Arena:
        """A zeroed arena for `request`; runs in a thread, touches no state."""
        shape = arena_shape(PRESETS[request.preset], request.num_blocks, request.block_size)
        on_gpu = self.device == "cuda"
        manifest = segments.plan("kv", request.engine_id, self.instance, [("arena", shape, torch.float32)])
        # The name carries the instance and a serial: a handle of a dead instance, or of a released
        # arena, never maps the arena that replaced it.
        name = f"{self.config.shm_prefix}.kv.{self.instance}.{serial}.{request.engine_id}"
        group = sharing_group(request.pid)
        mode = 0o600 if group is None else 0o660
        segment = segments.Segment(name, manifest, reserve=not on_gpu, mode=mode, group=group)
        try:
            gpu, cuda = None, None
            if on_gpu:
                gpu = torch.zeros(manifest.size, dtype=torch.uint8, device="cuda")
                cuda = segments.export_cuda(gpu)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        handle = ArenaHandle(
            engine_id=request.engine_id,
            preset=request.preset,
            num_blocks=request.num_blocks,
            block_size=request.block_size,
            segment=name,
            manifest=manifest,
            cuda=cuda,
        )
        return Arena(handle=handle, segment=segment, gpu=gpu)

    def get(self, engine_id: str) -> Arena:
        arena = self.arenas.get(engine_id)
        if arena is None:
            raise ServiceError("unknown-engine", f"no arena for engine {engine_id!r}")
        return arena

    def free(self, engine_id: str) -> None:
        arena = self.arenas.pop(engine_id)
        arena.forget_holders()
        arena.segment.unlink()
        arena.segment.close()
        arena.gpu = None
        log.info("freed the arena of %s (%s)", engine_id, arena.segment.name)

    def close(self) -> None:
        """Free every arena and leave nothing in /dev/shm."""
        for engine_id in list(self.arenas):
            self.free(engine_id)
        self.lock.release()

    # ------------------------------------------------------------------ handlers

    async def on_arena(self, request: KvArenaRequest, subject: str) -> ArenaHandle:
        same_engine(request.engine_id, subject, "an arena")
        if request.preset not in PRESETS:
            raise ServiceError("unknown-preset", f"preset {request.preset!r}; one of {list(PRESETS)}")
        async with self._busy:
            existing = self.arenas.get(request.engine_id)
            if existing is not None:
                h = existing.handle
                if (h.preset, h.num_blocks, h.block_size) != (
                    request.preset,
                    request.num_blocks,
                    request.block_size,
                ):
                    raise ServiceError(
                        "shape-mismatch",
                        f"engine {request.engine_id} has an arena of {h.num_blocks} blocks of "
                        f"{h.block_size} for {h.preset}",
                    )
                await self.hand_to(existing, request)
                return h
            shape = arena_shape(PRESETS[request.preset], request.num_blocks, request.block_size)
            nbytes = math.prod(shape) * 4
            if nbytes > self.config.max_arena_bytes:
                raise ServiceError(
                    "too-large", f"an arena of {nbytes} bytes exceeds {self.config.max_arena_bytes}"
                )
            try:
                self._serial += 1
                arena = await asyncio.to_thread(self.build, request, self._serial)
            except OSError as exc:  # /dev/shm (or the GPU) is full
                raise ServiceError("no-space", f"cannot hold {nbytes} bytes: {exc}") from None
            self.arenas[request.engine_id] = arena
            log.info("arena of %s: %s in %s", request.engine_id, shape, arena.segment.name)
            await self.hand_to(arena, request)
            return arena.handle

    async def hand_to(self, arena: Arena, request: KvArenaRequest) -> None:
        """Record the asker as a holder, if the arena may be its (see the module's docstring)."""
        try:
            pidfd = os.pidfd_open(request.pid)
        except (ProcessLookupError, OSError):
            raise ServiceError(
                "dead-holder", f"pid {request.pid} is not a live process on this host"
            ) from None
        try:
            others = arena.live_holders() - {request.pid}
            allowed = {request.watch_pid} if request.watch_pid else set()
            if others - allowed:
                raise ServiceError(
                    "holder-alive",
                    f"engine {request.engine_id}'s arena is held by live pid(s) {sorted(others - allowed)};"
                    " nobody else gets it before their death is confirmed",
                )
            if not request.watch_pid and arena.held and not others:
                await asyncio.to_thread(arena.zero)  # a new main: nothing of a dead one's survives
        except BaseException:
            os.close(pidfd)
            raise
        previous = arena.holders.pop(request.pid, None)
        if previous is not None:
            os.close(previous)
        arena.holders[request.pid] = pidfd
        arena.held = True

    async def on_flush(self, request: KvFlush, subject: str) -> Ack:
        same_engine(request.engine_id, subject, "a flush")
        self.get(request.engine_id)  # an unknown engine is told so before the registry is asked
        try:  # outside the lock: a slow bus must not hold up other engines' arena requests
            async with asyncio.timeout(REGISTRY_TIMEOUT_S):
                entry, _ = await registry.read(await self.registry_kv(), request.engine_id)
        except TimeoutError:
            raise ServiceError("unavailable", "the engine registry did not answer: nothing flushed") from None
        async with self._busy:
            arena = self.get(request.engine_id)
            current = entry.epoch if entry is not None else 0
            if request.epoch != current:
                raise ServiceError(
                    "stale-epoch",
                    f"flush for epoch {request.epoch} of {request.engine_id}, which is at {current}: refused",
                )
            if entry is not None and entry.pid in arena.live_holders():
                raise ServiceError(
                    "holder-alive", f"epoch {current}'s worker, pid {entry.pid}, is alive and holds the arena"
                )
            await asyncio.to_thread(arena.zero)
            arena.held = bool(arena.live_holders())  # a shadow about to be promoted writes next
        return Ack(detail=f"zeroed {arena.handle.manifest.tensors[0].nbytes} bytes")

    async def on_release(self, request: KvRelease) -> Ack:
        async with self._busy:
            if live := self.get(request.engine_id).live_holders():  # its memory could be reused
                raise ServiceError(
                    "holder-alive", f"engine {request.engine_id}'s arena is held by {sorted(live)}"
                )
            self.free(request.engine_id)
        return Ack(detail="released")

    async def on_ping(self, _: ServerPing) -> KvServerAlive:
        return KvServerAlive(
            pid=os.getpid(),
            instance=self.instance,
            engines=sorted(self.arenas),
            device=self.device,
            segments={engine_id: arena.segment.name for engine_id, arena in sorted(self.arenas.items())},
        )
