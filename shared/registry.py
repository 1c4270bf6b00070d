"""The engine registry: JetStream KV `engine id -> EngineEntry`.

An engine's epoch changes only by compare-and-set on the entry's revision, so two parties can never
both install a worker for the same engine: the loser sees a revision conflict and retries or stops.
"""

from __future__ import annotations

import nats.js.errors
from nats.js.kv import KeyValue

from belayer_rl.shared import protocol
from belayer_rl.shared.protocol import EngineEntry

_entry_decoder = protocol.decoder_for(EngineEntry)
MAX_CAS_TRIES = 16


async def read(kv: KeyValue, engine_id: str) -> tuple[EngineEntry | None, int]:
    """The entry and its revision (0 when absent)."""
    try:
        got = await kv.get(engine_id)
    except nats.js.errors.KeyNotFoundError:
        return None, 0
    if got.value is None or got.revision is None:
        return None, 0
    return protocol.decode(_entry_decoder, got.value), got.revision


async def install_worker(kv: KeyValue, engine_id: str, pid: int) -> int:
    """Install `pid` as the engine's worker under a new epoch by compare-and-set; return the epoch."""
    for _ in range(MAX_CAS_TRIES):
        entry, revision = await read(kv, engine_id)
        epoch = (entry.epoch if entry else 0) + 1
        value = protocol.encode(EngineEntry(engine_id=engine_id, epoch=epoch, pid=pid))
        try:
            if revision == 0:
                await kv.create(engine_id, value)
            else:
                await kv.update(engine_id, value, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue  # somebody else moved the entry: read it again
        return epoch
    raise RuntimeError(f"engine {engine_id}: registry compare-and-set lost {MAX_CAS_TRIES} times")


async def entries(kv: KeyValue) -> list[EngineEntry]:
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return []
    found = []
    for key in keys:
        entry, _ = await read(kv, key)
        if entry is not None:
            found.append(entry)
    return found


async def quarantine(kv: KeyValue, engine_id: str) -> None:
    """Mark the engine quarantined (compare-and-set); its epoch stays, so nobody serves it."""
    for _ in range(MAX_CAS_TRIES):
        entry, revision = await read(kv, engine_id)
        if entry is None:
            return
        value = protocol.encode(
            EngineEntry(engine_id=engine_id, epoch=entry.epoch, pid=entry.pid, health="quarantined")
        )
        try:
            await kv.update(engine_id, value, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue
        return
    raise RuntimeError(f"engine {engine_id}: quarantine compare-and-set lost {MAX_CAS_TRIES} times")
