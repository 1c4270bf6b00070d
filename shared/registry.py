"""The engine registry: JetStream KV `engine id -> EngineEntry`.

An engine's epoch changes only by compare-and-set on the entry's revision, so two parties can never
both install a worker for the same engine: the loser sees a revision conflict and retries or stops.
A quarantine mark stays until `unquarantine` clears it: no install overwrites it. An entry that
does not decode raises PoisonedRecord; an install replaces it under an epoch above any it could
have held (its revision: every epoch of the key was one write of the bucket's stream).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import nats.js.errors
from nats.js.kv import KeyValue

from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import EngineEntry, PoisonedRecord

_entry_decoder = protocol.decoder_for(EngineEntry)
MAX_CAS_TRIES = 16


class Quarantined(RuntimeError):
    """The engine is quarantined: no worker may be installed for it."""


async def read(kv: KeyValue, engine_id: str) -> tuple[EngineEntry | None, int]:
    """The entry and its revision (0 when absent)."""
    try:
        got = await kv.get(engine_id)
    except nats.js.errors.KeyNotFoundError:
        return None, 0
    if got.value is None or got.revision is None:
        return None, 0
    try:
        return protocol.decode(_entry_decoder, got.value), got.revision
    except protocol.BadMessage as exc:
        raise PoisonedRecord("engine-registry", engine_id, got.revision, str(exc)) from None


class Installed(NamedTuple):
    epoch: int
    replaced: PoisonedRecord | None  # the undecodable entry the install overwrote, to report


async def install_worker(kv: KeyValue, engine_id: str, pid: int) -> Installed:
    """Install `pid` as the engine's worker under a new epoch by compare-and-set."""
    for _ in range(MAX_CAS_TRIES):
        replaced = None
        try:
            entry, revision = await read(kv, engine_id)
        except PoisonedRecord as poisoned:
            entry, revision, replaced = None, poisoned.sequence, poisoned
        if entry is not None and entry.health == "quarantined":
            raise Quarantined(
                f"engine {engine_id} is quarantined: `belayer engines unquarantine {engine_id}`"
            )
        epoch = (entry.epoch if entry else replaced.sequence if replaced else 0) + 1
        value = protocol.encode(EngineEntry(engine_id=engine_id, epoch=epoch, pid=pid))
        try:
            if revision == 0:
                await kv.create(engine_id, value)
            else:
                await kv.update(engine_id, value, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue  # somebody else moved the entry: read it again
        return Installed(epoch, replaced)
    raise RuntimeError(f"engine {engine_id}: registry compare-and-set lost {MAX_CAS_TRIES} times")


async def entries(kv: KeyValue) -> tuple[list[EngineEntry], list[PoisonedRecord]]:
    """Every entry that decodes, and those that do not."""
    # kv.keys() would leave its consumer on the server for five minutes after it is done; a
    # router or supervisor reads the registry often, so its readers go after a few seconds.
    watcher = await kv.watchall(ignore_deletes=True, meta_only=True, inactive_threshold=bus.READER_IDLE_S)
    keys = []
    try:
        async for update in watcher:
            if update is None:  # nothing more stored
                break
            keys.append(update.key)
    finally:
        await watcher.stop()
    found, poisoned = [], []
    for key in keys:
        try:
            entry, _ = await read(kv, key)
        except PoisonedRecord as bad:
            poisoned.append(bad)
            continue
        if entry is not None:
            found.append(entry)
    return found, poisoned


async def quarantine(kv: KeyValue, engine_id: str) -> None:
    """Mark the engine quarantined (compare-and-set); its epoch stays, so nobody serves it."""
    await set_health(kv, engine_id, "quarantined")


async def unquarantine(kv: KeyValue, engine_id: str) -> None:
    """Clear the engine's quarantine mark (compare-and-set); the next install may serve it."""
    await set_health(kv, engine_id, "serving")


async def set_health(kv: KeyValue, engine_id: str, health: Literal["serving", "quarantined"]) -> None:
    for _ in range(MAX_CAS_TRIES):
        entry, revision = await read(kv, engine_id)
        if entry is None:
            return
        value = protocol.encode(
            EngineEntry(engine_id=engine_id, epoch=entry.epoch, pid=entry.pid, health=health)
        )
        try:
            await kv.update(engine_id, value, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue
        return
    raise RuntimeError(f"engine {engine_id}: {health} compare-and-set lost {MAX_CAS_TRIES} times")
