"""A container's writable layer (the overlay upper dir) as a tar archive, and its safe installation.

Archiving runs GNU tar over the upper dir while the container is frozen: numeric owners, overlay
opaque-dir xattrs, whiteouts (character devices 0/0) as they are, sparse files as sparse (PAX
sparse 1.0: only their data regions are stored, and only those are written back).

Installing never trusts the archive: `check` reads every member first and rejects the archive whole when any entry could write
outside the new layer (absolute paths, `..`, a path through a symlink, a symlink whose relative
target climbs above the root, a hardlink to anything but an earlier regular file of the archive,
device nodes other than whiteouts, duplicates), or that does not end as a tar archive ends (cut
short, or with anything but zero blocks after its last entry); then `install` creates each entry with
`O_NOFOLLOW` relative to directory descriptors, so even a missed case cannot follow a link out.

Absolute symlink targets are allowed: inside the container they resolve under its own root.
Knows nothing about Docker or CRIU.
"""

from __future__ import annotations

import os
import posixpath
import stat
import subprocess
import tarfile
import typing
from dataclasses import dataclass
from pathlib import Path

OPAQUE_XATTR = "trusted.overlay.opaque"
PAX_OPAQUE = "SCHILY.xattr." + OPAQUE_XATTR
MAX_MEMBERS = 1_000_000
COPY_CHUNK = 1 << 20
FS_BLOCK = 4096


class HostileLayer(ValueError):
    """The archive has an entry that could write outside the layer, or is not a layer at all."""


# ---------------------------------------------------------------- archive


def archive(upper_dir: Path, out: Path) -> int:
    """Write `upper_dir` as a tar archive to `out`; return its size. The caller freezes the writer."""
    with out.open("wb") as f:
        result = subprocess.run(
            [
                "tar", "--create", "--file=-", "--format=posix", "--numeric-owner",
                "--xattrs", f"--xattrs-include={OPAQUE_XATTR}", "--sparse",
                f"--directory={upper_dir}", ".",
            ],
            stdout=f, stderr=subprocess.PIPE, check=False,
        )  # fmt: skip
        f.flush()
        os.fsync(f.fileno())
    if result.returncode != 0:
        raise OSError(f"tar of the writable layer failed: {result.stderr.decode(errors='replace')[-400:]}")
    return out.stat().st_size


# ---------------------------------------------------------------- check


@dataclass(frozen=True)
class Entry:
    member: tarfile.TarInfo
    parts: tuple[str, ...]  # normalised path components; () is the layer root


def _parts(name: str, what: str) -> tuple[str, ...]:
    if name.startswith("/"):
        raise HostileLayer(f"{what} {name!r} is absolute")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise HostileLayer(f"{what} {name!r} contains '..'")
    if any("\0" in p for p in parts):
        raise HostileLayer(f"{what} {name!r} contains a NUL")
    return parts


def _symlink_escapes(parts: tuple[str, ...], target: str) -> bool:
    """Whether a relative symlink at `parts` pointing to `target` climbs above the layer root."""
    if target.startswith("/"):
        return False
    depth = len(parts) - 1  # the directory holding the link
    for p in target.split("/"):
        if p == "..":
            depth -= 1
            if depth < 0:
                return True
        elif p not in ("", "."):
            depth += 1
    return False


def check(archive_path: Path, max_bytes: int | None = None) -> list[Entry]:
    """Read the whole archive and return its entries, or raise HostileLayer naming the first bad one."""
    entries: list[Entry] = []
    seen: dict[tuple[str, ...], tarfile.TarInfo] = {}
    symlinks: set[tuple[str, ...]] = set()
    total = 0
    try:
        with tarfile.open(archive_path, "r:") as tar:
            for member in tar:
                if len(entries) >= MAX_MEMBERS:
                    raise HostileLayer(f"more than {MAX_MEMBERS} entries")
                parts = _parts(member.name, "path")
                if parts in seen:
                    raise HostileLayer(f"duplicate entry {member.name!r}")
                if not parts:
                    if not member.isdir():
                        raise HostileLayer("the layer root is not a directory")
                    continue
                for i in range(1, len(parts)):
                    prefix = parts[:i]
                    if prefix in symlinks:
                        raise HostileLayer(f"{member.name!r} goes through the symlink {'/'.join(prefix)!r}")
                    if prefix in seen and not seen[prefix].isdir():
                        raise HostileLayer(f"{member.name!r} goes through a non-directory")
                if member.issym():
                    if _symlink_escapes(parts, member.linkname):
                        raise HostileLayer(
                            f"symlink {member.name!r} -> {member.linkname!r} escapes the layer"
                        )
                    symlinks.add(parts)
                elif member.islnk():
                    target = _parts(member.linkname, "hardlink target")
                    if target not in seen or not seen[target].isreg():
                        raise HostileLayer(
                            f"hardlink {member.name!r} -> {member.linkname!r} is not to an earlier file"
                        )
                elif member.ischr():
                    if (member.devmajor, member.devminor) != (0, 0):
                        raise HostileLayer(f"device node {member.name!r} is not a whiteout")
                elif member.isblk():
                    raise HostileLayer(f"block device {member.name!r}")
                elif not (member.isreg() or member.isdir() or member.isfifo()):
                    raise HostileLayer(f"unsupported entry type {member.type!r} for {member.name!r}")
                if member.isreg():
                    total += _data_bytes(member)
                    if max_bytes is not None and total > max_bytes:
                        raise HostileLayer(f"the layer holds more than {max_bytes} bytes")
                seen[parts] = member
                entries.append(Entry(member, parts))
            _check_end(archive_path, tar.offset)
    except tarfile.TarError as exc:
        raise HostileLayer(f"not a readable tar archive: {exc}") from None
    return entries


