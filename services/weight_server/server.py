"""The weight server: owns the model weights of one host, one shared-memory segment per version.

It loads or creates the weights once, writes each version into its own segment (see
shared/segments.py for the format) and hands out handles that workers map read-only without a
copy. Holders pin the versions they serve; a version nobody pins, other than the newest, is freed
(its segment unlinked: mappings that still exist stay valid until dropped). Pins carry the
holder's pid, and a periodic sweep drops the pins of processes that died, so a crashed worker
never keeps a version alive. A version is freed only after it has been unneeded (unpinned and not
the newest) for a grace period: a request accepted on it, or resumed after its worker died, gets
there and pins it again before it goes. On a GPU each version is also uploaded once and exported
as a CUDA IPC handle.

Knows nothing about engines or requests: a version is a name and a set of tensors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats.js.errors
import torch
from nats.aio.client import Client as NATS
from nats.js.object_store import ObjectStore

from belayer_rl.shared import bus, segments
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import WeightServerConfig, placement
from belayer_rl.shared.params import Params, check_params, init_params, load_params, seed_version
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import (
    Ack,
    ServerPing,
    WeightHandles,
    WeightServerAlive,
    WeightsHandlesRequest,
    WeightsList,
    WeightsPin,
    WeightsPublish,
    WeightsPublished,
    WeightsUnpin,
    WeightVersionInfo,
    WeightVersions,
)
from belayer_rl.shared.subjects import sender

log = logging.getLogger("belayer.weight_server")

# ---------------------------------------------------------------------------- config


# ---------------------------------------------------------------------------- holders


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process `pid`, or None if it does not exist.

    A pin records it with the pid, so a pid reused by an unrelated process does not keep a
    dead holder's pin alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # a zombie is dead for our purposes
        return None
    return int(fields[19])  # field 22 of stat(5), counted after the comm field


# ---------------------------------------------------------------------------- state


def pin_key(engine_id: str, holder: str) -> str:
    """A holder's name within its engine: one engine can neither count against another's quota
    nor unpin another's pins."""
    return f"{engine_id}:{holder}"


@dataclass
class Pin:
    pid: int
    start: int  # the process's start time: a reused pid is another process


@dataclass
class Version:
    segment: segments.Segment
    handles: WeightHandles
    gpu: torch.Tensor | None = None  # uint8 [size] on the GPU, laid out like the segment
    holders: dict[str, Pin] = field(default_factory=dict)
    unneeded_since: float | None = None  # monotonic; set while unpinned and not the newest

    def info(self) -> WeightVersionInfo:
        return WeightVersionInfo(
            version=self.handles.version,
            segment=self.segment.name,
            size=self.segment.manifest.size,
            holders=sorted(self.holders),
        )


