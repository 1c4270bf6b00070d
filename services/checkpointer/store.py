"""The local checkpoint store: one folder per ready checkpoint, published atomically.

    <root>/<trajectory>/<checkpoint id>/
        manifest.json   sizes and sha256 of every other file, the create settings, L_k's digest
        manifest.mac    HMAC-SHA256 of manifest.json's bytes
        layer.tar       the writable layer (see layer.py)
        context.json    L_k: the context tokens or a reference
        criu/           CRIU images as the engine wrote them

A checkpoint is written under `.tmp-<id>`, fsynced, and renamed into place; anything whose name
starts with `.tmp-` is half-written and never read. A folder is self-contained and can be moved
to another host. The manifest is checked against every file before any of it is used.

The manifest is authenticated: manifest.mac holds an HMAC-SHA256, with a key that only
checkpointers hold, of manifest.json's exact bytes, which name every file's size and checksum (the
CRIU images among them), the container settings, L_k's digest, the checkpoint's id and its
trajectory. A manifest whose MAC does not match is not even decoded, so a folder forged into a
store, one whose settings were edited, or one moved under another name is never restored. It is
not deleted for that either: a host given the wrong key must not destroy good checkpoints. The
trajectory's own record (trajectory.json, the settings of a restart from the base image) is signed
the same way.
Knows nothing about Docker or NATS.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from belayer_rl.shared import files
from belayer_rl.shared.protocol import CheckpointId, SandboxSpec

FORMAT = "belayer-checkpoint/2"  # /1 had no MAC: decoded, never trusted
TMP_PREFIX = files.TMP_PREFIX
QUARANTINE_PREFIX = "quarantined-"  # a checkpoint set aside (Store.quarantine)
MANIFEST = "manifest.json"
MAC_SUFFIX = ".mac"  # beside each signed file: manifest.mac, trajectory.mac
MANIFEST_MAC = "manifest.mac"
TRAJECTORY = "trajectory.json"
MAX_SIGNED_BYTES = 16 << 20  # a signed file is read whole to check its MAC: bounded first
LAYER = "layer.tar"
CONTEXT = "context.json"
CRIU = "criu"
HASH_CHUNK = 1 << 20
KEY_BYTES = 32


class CorruptCheckpoint(ValueError):
    """The folder does not match its manifest (missing, extra, resized or altered files)."""


class Unauthenticated(CorruptCheckpoint):
    """Not signed with this store's key: a forgery, an edit, or another key. Never used; kept."""


class FileSum(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # relative to the checkpoint folder
    size: int
    sha256: str


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """L_k: the LLM context at action boundary k."""

    tokens: list[int] = []
    ref: str = ""


Name = CheckpointId  # the same shape: "" or [A-Za-z0-9_-]{1,96}


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str = FORMAT
    checkpoint_id: CheckpointId  # each name that becomes a path is pattern-checked on load
    trajectory: Name
    sandbox: Name
    host_id: Name
    incarnation: int
    k: int
    spec: SandboxSpec
    image_id: str  # the image the container ran, by id: a restore insists on the same one
    criu_name: Name  # the checkpoint name CRIU's images were dumped under
    context_digest: str
    context_len: int
    created_at: float
    freeze_s: float
    dump_s: float
    files: list[FileSum]
    owner: str = ""  # the client whose sandbox it is (signed with the rest): "" before owners

    @property
    def order(self) -> tuple[int, int]:
        return (self.incarnation, self.k)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class Stored:
    path: Path
    manifest: Manifest


def digest_context(context: Context) -> str:
    return "sha256:" + hashlib.sha256(msgspec.json.encode(context)).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_key(path: Path, *, create: bool) -> bytes:
    """The key that authenticates manifests, read from `path` (hex); with `create`, made there
    (mode 0600, whole or not at all) when the file does not exist. Every checkpointer that restores
    another's checkpoints needs the same key."""
    if create and not path.exists():
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(KEY_BYTES) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another process made one first: use that
            os.link(tmp, path)
        tmp.unlink()
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"checkpoint key {path}: not hex") from None
    if len(key) < KEY_BYTES:
        raise ValueError(f"checkpoint key {path}: {len(key)} bytes, needs at least {KEY_BYTES}")
    return key


def decode_manifest(data: bytes, name: str) -> Manifest:
    """The manifest as written, names pattern-checked, not yet authenticated."""
    try:
        return msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpoint(f"{name}: unreadable manifest: {exc}") from None


def mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).hexdigest().encode()


def mac_path(path: Path) -> Path:
    return path.with_suffix(MAC_SUFFIX)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