def sparse_map(member: tarfile.TarInfo) -> list[tuple[int, int]] | None:
    """A sparse file's data regions, (offset, size) each; None for a file that is not sparse.
    (typeshed calls the attribute an int; tarfile sets it to this list.)"""
    return typing.cast("list[tuple[int, int]] | None", member.sparse)


def _data_bytes(member: tarfile.TarInfo) -> int:
    """What the file takes on disk once installed: for a sparse one, its data regions, each counted
    in whole blocks (a map of one-byte regions still allocates a block for each)."""
    regions = sparse_map(member)
    if regions is None:
        return member.size
    end, total = 0, 0
    for offset, size in regions:
        if offset < end or size < 0 or offset + size > member.size:
            raise HostileLayer(f"sparse file {member.name!r} has an overlapping or outlying region")
        end = offset + size
        total += -(-size // FS_BLOCK) * FS_BLOCK
    return total


def _check_end(archive_path: Path, end: int) -> None:
    """After the last entry (at `end`) an archive holds its end-of-archive marker, two or more
    zero blocks, and nothing else. tarfile stops quietly at the first header it cannot read, so
    without this a cut or a tail of garbage would pass as a shorter archive."""
    size = archive_path.stat().st_size
    if size - end < 2 * tarfile.BLOCKSIZE:
        raise HostileLayer(f"cut short: {size - end} bytes after the last entry, no end-of-archive marker")
    with archive_path.open("rb") as f:
        f.seek(end)
        while chunk := f.read(COPY_CHUNK):
            if chunk.count(0) != len(chunk):
                raise HostileLayer(f"bytes other than the end-of-archive marker after offset {end}")


# ---------------------------------------------------------------- install


def _open_dir(root_fd: int, parts: tuple[str, ...]) -> int:
    """Open the directory `parts` below root_fd without following any symlink."""
    fd = os.dup(root_fd)
    try:
        for p in parts:
            nxt = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def install(archive_path: Path, entries: list[Entry], layer_dir: Path) -> None:
    """Create the checked `entries` of the archive under `layer_dir` (an empty upper dir)."""
    root_fd = os.open(layer_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    dirs: list[Entry] = []
    try:
        with tarfile.open(archive_path, "r:") as tar:
            for entry in entries:
                m, parts = entry.member, entry.parts
                parent = _open_dir(root_fd, parts[:-1])
                name = parts[-1]
                try:
                    if m.isdir():
                        os.mkdir(name, 0o700, dir_fd=parent)
                        dirs.append(entry)
                    elif m.isreg():
                        _write_file(tar, m, parent, name)
                    elif m.issym():
                        os.symlink(m.linkname, name, dir_fd=parent)
                        os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
                        os.utime(name, (m.mtime, m.mtime), dir_fd=parent, follow_symlinks=False)
                    elif m.islnk():
                        target = _parts(m.linkname, "hardlink target")
                        src_parent = _open_dir(root_fd, target[:-1])
                        try:
                            os.link(target[-1], name, src_dir_fd=src_parent, dst_dir_fd=parent,
                                    follow_symlinks=False)  # fmt: skip
                        finally:
                            os.close(src_parent)
                    elif m.ischr():  # a whiteout: 0/0, checked
                        os.mknod(name, stat.S_IFCHR | (m.mode & 0o7777), os.makedev(0, 0), dir_fd=parent)
                        os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
                    elif m.isfifo():
                        os.mkfifo(name, m.mode & 0o7777, dir_fd=parent)
                        os.chown(name, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
                finally:
                    os.close(parent)
        for entry in reversed(dirs):  # modes and times last: a read-only directory is filled first
            fd = _open_dir(root_fd, entry.parts)
            try:
                m = entry.member
                if m.pax_headers.get(PAX_OPAQUE) == "y":
                    os.setxattr(fd, OPAQUE_XATTR, b"y")
                os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)
                os.utime(fd, (m.mtime, m.mtime))
            finally:
                os.close(fd)
        os.fsync(root_fd)
    finally:
        os.close(root_fd)


def _write_file(tar: tarfile.TarFile, m: tarfile.TarInfo, parent: int, name: str) -> None:
    fd = os.open(
        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent
    )
    try:
        source = tar.extractfile(m)
        assert source is not None
        # A sparse file gets only its data regions written, its holes stay holes; `check` has
        # made sure the regions are ordered and inside the file.
        regions = sparse_map(m)
        for offset, size in regions if regions is not None else [(0, m.size)]:
            source.seek(offset)
            while size > 0 and (chunk := source.read(min(size, COPY_CHUNK))):
                size -= len(chunk)
                view = memoryview(chunk)
                while view:
                    written = os.pwrite(fd, view, offset)
                    offset += written
                    view = view[written:]
        os.ftruncate(fd, m.size)
        os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears setuid bits
        os.utime(fd, (m.mtime, m.mtime))
    finally:
        os.close(fd)


def layer_paths(entries: list[Entry]) -> list[str]:
    return [posixpath.join(*e.parts) for e in entries]
