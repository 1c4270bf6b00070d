"""Trainer checkpoints: written atomically, verified on load, the newest good one wins.

A file is a 64-byte hex SHA-256 of the rest, then a torch.save payload (model, optimizer, data
position, RNG state, weight version). It is written under a temporary name, fsynced, renamed into
place and the folder fsynced, so a crash leaves either the old set of files or the new one. A file
whose digest does not match (half-written by a crash that beat the rename's durability, or
damaged later) is skipped with its reason, and the one before it is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from belayer_rl.shared import files

log = logging.getLogger("belayer.trainer.checkpoint")

DIGEST_BYTES = 64
PREFIX = "step-"
SUFFIX = ".ckpt"


class CorruptTrainerCheckpoint(Exception):
    pass


@dataclass(frozen=True)
class Loaded:
    path: Path
    state: dict[str, Any]
    skipped: list[str]  # "<file>: <why>" of every newer file that did not verify


def path_for(folder: Path, step: int) -> Path:
    return folder / f"{PREFIX}{step:08d}{SUFFIX}"


def write(folder: Path, step: int, state: dict[str, Any]) -> Path:
    """Blocking (call it in a thread)."""
    return write_file(path_for(folder, step), state)


def write_file(final: Path, state: dict[str, Any], midway: Callable[[], None] | None = None) -> Path:
    """`state` into `final`, atomically and durably. Blocking. `midway` (chaos) runs when half the
    payload is on disk under the temporary name."""
    folder = final.parent
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()

    def parts() -> Iterator[bytes]:
        yield hashlib.sha256(payload).hexdigest().encode()
        if midway is None:
            yield payload
            return
        yield payload[: len(payload) // 2]
        midway()  # the first half is written and flushed
        yield payload[len(payload) // 2 :]

    return files.write_whole(final, parts(), durable=True)


def remove_leftovers(final: Path) -> list[Path]:
    """Delete the temporary files of writes to `final` that never finished (a writer killed
    mid-write). Only for the file's one writer, once the earlier writer is known dead."""
    leftovers = files.leftovers(final)
    for path in leftovers:
        path.unlink(missing_ok=True)
    return leftovers


def read(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    if len(data) <= DIGEST_BYTES:
        raise CorruptTrainerCheckpoint(f"{path.name}: {len(data)} bytes, shorter than a checkpoint")
    digest, payload = data[:DIGEST_BYTES].decode(errors="replace"), data[DIGEST_BYTES:]
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CorruptTrainerCheckpoint(f"{path.name}: digest mismatch (truncated or damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptTrainerCheckpoint(f"{path.name}: {type(exc).__name__}: {exc}") from None


def load_latest(folder: Path) -> Loaded | None:
    """The newest checkpoint that verifies; None when the folder holds none. Files that exist but
    none of which verify raise: starting over silently would retrain every sample."""
    skipped: list[str] = []
    for path in sorted(folder.glob(f"{PREFIX}*{SUFFIX}"), reverse=True):
        try:
            return Loaded(path, read(path), skipped)
        except CorruptTrainerCheckpoint as exc:
            log.warning("skipping trainer checkpoint: %s", exc)
            skipped.append(str(exc))
    if skipped:
        raise CorruptTrainerCheckpoint(f"no trainer checkpoint in {folder} verifies: {skipped}")
    return None
