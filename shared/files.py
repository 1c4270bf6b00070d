"""Files written whole: a reader finds the old file or the new one, never half of one.

Each write goes to a temporary name beside the file (`.tmp-<name>-<pid>`) and is renamed into place.
A name that starts with `.tmp-` is therefore half-written and never read; the file's one writer may
delete such leftovers once an earlier writer is known dead (`leftovers`). Blocking: async code
calls these in a thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

TMP_PREFIX = ".tmp-"


def temporary_name(final: Path) -> Path:
    return final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}")


def leftovers(final: Path) -> list[Path]:
    """The temporary files of writes to `final` that never finished."""
    return sorted(final.parent.glob(f"{TMP_PREFIX}{final.name}-*"))


def write_whole(
    final: Path,
    data: bytes | Iterable[bytes],
    *,
    durable: bool = False,
    mode: int = 0o666,
    keep_owner: bool = False,
) -> Path:
    """Write `data` (bytes, or parts written and flushed one after the other) to `final`.

    `durable`: the file and then its folder are fsynced before this returns, so the new content
    survives a power cut once it is seen. `mode` holds from the file's creation (less the umask):
    0o600 keeps a secret unreadable to others even briefly. `keep_owner`: the file it replaces
    keeps its owner (root writing a file that a service's uid owns)."""
    tmp = temporary_name(final)
    tmp.unlink(missing_ok=True)  # a leftover of this pid's: `mode` holds only for a new file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        if keep_owner and final.exists() and (old := final.stat()).st_uid != os.geteuid():
            os.fchown(out.fileno(), old.st_uid, old.st_gid)
        for part in [data] if isinstance(data, bytes) else data:
            out.write(part)
            out.flush()
        if durable:
            os.fsync(out.fileno())
    os.replace(tmp, final)
    if durable:
        fsync_dir(final.parent)
    return final


def fsync_dir(folder: Path) -> None:
    """Make the names in `folder` (a rename into it, say) survive a power cut."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
