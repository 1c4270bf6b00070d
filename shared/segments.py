"""The shared-memory segment format of the weight and KV servers, and the mapping helpers of the
processes that read segments (workers, their shadows, tests).

A segment is one file under /dev/shm:

    [8-byte magic][u64 little-endian manifest length][manifest JSON][zero pad to 64]
    [tensor 0][pad to 64][tensor 1]...

every tensor C-contiguous at the 64-byte-aligned offset the manifest gives. The servers create
and write segments (`Segment`); workers map them without a copy: tensors are `torch.frombuffer`
views over the mapping. Weights are mapped read-only (PROT_READ, so a write through a tensor is
a SIGSEGV, not a silent change of the weights every engine on the host reads); an arena is
mapped read-write, shared. On a GPU the servers also hand out CUDA IPC handles of one device
buffer laid out like the segment, and the mappers use those instead.

Part of the contract, beside the handle Structs of shared/protocol.py: the servers write this
format and the workers read it, so neither owns it. Also the per-prefix lock a server holds on its
/dev/shm names (`PrefixLock`, `PrefixBusy`). Knows nothing about NATS (handles arrive as protocol
Structs) or about pinning and freeing; of the model it knows only a preset's arena shape.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import struct
import typing
import warnings
from pathlib import Path

import msgspec
import torch

from belayer_rl.shared.config import ConfigError
from belayer_rl.shared.presets import PRESETS, arena_shape
from belayer_rl.shared.protocol import (
    ArenaHandle,
    CudaIpcHandle,
    SegmentManifest,
    TensorDType,
    TensorLayout,
    WeightHandles,
)

SHM_DIR = Path("/dev/shm")
ALIGN = 64
MAGIC = b"BLYRSEG1"
_HEAD = struct.Struct("<8sQ")  # magic, manifest length
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int64": torch.int64,
}
DTYPE_NAMES: dict[torch.dtype, TensorDType] = {
    dtype: typing.cast(TensorDType, name) for name, dtype in DTYPES.items()
}

_manifest_decoder = msgspec.json.Decoder(SegmentManifest)


class MappingError(RuntimeError):
    """A handle that cannot be mapped: the segment is gone, or is not the one the handle names."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# ---------------------------------------------------------------------------- layout


def plan(
    owner: typing.Literal["weights", "kv"],
    key: str,
    instance: str,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
) -> SegmentManifest:
    """The manifest of a segment holding `specs` (name, shape, dtype) back to back after the header.

    Offsets depend on the header's length, which depends on the offsets' digits: iterate until the
    data start no longer moves (two rounds in practice)."""
    data_start = ALIGN
    while True:
        tensors, offset = [], data_start
        for name, shape, dtype in specs:
            nbytes = math.prod(shape) * dtype.itemsize
            tensors.append(
                TensorLayout(
                    name=name, shape=list(shape), dtype=DTYPE_NAMES[dtype], offset=offset, nbytes=nbytes
                )
            )
            offset = _align(offset + nbytes)
        manifest = SegmentManifest(
            owner=owner,
            key=key,
            instance=instance,
            size=max(offset, data_start),
            tensors=tensors,
        )
        needed = _align(_HEAD.size + len(msgspec.json.encode(manifest)))
        if needed <= data_start:
            return manifest
        data_start = needed


def _views(buffer: torch.Tensor, manifest: SegmentManifest) -> dict[str, torch.Tensor]:
    """Typed, shaped views of the tensors of `manifest` inside `buffer` (uint8 [size])."""
    views = {}
    for t in manifest.tensors:
        raw = buffer[t.offset : t.offset + t.nbytes]
        views[t.name] = raw.view(DTYPES[t.dtype]).view(t.shape)
    return views


# ---------------------------------------------------------------------------- server side


class Segment:
    """A segment this process created and maps read-write. `close` unmaps it, `unlink` removes
    its name (mappings elsewhere stay valid until they are dropped)."""

    def __init__(
        self,
        name: str,
        manifest: SegmentManifest,
        *,
        reserve: bool = True,
        mode: int = 0o600,
        group: int | None = None,
    ) -> None:
        """Create /dev/shm/`name` (it must not exist) sized and headed per `manifest`.

        `reserve` allocates every page now (posix_fallocate), so a full /dev/shm is an OSError
        here rather than a SIGBUS in whoever first touches a page. Without it (data held on a GPU)
        only the header is ever written and the rest stays a hole. `mode` and `group` say who else
        may map it: under Compose each service runs as a uid of its own, and the readers of a
        segment share a group with its server (compose.yaml)."""
        self.name = name
        self.path = SHM_DIR / name
        self.manifest = manifest
        self._mm: mmap.mmap | None = None
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if group is not None:
                os.fchown(fd, -1, group)
            os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
            if reserve:
                os.posix_fallocate(fd, 0, manifest.size)
            else:
                os.ftruncate(fd, manifest.size)
            mapping = mmap.mmap(
                fd, manifest.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            raise
        os.close(fd)
        encoded = msgspec.json.encode(manifest)
        mapping[: _HEAD.size + len(encoded)] = _HEAD.pack(MAGIC, len(encoded)) + encoded
        self._mm = mapping
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # [size], shares the mapping
        self.tensors = _views(self.buffer, manifest)

    def close(self) -> None:
        """Drop this object's views and mapping. The pages are unmapped when the last view dies:
        mmap.close() would unmap under a stray view (torch.frombuffer does not pin the buffer)
        and turn its next read into a SIGSEGV."""
        self.tensors = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._mm = None

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class PrefixLock:
    """Exclusive use of the /dev/shm names starting with `prefix` by one live process.

    An flock on /dev/shm/<prefix>lock: the kernel drops it when its holder dies, even by SIGKILL,
    so a restarted server takes it over and removes the segments its predecessor left; a second
    live server on the same prefix is refused instead of deleting segments still in use."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.path = SHM_DIR / f"{prefix}lock"
        self._fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise PrefixBusy(f"another live process owns the shared-memory prefix {prefix!r}") from None
        self.removed = remove_leftovers(prefix, keep=(self.path.name,))

    def release(self) -> None:
        """Remove every name with the prefix, the lock's own included, then drop the lock."""
        remove_leftovers(self.prefix, keep=(self.path.name,))
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)


