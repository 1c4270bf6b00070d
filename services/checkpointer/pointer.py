"""Prefix pointers: JetStream KV `trajectory -> PrefixPointer`, moved only forward by compare-and-set.

A pointer names a trajectory's latest ready checkpoint. It advances only to a strictly greater
(incarnation, k), and only by an update conditioned on the revision that was read, so two
checkpointers (or a checkpoint racing a restore) can never move it backwards. Two checkpoints of
equal (incarnation, k) are a conflict: the first to land wins and the other is told. A restore that
moves a trajectory to another host therefore starts a new incarnation rather than rewriting the host.
"""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from belayer_rl.shared import protocol
from belayer_rl.shared.protocol import PrefixPointer
from belayer_rl.shared.subjects import Subjects

_decoder = protocol.decoder_for(PrefixPointer)
MAX_CAS_TRIES = 16
HISTORY = 8  # kept per trajectory, for `nats kv history` when debugging
MAX_BYTES = 1 << 30  # bounded: a full bucket fails checkpoints loudly rather than dropping pointers


async def declare(js: JetStreamContext, names: Subjects, replicas: int = 1) -> KeyValue:
    try:
        return await js.key_value(names.prefix_pointer_bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=names.prefix_pointer_bucket,
                history=HISTORY,
                storage=StorageType.FILE,
                max_bytes=MAX_BYTES,
                replicas=replicas,
            )
        )


def order(pointer: PrefixPointer) -> tuple[int, int]:
    return (pointer.incarnation, pointer.k)


async def read(kv: KeyValue, trajectory: str) -> tuple[PrefixPointer | None, int]:
    """The pointer and its revision (0 when absent or deleted); PoisonedRecord when it does not
    decode (no one may move it then: its order is unknown)."""
    try:
        got = await kv.get(trajectory)
    except nats.js.errors.KeyNotFoundError:
        return None, 0
    if not got.value or got.revision is None:
        return None, got.revision or 0
    try:
        return protocol.decode(_decoder, got.value), got.revision
    except protocol.BadMessage as exc:
        raise protocol.PoisonedRecord("prefix-pointers", trajectory, got.revision, str(exc)) from None


async def advance(kv: KeyValue, new: PrefixPointer) -> tuple[bool, PrefixPointer | None]:
    """Move the pointer to `new` if that is strictly ahead; (moved, the pointer now in effect). Not
    moved with an equal order in effect: `conflict` tells whether that is another checkpoint."""
    for _ in range(MAX_CAS_TRIES):
        current, revision = await read(kv, new.trajectory)
        if current is not None and order(current) >= order(new):
            return False, current
        value = protocol.encode(new)
        try:
            if revision == 0:
                await kv.create(new.trajectory, value)
            else:
                await kv.update(new.trajectory, value, last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            continue  # somebody moved it meanwhile: read again
        return True, new
    raise RuntimeError(
        f"trajectory {new.trajectory}: prefix pointer compare-and-set lost {MAX_CAS_TRIES} times"
    )


def conflict(new: PrefixPointer, now: PrefixPointer | None) -> bool:
    """Whether `now`, in effect instead of `new`, is another checkpoint at the same (incarnation, k)."""
    return now is not None and order(now) == order(new) and now.checkpoint_id != new.checkpoint_id


async def delete(kv: KeyValue, trajectory: str) -> None:
    try:
        await kv.purge(trajectory)
    except nats.js.errors.KeyNotFoundError:
        pass
