"""The router lease: at most one router acts at a time, and one that lost the lease is fenced.

The lease is one key in a JetStream KV bucket; its value names the holder's incarnation. The
holder renews it every ttl/3 by compare-and-set on the key's revision. A router that wants it
watches the revision: one that stands still for a whole TTL, timed on the watcher's own clock, is a
lease that expired, and the watcher takes it by compare-and-set under incarnation + 1. A router
that finds no lease (none yet, or one deleted or purged) takes the bucket's last revision + 1, so
incarnations only grow while the bucket lives. No two routers read each other's clocks, so only
clock *rates* must agree, not their times.

A lease whose holder has exited is taken over at once, without waiting out the TTL, when the
holder's supervisor (`belayer up`) reports the exit: it sends that report only once it has reaped
the process, and a dead router renews nothing and acts no more. The report names the process by
the token the supervisor gave that start of it (`instance`), which the holder wrote into its
lease: a pid can name another process later, the token cannot. What the dead router sent before
dying is fenced as at any takeover (below). A forged report (its sender must have read the lease)
would let two routers act for up to a TTL; the fences below would still refuse the old one's
dispatches and appends once the new one has claimed, and it steps down at its next renewal.

The holder may act only until `sent + ttl`, where `sent` is when it sent its last renewal that the
store acknowledged: a successor that waits a full TTL after it *saw* that revision acts in a window
that does not overlap the holder's. A router stopped past its lease (SIGSTOP, a long pause)
therefore finds on waking that it may not act; its next renewal fails the compare-and-set and it
steps down for good.

That is the router's own discipline. The fence that holds whatever the old router does is
elsewhere: its incarnation rides on every dispatch and cancel (workers refuse a lower one) and the
successor claims every running request's log subject with a LogTakeover record, so the store
refuses the predecessor's appends (services/router/token_log.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from belayer_rl.shared import protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import ProcessEvent, RouterLease
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.router.lease")

KEY = "lease"
_lease_decoder = protocol.decoder_for(RouterLease)
_STORE_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError)


class LeaseLost(RuntimeError):
    """Another router took the lease: this one must stop acting, for good."""


async def lease_bucket(js: JetStreamContext, names: Subjects, replicas: int) -> KeyValue:
    """The lease bucket, created (file storage, one value per key) when it does not exist yet."""
    try:
        return await js.key_value(names.router_lease_bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=names.router_lease_bucket, history=1, storage=StorageType.FILE, replicas=replicas
            )
        )


async def lease_holder(js: JetStreamContext, names: Subjects) -> RouterLease | None:
    """The lease's current value (its holder, which may have stopped), or None when there is none
    or it does not decode. For operators, tests and benchmarks."""
    try:
        entry = await (await js.key_value(names.router_lease_bucket)).get(KEY)
    except nats.js.errors.KeyNotFoundError:
        return None
    try:
        return protocol.decode(_lease_decoder, entry.value or b"")
    except protocol.BadMessage:
        return None


class Lease:
    def __init__(self, kv: KeyValue, ttl_s: float, instance: str = "") -> None:
        self.kv = kv
        self.ttl_s = ttl_s
        self.instance = instance  # the supervisor's token for this start of this router; "" if none
        # This router's own token, on its lease and dispatches: two routers that hold one incarnation
        # (a lease revision lost to a power cut) are told apart by it, and fenced by workers.
        self.holder = secrets.token_hex(8)
        self.incarnation = 0  # 0 until acquired
        self.revision = 0  # of the key's value this router wrote last
        self.valid_until = 0.0  # monotonic: the end of the window in which this router may act
        self.lost = asyncio.Event()
        self.released = False  # handed back at a drain: never renewed again
        self.exited: dict[str, float] = {}  # instance -> monotonic time its exit was reported
        self.exit_reported = asyncio.Event()  # wakes a standby

    def held(self) -> bool:
        """Whether this router may act now: it holds the lease and its window has not run out."""
        return not self.lost.is_set() and time.monotonic() < self.valid_until

    def check(self) -> None:
        """Raise ServiceError("not-leader") unless the router may act now."""
        if not self.held():
            why = "lost its lease to another router" if self.lost.is_set() else "has no lease in force"
            raise ServiceError("not-leader", f"this router (incarnation {self.incarnation}) {why}")

    def _value(self, incarnation: int, *, released: bool = False) -> bytes:
        lease = RouterLease(
            incarnation=incarnation,
            pid=os.getpid(),
            host=socket.gethostname(),
            ttl_s=self.ttl_s,
            released=released,
            instance=self.instance,
            holder=self.holder,
        )
        return protocol.encode(lease)

    async def acquire(self) -> None:
        """Wait until the lease is free or expired, then take it. A router that starts while
        another one leads waits here: a warm standby."""
        seen: tuple[int, float] | None = None  # (revision, monotonic time first seen)
        waiting_logged = False
        while True:
            try:
                entry = await self.kv.get(KEY)
            except nats.js.errors.KeyNotFoundError:
                entry = None
            except _STORE_ERRORS as exc:
                log.info("lease unreadable (%s); asking again", exc)
                await asyncio.sleep(self.ttl_s / 4)
                continue
            now = time.monotonic()
            if entry is None or entry.value is None or entry.revision is None:
                # No lease, or a deleted one: its last incarnation is gone with it. The bucket's
                # last revision is above every incarnation ever written (each is written at a
                # revision at least its own), so counting from it never goes backwards.
                try:
                    last = (await self.kv.status()).stream_info.state.last_seq
                except _STORE_ERRORS as exc:
                    log.info("lease bucket unreadable (%s); asking again", exc)
                    await asyncio.sleep(self.ttl_s / 4)
                    continue
                if await self._take(last + 1, 0, now):
                    return
                continue
            if seen is None or seen[0] != entry.revision:
                seen = (entry.revision, now)
            holder = self._decode(entry.value, entry.revision)
            exited = holder is not None and self._has_exited(holder)
            if holder is not None and not holder.released and not exited and now - seen[1] < self.ttl_s:
                if not waiting_logged:
                    log.info(
                        "router %d on %s holds the lease (incarnation %d): standing by",
                        holder.pid, holder.host, holder.incarnation,
                    )  # fmt: skip
                    waiting_logged = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.exit_reported.wait(), self.ttl_s / 8)
                self.exit_reported.clear()
                continue
            # Expired, released, exited or unreadable (which nobody could be renewing): take it over.
            if holder is None:
                log.warning("taking over a lease that does not decode (revision %d)", entry.revision)
            elif exited:
                log.info("router %d on %s has exited (its supervisor says): taking its lease at once",
                         holder.pid, holder.host)  # fmt: skip
            incarnation = (holder.incarnation if holder is not None else entry.revision) + 1
            if await self._take(incarnation, entry.revision, now):
                return
            seen = None

    async def on_process(self, event: ProcessEvent) -> None:
        """A supervisor's report on one of its processes; an exit may free the lease."""
        if event.state == "exited" and event.instance:
            self._forget_old_exits()
            self.exited[event.instance] = time.monotonic()
            self.exit_reported.set()

    def _has_exited(self, holder: RouterLease) -> bool:
        """Whether the holder's exit was reported lately."""
        self._forget_old_exits()
        return bool(holder.instance) and holder.instance in self.exited

    def _forget_old_exits(self) -> None:
        """Reports are kept two TTLs: a report meets the lease it is about well within that, and a
        report about any other process is of no use."""
        now = time.monotonic()
        self.exited = {key: at for key, at in self.exited.items() if now - at < 2 * self.ttl_s}

    def _decode(self, value: bytes, revision: int) -> RouterLease | None:
        try:
            return protocol.decode(_lease_decoder, value)
        except protocol.BadMessage as exc:
            log.error("the lease at revision %d does not decode (%s)", revision, exc)
            return None

    async def _take(self, incarnation: int, last: int, sent: float) -> bool:
        try:
            if last == 0:
                self.revision = await self.kv.create(KEY, self._value(incarnation))
            else:
                self.revision = await self.kv.update(KEY, self._value(incarnation), last=last)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError):
            return False  # another router was faster: watch its lease instead
        except _STORE_ERRORS as exc:
            log.info("taking the lease failed (%s); trying again", exc)
            return False
        self.incarnation = incarnation
        self.valid_until = sent + self.ttl_s
        log.info("took the router lease: incarnation %d", incarnation)
        return True

    async def renew(self) -> None:
        """Renew every ttl/3 until another router takes the lease, or a worker or the log says a
        later incarnation exists (`lost`); then raise LeaseLost (an essential task: the router
        stops)."""
        unconfirmed: float | None = None  # when the oldest renewal with no answer yet was sent
        delay = self.ttl_s / 3
        while not self.released:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lost.wait(), delay)
            if self.lost.is_set():
                log.error("router incarnation %d was fenced by a later one: stepping down", self.incarnation)
                raise LeaseLost(f"incarnation {self.incarnation} was fenced")
            if self.released:
                return
            sent = time.monotonic()
            delay = self.ttl_s / 3
            try:
                # Waiting past the window would not help: a renewal answered after it is moot.
                async with asyncio.timeout(max(self.ttl_s / 3, self.valid_until - sent)):
                    self.revision = await self.kv.update(
                        KEY, self._value(self.incarnation), last=self.revision
                    )
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.BadRequestError) as exc:
                ours = await self._own_write_landed()
                if ours is None:  # the key is unreadable now: ask again at once
                    delay = 0.05
                    continue
                if ours:  # an earlier renewal landed whose answer was lost: it counts from its sending
                    if unconfirmed is not None:
                        self._extend(unconfirmed)
                    unconfirmed, delay = None, 0.0
                    continue
                self.lost.set()
                log.error("router incarnation %d lost its lease (%s): stepping down", self.incarnation, exc)
                raise LeaseLost(f"incarnation {self.incarnation} lost the router lease") from exc
            except _STORE_ERRORS as exc:
                # Not known to be renewed: the window runs out on its own, and a retry may still
                # succeed if nobody took over in the meantime.
                unconfirmed = sent if unconfirmed is None else unconfirmed
                log.warning("lease renewal failed (%s); %.2fs left", exc, self.valid_until - time.monotonic())
                delay = 0.05
                continue
            unconfirmed = None
            self._extend(sent)

    async def superseded(self) -> bool | None:
        """Whether the lease bucket names a later incarnation than this router's: the only proof
        that a successor exists. A worker's `fenced` answer is checked against it, since anyone
        holding that engine's credential can send one. None: the bucket does not say (unreadable
        now, or a lease that is missing or does not decode)."""
        try:
            entry = await self.kv.get(KEY)
        except (nats.js.errors.KeyNotFoundError, *_STORE_ERRORS):
            return None
        holder = self._decode(entry.value, entry.revision) if entry.value and entry.revision else None
        if holder is None:
            return None
        return holder.incarnation > self.incarnation or (
            holder.incarnation == self.incarnation and holder.holder not in ("", self.holder)
        )

    def _extend(self, sent: float) -> None:
        """A renewal sent at `sent` landed: a standby saw its revision no earlier, so it waits a
        whole TTL from then at least."""
        if not self.released:
            self.valid_until = max(self.valid_until, sent + self.ttl_s)

    async def _own_write_landed(self) -> bool | None:
        """Whether the key's current value is this router's own (a renewal that was applied but
        whose acknowledgement never came); if so, renew from its revision. None: unreadable."""
        try:
            entry = await self.kv.get(KEY)
        except nats.js.errors.KeyNotFoundError:
            return False
        except _STORE_ERRORS:
            return None
        if entry.value is None or entry.revision is None:
            return False
        holder = self._decode(entry.value, entry.revision)
        if holder is None or holder.incarnation != self.incarnation or holder.pid != os.getpid():
            return False
        self.revision = entry.revision
        return True

    async def release(self) -> None:
        """Hand the lease back at a drain, once the log is flushed: a standby takes it at once
        instead of after a TTL. This router acts no more."""
        self.released = True
        self.valid_until = 0.0
        if self.lost.is_set() or self.incarnation == 0:
            return
        try:
            async with asyncio.timeout(self.ttl_s):
                await self.kv.update(KEY, self._value(self.incarnation, released=True), last=self.revision)
        except (*_STORE_ERRORS, nats.js.errors.KeyWrongLastSequenceError) as exc:
            log.info("lease not released (%s): it expires on its own", exc)
            return
        log.info("released the router lease (incarnation %d)", self.incarnation)