class WeightServer:
    """All state lives on the event loop; only loading and copying run in threads."""

    def __init__(self, config: WeightServerConfig) -> None:
        self.config = config
        self.subjects = config.subjects
        self.device = placement(config.device)  # "auto" decided here, in the server's own process
        self.instance = secrets.token_hex(8)
        self.lock = segments.PrefixLock(f"{config.shm_prefix}.w.")
        if self.lock.removed:
            log.warning(
                "removed %d segments left by an earlier instance: %s",
                len(self.lock.removed),
                self.lock.removed,
            )
        self.versions: dict[str, Version] = {}  # insertion order = publication order
        self.newest = ""
        self._serial = 0
        self._publishing = asyncio.Lock()
        self.nc: NATS | None = None  # set once connected; publish announces on it
        self.objects: ObjectStore | None = None  # the weights bucket, set once connected

    # ------------------------------------------------------------------ versions

    def build(self, params: Params, version: str, serial: int) -> Version:
        """Write `params` into a new segment (and the GPU); runs in a thread, touches no state."""
        check_params(PRESETS[self.config.preset], params)
        specs = [(name, tuple(t.shape), t.dtype) for name, t in params.items()]
        manifest = segments.plan("weights", version, self.instance, specs)
        # Readable by the server's group: under Compose, the engines are its members (each runs as
        # a uid of its own); they map weights read-only.
        segment_name = f"{self.config.shm_prefix}.w.{self.instance}.{serial}"
        segment = segments.Segment(segment_name, manifest, mode=0o640)
        try:
            for name, tensor in params.items():
                segment.tensors[name].copy_(tensor)
            gpu, cuda = None, None
            if self.device == "cuda":
                gpu = segment.buffer.to("cuda")
                cuda = segments.export_cuda(gpu)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        handles = WeightHandles(version=version, segment=segment.name, manifest=manifest, cuda=cuda)
        return Version(segment=segment, handles=handles, gpu=gpu)

    async def add(self, load: Callable[[], tuple[Params, str]]) -> Version:
        """Load (params, version) with `load` in a thread, build its segment, make it the newest."""
        async with self._publishing:
            params, version = await asyncio.to_thread(load)
            if version not in self.versions:
                self._serial += 1
                try:
                    built = await asyncio.to_thread(self.build, params, version, self._serial)
                except OSError as exc:  # /dev/shm full, most likely
                    raise ServiceError("no-space", f"cannot hold version {version}: {exc}") from None
                self.versions[version] = built
                log.info(
                    "version %s in %s (%d bytes)", version, built.segment.name, built.segment.manifest.size
                )
            self.newest = version
            self.collect()
            return self.versions[version]

    async def load_initial(self) -> None:
        c = self.config
        if (path := c.weights_path) is not None:
            await self.add(lambda: load_params(path))
        else:
            await self.add(
                lambda: (
                    init_params(PRESETS[c.preset], c.weights_seed),
                    seed_version(c.weights_seed, c.preset),
                )
            )

    def get(self, version: str | None) -> Version:
        found = self.versions.get(version or self.newest)
        if found is None:
            raise ServiceError("unknown-version", f"no version {version!r}; have {list(self.versions)}")
        return found

    def free(self, version: str) -> None:
        gone = self.versions.pop(version)
        gone.segment.unlink()
        gone.segment.close()
        gone.gpu = None
        log.info("freed version %s (%s)", version, gone.segment.name)

    def collect(self) -> None:
        """Free every version that has been unneeded (no pin, not the newest) for the grace."""
        now = time.monotonic()
        for version, entry in list(self.versions.items()):
            if version == self.newest or entry.holders:
                entry.unneeded_since = None
                continue
            if entry.unneeded_since is None:
                entry.unneeded_since = now
            if now - entry.unneeded_since >= self.config.free_grace_s:
                self.free(version)

    def sweep(self) -> None:
        """Drop the pins of holders whose process is gone, then collect."""
        for version, entry in self.versions.items():
            for holder, pin in list(entry.holders.items()):
                if process_start(pin.pid) != pin.start:
                    del entry.holders[holder]
                    log.warning("dropped pin of %s on %s: pid %d is gone", holder, version, pin.pid)
        self.collect()

    def close(self) -> None:
        """Free everything and leave nothing in /dev/shm."""
        for version in list(self.versions):
            self.free(version)
        self.lock.release()

    # ------------------------------------------------------------------ handlers

    async def on_list(self, _: WeightsList) -> WeightVersions:
        return WeightVersions(newest=self.newest, versions=[v.info() for v in self.versions.values()])

    async def on_handles(self, request: WeightsHandlesRequest) -> WeightHandles:
        return self.get(request.version).handles

    async def on_pin(self, request: WeightsPin, subject: str) -> WeightHandles:
        engine_id = sender(subject)
        entry = self.get(request.version)
        start = process_start(request.pid)
        if start is None:
            raise ServiceError("dead-holder", f"pid {request.pid} is not a live process on this host")
        holder = pin_key(engine_id, request.holder)
        held = sum(key.startswith(f"{engine_id}:") for v in self.versions.values() for key in v.holders)
        if holder not in entry.holders and held >= self.config.max_pins_per_engine:
            raise ServiceError(
                "pin-quota",
                f"engine {engine_id} holds {held} pins, its most (--max-pins-per-engine): unpin one first",
            )
        entry.holders[holder] = Pin(request.pid, start)
        return entry.handles

    async def on_unpin(self, request: WeightsUnpin, subject: str) -> Ack:
        entry = self.get(request.version)
        if entry.holders.pop(pin_key(sender(subject), request.holder), None) is None:
            return Ack(detail="not pinned")
        self.collect()
        return Ack(detail="unpinned")

    async def on_publish(self, request: WeightsPublish) -> WeightHandles:
        """Load a weights file as the newest version: from `path` on this host, or from the object
        `object_name` a trainer put in the weights bucket (deleted once loaded)."""
        if request.object_name:
            try:
                with tempfile.TemporaryDirectory(prefix="belayer-weights-") as folder:
                    path = Path(folder) / "weights.pt"
                    await self.fetch(request.object_name, path)
                    return await self.publish_file(path, request.object_name)
            finally:  # loaded or refused, the object has served: the bucket does not fill up
                await self.forget(request.object_name)
        path = Path(request.path)
        if not path.is_absolute():
            raise ServiceError("bad-weights", f"{request.path} is not an absolute path")
        return await self.publish_file(path, request.path)

    async def forget(self, name: str) -> None:
        if self.objects is None:
            return
        try:
            await self.objects.delete(name)
        except Exception as exc:  # absent (unknown-object), or the bus: a leftover, not an error
            log.info("could not delete weights object %s: %s", name, exc)

    async def fetch(self, name: str, path: Path) -> None:
        if self.objects is None:
            raise ServiceError("unavailable", "this weight server has no connection to the weights bucket")
        try:
            found = await self.objects.get(name)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.NotFoundError):
            raise ServiceError("unknown-object", f"no object {name!r} in the weights bucket") from None
        await asyncio.to_thread(path.write_bytes, found.data or b"")

    async def publish_file(self, path: Path, shown: str) -> WeightHandles:
        previous = self.newest

        def load() -> tuple[Params, str]:
            if not path.is_file():
                raise ServiceError("bad-weights", f"{shown} is not a file")
            try:
                params, version = load_params(path)
                check_params(PRESETS[self.config.preset], params)
            except Exception as exc:
                raise ServiceError("bad-weights", f"{shown}: {type(exc).__name__}: {exc}") from None
            not_finite = [name for name, t in params.items() if not bool(torch.isfinite(t).all())]
            if not_finite:  # a diverged step: the version before it stays the newest
                raise ServiceError("bad-weights", f"{shown}: non-finite values in {not_finite[:3]}")
            return params, version

        entry = await self.add(load)
        handles = entry.handles
        published = WeightsPublished(
            version=handles.version, segment=handles.segment, size=handles.manifest.size, previous=previous
        )
        if self.nc is not None:
            await bus.publish(self.nc, self.subjects.weights_published(handles.version), published)
        return handles

    async def on_ping(self, _: ServerPing) -> WeightServerAlive:
        return WeightServerAlive(
            pid=os.getpid(),
            instance=self.instance,
            newest=self.newest,
            versions=list(self.versions),
            device=self.device,
            segments={version: entry.segment.name for version, entry in self.versions.items()},
        )
