"""Checkpoint folders in a JetStream object store, so that another host can restore them.

A ready folder is packed as a plain tar of its files and uploaded under `<trajectory>/<id>` in the
background after the checkpoint is ready. A host asked to restore a trajectory whose pointer names
another host downloads the pointed folder, at most --max-download-gb of it, unpacks it into a
staging folder (regular files and directories only, none sparse, created without following links)
and verifies it against its authenticated manifest before it is published in the local store. Nothing else changes: the folder is the same format whether copied by hand or fetched here.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tarfile
from pathlib import Path
from typing import BinaryIO

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore

from belayer_rl.services.checkpointer import layer
from belayer_rl.services.checkpointer.store import TMP_PREFIX, CorruptCheckpoint, Store
from belayer_rl.shared import bus
from belayer_rl.shared.subjects import Subjects

MAX_BYTES = 4 << 30  # bounded: an upload into a full bucket fails and is logged


async def declare(js: JetStreamContext, names: Subjects, replicas: int = 1) -> ObjectStore:
    return await bus.object_store(js, names.checkpoint_object_bucket, MAX_BYTES, replicas)


def object_name(trajectory: str, checkpoint_id: str) -> str:
    return f"{trajectory}/{checkpoint_id}"


def pack(folder: Path, out: Path) -> None:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(folder.rglob("*")):
            if not (path.is_file() or path.is_dir()) or path.is_symlink():
                raise CorruptCheckpoint(f"{folder.name}: {path.name} is neither a file nor a folder")
            tar.add(path, str(path.relative_to(folder)), recursive=False)


def unpack(archive: Path, store: Store, trajectory: str, checkpoint_id: str) -> Path:
    """Install a downloaded folder into the store, or raise CorruptCheckpoint / HostileLayer."""
    entries = layer.check(archive, max_bytes=archive.stat().st_size)  # unpacks to no more than it is
    if any(not (e.member.isreg() or e.member.isdir()) or e.member.sparse is not None for e in entries):
        raise CorruptCheckpoint(f"{checkpoint_id}: the download holds links, devices or sparse files")
    staging = store.staging(trajectory, checkpoint_id)
    try:
        layer.install(archive, entries, staging)
        manifest = store.verify(staging)
        if manifest.checkpoint_id != checkpoint_id or manifest.trajectory != trajectory:
            raise CorruptCheckpoint(f"{checkpoint_id}: the download is checkpoint {manifest.checkpoint_id}")
        return store.publish(staging, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


async def upload(obs: ObjectStore, folder: Path, trajectory: str) -> None:
    packed = folder.parent / f"{TMP_PREFIX}up-{folder.name}.tar"
    try:
        await asyncio.to_thread(pack, folder, packed)
        with packed.open("rb") as f:
            await obs.put(object_name(trajectory, folder.name), f)
    finally:
        packed.unlink(missing_ok=True)


class TooBig(CorruptCheckpoint):
    """The object is larger than this host accepts."""


class _Bounded:
    """A file that refuses to grow past `limit` bytes: the object store's own size is not trusted."""

    def __init__(self, file: BinaryIO, limit: int, name: str) -> None:
        self.file, self.limit, self.name, self.written = file, limit, name, 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        if self.written > self.limit:
            raise TooBig(f"{self.name}: the download passes {self.limit} bytes")
        return self.file.write(data)


async def download(
    obs: ObjectStore, store: Store, trajectory: str, checkpoint_id: str, max_bytes: int
) -> Path:
    """Fetch the folder into the local store, refusing one larger than `max_bytes` (TooBig); raise
    nats.js.errors.ObjectNotFoundError when absent."""
    name = object_name(trajectory, checkpoint_id)
    info = await obs.get_info(name)
    if info.is_link():  # the client would follow it into another bucket, unbounded and into memory
        raise CorruptCheckpoint(f"{name}: a link to another object, not a checkpoint")
    if (info.size or 0) > max_bytes:
        raise TooBig(f"{name}: {info.size} bytes, more than the {max_bytes} this host accepts")
    folder = store.trajectory_dir(trajectory)
    folder.mkdir(parents=True, exist_ok=True)
    packed = folder / f"{TMP_PREFIX}down-{checkpoint_id}.tar"
    try:
        with packed.open("wb") as f:
            # nats-py types `writeinto` as a BufferedWriter; it only calls write(), which _Bounded has.
            await obs.get(name, writeinto=_Bounded(f, max_bytes, name))  # type: ignore[arg-type]
        return await asyncio.to_thread(unpack, packed, store, trajectory, checkpoint_id)
    finally:
        packed.unlink(missing_ok=True)


async def delete_trajectory(obs: ObjectStore, trajectory: str) -> None:
    with contextlib.suppress(nats.js.errors.NotFoundError):
        for info in await obs.list():
            if info.name.startswith(f"{trajectory}/"):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await obs.delete(info.name)