class PrefixBusy(ConfigError):
    """Another live process holds the lock of the shared-memory prefix: a setting to change (its
    --shm-prefix) or a server already running, reported in one line like any config error."""


def remove_leftovers(prefix: str, keep: tuple[str, ...] = ()) -> list[str]:
    """Unlink every /dev/shm entry whose name starts with `prefix`, except `keep`; returns them."""
    removed = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        if path.name in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return sorted(removed)


# ---------------------------------------------------------------------------- CUDA IPC


def export_cuda(buffer: torch.Tensor) -> CudaIpcHandle:
    """The CUDA IPC handle of `buffer`, a uint8 CUDA tensor that owns its whole storage. The
    exporter must keep `buffer` alive while importers use it (torch then keeps the block in
    its IPC limbo until their reference counts drop)."""
    storage = buffer.untyped_storage()
    if buffer.storage_offset() != 0 or storage.nbytes() != buffer.numel():
        raise ValueError("export_cuda needs a tensor that spans its whole storage")
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync) = (
        storage._share_cuda_()
    )
    return CudaIpcHandle(
        device=device,
        handle=handle,
        storage_size_bytes=size_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle or b"",
        event_sync_required=event_sync,
    )


def import_cuda(handle: CudaIpcHandle) -> torch.Tensor:
    """Open another process's CUDA buffer: uint8 [storage_size_bytes] on its device, no copy."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    tensor: torch.Tensor = rebuild_cuda_tensor(
        torch.Tensor,
        (handle.storage_size_bytes,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        handle.device,
        handle.handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
    return tensor


def use_cuda(handle: CudaIpcHandle | None) -> bool:
    return handle is not None and torch.cuda.is_available()


# ---------------------------------------------------------------------------- worker side


def _map(segment: str, manifest: SegmentManifest, *, writable: bool) -> torch.Tensor:
    """Map /dev/shm/`segment` whole (uint8 [size]) after checking its header is `manifest`."""
    if not segment or "/" in segment or segment.startswith("."):
        raise MappingError(f"bad segment name {segment!r}")
    try:
        fd = os.open(SHM_DIR / segment, os.O_RDWR if writable else os.O_RDONLY)
    except FileNotFoundError:
        raise MappingError(f"segment {segment} is gone (freed, or its server restarted)") from None
    try:
        size = os.fstat(fd).st_size
        if size != manifest.size:
            raise MappingError(f"segment {segment} holds {size} bytes, the handle says {manifest.size}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    magic, length = _HEAD.unpack(mm[: _HEAD.size])
    header = mm[_HEAD.size : _HEAD.size + length] if magic == MAGIC and length < size else b""
    try:
        found = _manifest_decoder.decode(header)
    except msgspec.DecodeError:
        found = None
    if found != manifest:
        mm.close()
        raise MappingError(f"segment {segment} is not the one the handle describes")
    with warnings.catch_warnings():  # a read-only buffer is the point, not a problem
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)


def map_weights(handles: WeightHandles, gpu: bool = True) -> dict[str, torch.Tensor]:
    """The weights of `handles` as name -> tensor, without copying.

    On CPU the segment is mapped read-only and shared: every process that maps a version shares
    its pages, and a write through one of these tensors kills the writer with SIGSEGV. With CUDA
    available, a CUDA handle in `handles` and `gpu` (an engine whose arena is on the CPU passes
    False), the tensors are views of the server's GPU buffer (CUDA IPC has no read-only mode: the
    engine must not write them)."""
    if gpu and use_cuda(handles.cuda):
        assert handles.cuda is not None
        return _views(import_cuda(handles.cuda), handles.manifest)
    if handles.manifest.owner != "weights" or handles.manifest.key != handles.version:
        raise MappingError(f"handles of {handles.version} carry a manifest for {handles.manifest.key}")
    return _views(_map(handles.segment, handles.manifest, writable=False), handles.manifest)


def map_arena(handle: ArenaHandle) -> torch.Tensor:
    """The engine's KV arena, read-write and shared with the kv-server (and a shadow worker),
    shaped [n_layers, 2, num_blocks, block_size, n_heads, head_dim] as presets.arena_shape."""
    if handle.preset not in PRESETS:
        raise MappingError(f"unknown preset {handle.preset!r}")
    expected = arena_shape(PRESETS[handle.preset], handle.num_blocks, handle.block_size)
    tensors = handle.manifest.tensors
    if (
        handle.manifest.owner != "kv"
        or handle.manifest.key != handle.engine_id
        or [t.name for t in tensors] != ["arena"]
        or tuple(tensors[0].shape) != expected
        or tensors[0].dtype != "float32"
    ):
        raise MappingError(f"arena handle of {handle.engine_id} does not describe a {expected} arena")
    if use_cuda(handle.cuda):
        assert handle.cuda is not None
        return _views(import_cuda(handle.cuda), handle.manifest)["arena"]
    return _views(_map(handle.segment, handle.manifest, writable=True), handle.manifest)["arena"]
