"""The weight versions a worker serves when it maps them from the weight server.

Each version the engine holds is pinned at the weight server under this worker's holder id, so the
server cannot free it while a request runs on it. The engine's current version (what a request
naming none runs on) follows the newest published version; a request naming another version gets
it mapped and pinned on demand. A version no queued or running sequence uses, other than the
current one, is dropped and unpinned between steps, so old versions can be freed as a trainer
moves on. Mapping is zero-copy (shared/segments.py); the server owns the memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from nats.aio.client import Client as NATS

from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.services.worker.engine import Engine
from belayer_rl.shared import segments
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import WeightHandles, WeightsPublished
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.worker")

PIN_TIMEOUT_S = 10.0  # a pin maps nothing, but a big version may still be loading on the server


class PinnedWeights:
    def __init__(self, nc: NATS, engine_id: str, subjects: Subjects) -> None:
        self.client = WeightClient(nc, PIN_TIMEOUT_S, subjects=subjects)
        self.engine_id = engine_id
        self.holder = f"{engine_id}:{os.getpid()}"
        self.engine: Engine | None = None
        # Held while a version is pinned and mapped, or checked and unpinned: two requests for one
        # version map it once, and an unpin never undoes the pin of a version mapped again.
        self.mapping = asyncio.Lock()
        # Once the engine serves, only its scheduling loop drops versions, between steps.
        self.serving = False
        self.unpins: set[asyncio.Task[None]] = set()  # off the scheduling loop; awaited at close

    async def pin(self, version: str | None) -> WeightHandles:
        """Pin `version` (None: the newest) for this worker; its handles, to map."""
        return await self.client.pin(self.engine_id, self.holder, os.getpid(), version)

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    async def ensure(self, version: str | None) -> str:
        """Make the engine hold `version` (None: the newest): pin and map it unless it does; the
        version. ServiceError with code "unknown-version" when the weight server has no such one."""
        assert self.engine is not None
        async with self.mapping:
            if version is not None and version in self.engine.weights:
                return version
            handles = await self.pin(version)
            if handles.version not in self.engine.weights:
                try:
                    # The server's GPU copy only for an engine on the GPU: a cold worker's own
                    # arena is on the CPU, and maps the CPU segment of the same version.
                    on_gpu = self.engine.device.type == "cuda"
                    params = await asyncio.to_thread(segments.map_weights, handles, on_gpu)
                except Exception:
                    with contextlib.suppress(ServiceError):
                        await self.client.unpin(self.engine_id, handles.version, self.holder)
                    raise
                self.engine.add_weights(handles.version, params)  # a step in flight never sees it
                log.info("mapped weight version %s", handles.version)
            return handles.version

    async def follow(self, _: WeightsPublished | None = None) -> None:
        """Make the newest version current, as the weight server says (a publication event is only
        a hint to ask), and let go of the old one unless requests use it."""
        assert self.engine is not None
        try:
            newest = await self.ensure(None)
        except ServiceError as exc:  # the server is restarting: the next publication retries
            log.warning("did not follow the newest weight version: %s", exc)
            return
        self.engine.weight_version = newest
        if not self.serving:
            self.release_unused(keep=set())

    def release_unused(self, keep: set[str]) -> None:
        """Drop every version no sequence uses and that is not in `keep` (the versions of
        dispatches not yet submitted); unpin them in the background. A serving engine calls this
        between steps only; it never waits, so the scheduling loop never waits on the network."""
        assert self.engine is not None
        for version in self.engine.unused_versions():
            if version not in keep:
                self.engine.drop_weights(version)
                task = asyncio.create_task(self._unpin(version))
                self.unpins.add(task)
                task.add_done_callback(self.unpins.discard)

    async def _unpin(self, version: str) -> None:
        assert self.engine is not None
        async with self.mapping:
            if version in self.engine.weights:
                return  # mapped again since it was dropped: the pin is in use
            try:
                await self.client.unpin(self.engine_id, version, self.holder)
            except ServiceError as exc:  # the server's sweep drops our pin when we exit anyway
                log.warning("unpin of %s failed: %s", version, exc)
                return
            log.info("released weight version %s", version)

    async def close(self) -> None:
        for task in list(self.unpins):
            task.cancel()
        await asyncio.gather(*self.unpins, return_exceptions=True)
