"""The kv-server: owns each engine's KV-cache block arena, one shared-memory segment per engine.

The arena outlives the worker that fills it: the main worker and its shadow map the same segment
(shared/segments.py `map_arena`), and after a handover the new worker flushes it here before
reuse. Creation is idempotent per engine and a different shape for an engine that has one is
refused, so two workers of an engine can never disagree about the layout. On a GPU the arena is
a device buffer exported as a CUDA IPC handle, and the segment holds only its header.

Knows nothing about blocks, sequences or tokens: an arena is bytes of a known shape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
from dataclasses import dataclass

import torch

from belayer_rl.shared import segments
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

log = logging.getLogger("belayer.kv_server")

# ---------------------------------------------------------------------------- config


# ---------------------------------------------------------------------------- state


@dataclass
class Arena:
    handle: ArenaHandle
    segment: segments.Segment
    gpu: torch.Tensor | None = None  # uint8 [size] on the GPU, laid out like the segment

    def zero(self) -> None:
        """Write zeros over every byte of the arena (and wait for the device to finish)."""
        if self.gpu is not None:
            self.gpu.zero_()
            torch.cuda.synchronize(self.gpu.device)
        else:
            self.segment.tensors["arena"].zero_()


class KvServer:
    """State lives on the event loop; creating and zeroing arenas run in threads, one at a time."""

    def __init__(self, config: KvServerConfig) -> None:
        self.config = config
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
        segment = segments.Segment(name, manifest, reserve=not on_gpu)
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

    async def on_arena(self, request: KvArenaRequest) -> ArenaHandle:
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
            return arena.handle

    async def on_flush(self, request: KvFlush) -> Ack:
        async with self._busy:
            arena = self.get(request.engine_id)
            await asyncio.to_thread(arena.zero)
        return Ack(detail=f"zeroed {arena.handle.manifest.tensors[0].nbytes} bytes")

    async def on_release(self, request: KvRelease) -> Ack:
        async with self._busy:
            self.get(request.engine_id)
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
