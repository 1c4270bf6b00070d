"""A typed client of the weight server: what workers, a shadow supervisor and a trainer call. Each
call is one request on `belayer.<cluster>.weights.<verb>`; failures arrive as ServiceError with the server's
code ("unknown-version", "dead-holder", "bad-weights", "no-space") or the bus's ("timeout",
"no-responders")."""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path

from nats.aio.client import Client as NATS

from belayer_rl.shared import bus
from belayer_rl.shared.params import Params, save_params
from belayer_rl.shared.protocol import (
    Ack,
    ServerPing,
    WeightHandles,
    WeightServerAlive,
    WeightsHandlesRequest,
    WeightsList,
    WeightsPin,
    WeightsPublish,
    WeightsUnpin,
    WeightVersions,
)
from belayer_rl.shared.subjects import Subjects


class WeightClient:
    def __init__(self, nc: NATS, timeout_s: float = 5.0, *, subjects: Subjects = Subjects()) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout_s = timeout_s

    async def ping(self, timeout_s: float | None = None) -> WeightServerAlive:
        return await bus.request_struct(
            self.nc, self.subjects.weights_ping, ServerPing(), WeightServerAlive, timeout_s or self.timeout_s
        )

    async def versions(self) -> WeightVersions:
        return await bus.request_struct(
            self.nc, self.subjects.weights_list, WeightsList(), WeightVersions, self.timeout_s
        )

    async def handles(self, version: str | None = None) -> WeightHandles:
        """Handles of `version` (None: the newest), without pinning: it may be freed before it is mapped."""
        request = WeightsHandlesRequest(version=version)
        return await bus.request_struct(
            self.nc, self.subjects.weights_handles, request, WeightHandles, self.timeout_s
        )

    async def pin(self, engine_id: str, holder: str, pid: int, version: str | None = None) -> WeightHandles:
        """Pin `version` (None: the newest) for `holder`, a live process `pid` on this host serving
        `engine_id`, and return its handles: pin, then map_weights, and the version cannot vanish
        in between."""
        request = WeightsPin(version=version, holder=holder, pid=pid)
        return await bus.request_struct(
            self.nc, self.subjects.weights_pin(engine_id), request, WeightHandles, self.timeout_s
        )

    async def unpin(self, engine_id: str, version: str, holder: str) -> Ack:
        request = WeightsUnpin(version=version, holder=holder)
        return await bus.request(self.nc, self.subjects.weights_unpin(engine_id), request, self.timeout_s)

    async def publish(self, path: Path, timeout_s: float = 120.0) -> WeightHandles:
        """Load the weights file at `path` (absolute, on the server's host) as the newest version."""
        request = WeightsPublish(path=str(path))
        return await bus.request_struct(
            self.nc, self.subjects.weights_publish, request, WeightHandles, timeout_s
        )

    async def publish_params(self, params: Params, timeout_s: float = 120.0) -> WeightHandles:
        """Publish `params` as the newest version over the bus: the file travels through the
        weights bucket, so the caller and the server need not share a disk."""
        objects = await self.nc.jetstream().object_store(self.subjects.weights_object_bucket)
        with tempfile.TemporaryDirectory(prefix="belayer-publish-") as folder:
            path = Path(folder) / "weights.pt"
            version = await asyncio.to_thread(save_params, params, path)
            name = f"{version.replace(':', '-')}-{uuid.uuid4().hex[:8]}"
            with path.open("rb") as f:
                await objects.put(name, f)
        request = WeightsPublish(object_name=name)
        return await bus.request_struct(
            self.nc, self.subjects.weights_publish, request, WeightHandles, timeout_s
        )

    async def why_not_owned(self, handles: WeightHandles, timeout_s: float | None = None) -> str | None:
        """None if the server that made `handles` still answers and still holds that version; else
        why not. A restarted server answers pings too, but the segments a worker mapped from its
        predecessor are orphans (unlinked) and its pins are gone: reuse must check the instance."""
        try:
            alive = await self.ping(timeout_s)
        except bus.ServiceError as exc:
            return f"weight server not answering ({exc.code})"
        if alive.instance != handles.manifest.instance:
            return f"weight server restarted (instance {handles.manifest.instance} -> {alive.instance})"
        if alive.segments.get(handles.version) != handles.segment:
            return f"weight version {handles.version} was freed ({handles.segment} is gone)"
        return None