class Store:
    def __init__(self, root: Path, key: bytes) -> None:
        self.root = root.absolute()  # runc is given its folders; a dump it outlives is found by them
        self.key = key  # authenticates manifests: see the module's docstring
        root.mkdir(parents=True, exist_ok=True)

    def trajectory_dir(self, trajectory: str) -> Path:
        return self.root / trajectory

    def staging(self, trajectory: str, checkpoint_id: str) -> Path:
        path = self.trajectory_dir(trajectory) / f"{TMP_PREFIX}{checkpoint_id}"
        path.mkdir(parents=True)
        return path

    # ------------------------------------------------------------ publish

    def seal(self, staging: Path, draft: Manifest) -> Manifest:
        """Checksum every file in `staging`, write the manifest, fsync them all. Not yet visible.
        `draft` is the manifest but for its files and its time, which are filled in here."""
        sums = []
        for path in _files(staging):
            if path.is_symlink():
                raise CorruptCheckpoint(f"unexpected symlink {path.name} in a checkpoint")
            sums.append(
                FileSum(
                    path=str(path.relative_to(staging)), size=path.stat().st_size, sha256=sha256_file(path)
                )
            )
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        manifest = msgspec.structs.replace(draft, files=sums, created_at=time.time())
        self.write_signed(staging / MANIFEST, msgspec.json.format(msgspec.json.encode(manifest)))
        for folder in sorted({p.parent for p in _files(staging)} | {staging}, key=lambda p: -len(p.parts)):
            files.fsync_dir(folder)
        return manifest

    def publish(self, staging: Path, manifest: Manifest) -> Path:
        """Rename the sealed folder into place: the checkpoint exists whole or not at all."""
        final = staging.parent / manifest.checkpoint_id
        staging.rename(final)
        files.fsync_dir(final.parent)
        return final

    def write_signed(self, path: Path, data: bytes) -> None:
        """Write `data` to `path` and its MAC beside it, each fsynced and renamed into place."""
        for target, body in ((path, data), (mac_path(path), mac(self.key, data))):
            files.write_whole(target, body, durable=True)

    def read_signed(self, path: Path) -> bytes:
        """The bytes of `path`, once the MAC beside it proves a holder of this store's key wrote them."""
        try:
            if path.stat().st_size > MAX_SIGNED_BYTES:
                raise CorruptCheckpoint(f"{path.name} is larger than {MAX_SIGNED_BYTES} bytes")
            data = path.read_bytes()
        except OSError as exc:
            raise CorruptCheckpoint(f"{path.parent.name}: unreadable {path.name}: {exc}") from None
        try:
            tag = mac_path(path).read_bytes()
        except OSError as exc:  # an earlier format had none
            raise Unauthenticated(f"{path.parent.name}: {path.name} is not authenticated: {exc}") from None
        if not hmac.compare_digest(tag.strip(), mac(self.key, data)):
            raise Unauthenticated(f"{path.parent.name}: {path.name} is not authenticated by this store's key")
        return data

    # ------------------------------------------------------------ read

    def load(self, path: Path) -> Manifest:
        """The folder's manifest, once its MAC proves a checkpointer holding our key wrote it for
        this folder: this checkpoint id, in this trajectory's folder."""
        manifest = decode_manifest(self.read_signed(path / MANIFEST), path.name)
        if manifest.format != FORMAT:
            raise CorruptCheckpoint(f"{path.name}: format {manifest.format!r}, not {FORMAT!r}")
        name, trajectory = path.name.removeprefix(TMP_PREFIX), path.parent.name
        if (manifest.checkpoint_id, manifest.trajectory) != (name, trajectory):
            raise CorruptCheckpoint(
                f"{trajectory}/{name}: holds checkpoint {manifest.checkpoint_id} of {manifest.trajectory}"
            )
        return manifest

    def verify(self, path: Path) -> Manifest:
        """The authenticated manifest, once every file matches it (no file missing, extra, resized or
        altered): the layer, L_k and each CRIU image are checked before any is used."""
        manifest = self.load(path)
        listed = {f.path: f for f in manifest.files}
        present = {str(p.relative_to(path)) for p in _files(path)} - {MANIFEST, MANIFEST_MAC}
        if present != set(listed):
            raise CorruptCheckpoint(
                f"{path.name}: files differ from the manifest: {sorted(present ^ set(listed))[:5]}"
            )
        for name, entry in listed.items():
            file = path / name
            if file.is_symlink():
                raise CorruptCheckpoint(f"{path.name}: {name} is a symlink")
            if file.stat().st_size != entry.size:
                raise CorruptCheckpoint(
                    f"{path.name}: {name} has {file.stat().st_size} bytes, manifest says {entry.size}"
                )
            if sha256_file(file) != entry.sha256:
                raise CorruptCheckpoint(f"{path.name}: {name} does not match its checksum")
        context = self.context(path)
        if digest_context(context) != manifest.context_digest:
            raise CorruptCheckpoint(f"{path.name}: L_k does not match its digest")
        return manifest

    def context(self, path: Path) -> Context:
        try:
            return msgspec.json.decode((path / CONTEXT).read_bytes(), type=Context)
        except (OSError, msgspec.DecodeError) as exc:
            raise CorruptCheckpoint(f"{path.name}: unreadable context: {exc}") from None

    def ready(self, trajectory: str) -> list[Stored]:
        """Published checkpoints of the trajectory, newest (incarnation, k) first; one whose manifest
        does not read or is not authenticated comes last. Full verification is left to the restore that uses one."""
        folder = self.trajectory_dir(trajectory)
        if not folder.is_dir():
            return []
        found = []
        for path in folder.iterdir():
            if path.name.startswith((TMP_PREFIX, QUARANTINE_PREFIX)) or not path.is_dir():
                continue
            try:
                found.append(Stored(path, self.load(path)))
            except CorruptCheckpoint:
                found.append(Stored(path, _unreadable(path.name)))
        return sorted(found, key=lambda s: s.manifest.order, reverse=True)

    def trajectories(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    # ------------------------------------------------------------ remove

    def remove(self, path: Path) -> None:
        """Make the folder unreachable first (rename to a temporary name), then delete it."""
        doomed = path.parent / f"{TMP_PREFIX}rm-{path.name}"
        try:
            path.rename(doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def quarantine(self, path: Path) -> Path:
        """Set a checkpoint aside (renamed `quarantined-<id>`): no restore or pointer rebuild sees it
        again, nor the disk budget (which would evict good checkpoints to keep it), and nothing
        deletes it but the end of its trajectory. For one whose restores keep failing for no proven
        reason: a fault of the host (CRIU, the daemon) looks the same, and must not wipe
        acknowledged work one checkpoint at a time. An operator gives it back by renaming it to its
        id. A copy of a checkpoint already set aside (fetched again from the object store) goes."""
        aside = path.parent / f"{QUARANTINE_PREFIX}{path.name}"
        if aside.exists():
            self.remove(path)
            return aside
        path.rename(aside)
        files.fsync_dir(path.parent)
        return aside

    def quarantined(self, trajectory: str) -> list[Path]:
        folder = self.trajectory_dir(trajectory)
        return sorted(folder.glob(f"{QUARANTINE_PREFIX}*")) if folder.is_dir() else []

    def remove_trajectory(self, trajectory: str) -> None:
        folder = self.trajectory_dir(trajectory)
        for stored in self.ready(trajectory):
            self.remove(stored.path)
        shutil.rmtree(folder, ignore_errors=True)

    def staging_of(self, path: Path) -> Path | None:
        """The staging folder of this store that `path` lies in; None when it lies in none."""
        for folder in path.parents:
            if folder.parent.parent == self.root and folder.name.startswith(TMP_PREFIX):
                return folder
        return None

    def sweep(self, keep: set[Path]) -> list[Path]:
        """Delete half-written folders (a crash mid-checkpoint) but those in `keep`, which a dump
        left running still writes to; return what was removed."""
        removed = []
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.startswith(TMP_PREFIX) and path not in keep:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(path)
        return removed

    def usage(self) -> int:
        """Bytes held by published checkpoints; folders being written or removed meanwhile, and those
        quarantined (the operator's to free), are skipped."""
        total = 0
        for folder, dirs, names in os.walk(self.root):
            # Inside a trajectory's folder only: a trajectory may be named quarantined-<x>.
            aside = (TMP_PREFIX, QUARANTINE_PREFIX) if Path(folder).parent == self.root else (TMP_PREFIX,)
            dirs[:] = [d for d in dirs if not d.startswith(aside)]
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(folder, name)).st_size
        return total

    def enforce_budget(self, budget_bytes: int, keep: set[Path]) -> list[Path]:
        """Delete the oldest checkpoints that are not in `keep` (each trajectory's latest) until the
        store fits `budget_bytes`."""
        if budget_bytes <= 0:
            return []
        everything = [s for t in self.trajectories() for s in self.ready(t)]
        candidates = sorted(
            (s for s in everything if s.path not in keep), key=lambda s: s.manifest.created_at
        )
        used = self.usage()
        removed = []
        for stored in candidates:
            if used <= budget_bytes:
                break
            used -= _folder_bytes(stored.path)  # the manifest's count, unless it is unreadable
            self.remove(stored.path)
            removed.append(stored.path)
        return removed


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in _files(folder):
        with contextlib.suppress(OSError):
            total += path.lstat().st_size
    return total


def _unreadable(name: str) -> Manifest:
    """A stand-in for a folder whose manifest does not read: ordered last, rejected by verify."""
    return Manifest(
        checkpoint_id=name, trajectory="", sandbox="", host_id="", incarnation=-1, k=-1,
        spec=SandboxSpec(image="unknown"), image_id="", criu_name="", context_digest="", context_len=0,
        created_at=0.0, freeze_s=0.0, dump_s=0.0, files=[],
    )  # fmt: skip
