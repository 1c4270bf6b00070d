"""What the token log holds, whose it is, and when it leaves.

The request index, a stream of its own, holds one entry per request whose records are in the log:
- LogOpen, written before the request's LogStart, until it ends;
- then LogClosed, naming its LogEnd's sequence, until `ended_keep_s` after the end, when the
  request's records up to that end are purged from the log and the entry goes too.

A successor router reads the open entries and the records of those requests alone (`open_ids`,
then token_log.read_all), however many requests ended before. The closed entries it reads in the
background (`Retention.run`), to purge them when they are due and to count their bytes.

Each client (a request's owner) may hold at most `log_client_share` of the log's room: past it,
that client's new requests are refused (`log-full`) while every other client's go on. Running
requests are never cut: they grow past the share and free it when they are purged.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from belayer_rl.services.router.token_log import Usage
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.metrics import RouterMetrics
from belayer_rl.shared.protocol import IndexComplete, IndexEntry, LogClosed, LogOpen, LogStart
from belayer_rl.shared.runtime import Skipped
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.router.retention")

_entry_decoder = protocol.decoder_for(IndexEntry)
INDEX_TIMEOUT_S = 2.0  # one write or purge of the index
RETRY_S = 1.0  # a purge that failed is tried again after this long
BATCH = 256  # closes or purges of the index and the log in flight at once
LOAD_TRIES = 8  # reads of a predecessor's closed entries, backing off, before they are left to age out


@dataclass
class Due:
    entry: LogClosed
    index_sequence: int  # of the LogClosed in the index: a later entry of a reused id is not purged
    at: float  # unix seconds


class Retention:
    """The request index and the clients' shares of the token log (see the module docstring)."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Subjects,
        config: RouterConfig,
        usage: Usage,
        metrics: RouterMetrics,
        skipped: Skipped,
    ) -> None:
        self.js, self.names, self.usage, self.metrics = js, names, usage, metrics
        self.skipped = skipped  # the runtime's report of an entry that does not decode
        self.keep_s = config.ended_keep_s
        self.share = int(config.log_client_share * bus.LOG_ROOM_FRACTION * (config.log_max_mb << 20))
        self.ends: asyncio.Queue[tuple[str, int]] = asyncio.Queue()  # (request id, LogEnd's sequence)
        self.due: collections.deque[Due] = collections.deque()  # in the order they come due
        self.purgeable = True  # False for a log of an earlier version, which forbids purges

    # ------------------------------------------------------------ a request's life

    def check_share(self, start: LogStart) -> None:
        """Raise ServiceError("log-full") when the request's owner holds its share of the log."""
        held = self.usage.clients[start.owner]
        if held + len(protocol.encode(start)) > self.share:
            self.metrics.log_share_refused.labels(start.owner).inc()
            raise bus.ServiceError(
                "log-full",
                f"client {start.owner or '(anonymous)'} holds {held} bytes of the token log, and its"
                f" share is {self.share}; its new requests wait until its old ones leave the log"
                f" ({self.keep_s:.0f}s after they end; raise --log-client-share or --log-max-mb)",
            )

    async def open(self, request_id: str, owner: str) -> int:
        """Index the request as running: before its LogStart, so no running request is unindexed.
        Returns the entry's sequence in the index. Raises ServiceError("log-unavailable")."""
        entry = LogOpen(request_id=request_id, owner=owner)
        return await self.write(self.names.request_open(request_id), entry)

    async def unopen(self, request_id: str, sequence: int | None = None) -> None:
        """Drop the request's open entry: up to `sequence` (the one `open` wrote, and nothing a later
        request of the same id wrote since), or whatever is there. Best effort: a stale entry is
        dropped by the next router that reads it and finds no start."""
        try:
            await self.js.purge_stream(
                self.names.request_index_stream,
                subject=self.names.request_open(request_id),
                seq=None if sequence is None else sequence + 1,
            )
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("could not drop the index entry of %s: %s", request_id, exc)

    def ended(self, request_id: str, end_sequence: int) -> None:
        """Its LogEnd is in the log at `end_sequence` (called by the log writer, in order)."""
        self.ends.put_nowait((request_id, end_sequence))

    # ------------------------------------------------------------ the background task

    async def run(self) -> None:
        """Reads the closed entries a predecessor left, then closes what ends and purges what is
        due, a batch at a time, until cancelled."""
        for attempt in range(LOAD_TRIES):
            try:
                info = await self.js.stream_info(self.names.token_log_stream)
                await self.load_closed()
                break
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                log.warning("could not read the closed requests of the index (%s); trying again", exc)
                await asyncio.sleep(min(RETRY_S * 2**attempt, 30.0))
        else:  # they stay until the log's max age; everything from here on is purged on time
            log.error("gave up reading the closed requests of the index")
            info = None
        self.purgeable = info is None or not info.config.deny_purge
        if not self.purgeable:
            log.error(
                "the token log %s was made by an earlier version, which forbids purges: ended requests"
                " stay in it until they age out (24 h). To purge them, delete the stream while the"
                " cluster is stopped (what runs in it is lost); the router makes it again.",
                self.names.token_log_stream,
            )
        while True:
            await self.purge_due()  # first: under a steady stream of ends no wait ever times out
            wait = max(0.0, self.due[0].at - time.time()) if self.due else None
            try:
                async with asyncio.timeout(wait):
                    ended = [await self.ends.get()]
            except TimeoutError:
                continue
            while not self.ends.empty() and len(ended) < BATCH:
                ended.append(self.ends.get_nowait())
            closed = await asyncio.gather(
                *(self.close(request_id, sequence) for request_id, sequence in ended)
            )
            for (request_id, sequence), done in zip(ended, closed, strict=True):
                if not done:  # the index is away: its entry must still be written
                    self.ends.put_nowait((request_id, sequence))
            if not all(closed):
                await asyncio.sleep(RETRY_S)

    async def close(self, request_id: str, end_sequence: int) -> bool:
        """Move the request's entry to closed; False when the index did not take it."""
        entry = LogClosed(
            request_id=request_id,
            owner=self.usage.owner(request_id),
            end_sequence=end_sequence,
            size=self.usage.held(request_id),
            ended_at=time.time(),
        )
        try:
            sequence = await self.write(self.names.request_closed(request_id), entry)
        except bus.ServiceError as exc:
            log.warning("could not close %s in the request index (%s); trying again", request_id, exc.message)
            return False
        self.due.append(Due(entry, sequence, entry.ended_at + self.keep_s))
        self.metrics.log_client_bytes.labels(entry.owner).set(self.usage.clients[entry.owner])
        await self.unopen(request_id)
        return True

    async def purge_due(self) -> None:
        now = time.time()
        due: list[Due] = []
        while self.due and self.due[0].at <= now and len(due) < BATCH:
            due.append(self.due.popleft())
        purged = await asyncio.gather(*(self.purge(one) for one in due))
        for one, done in zip(due, purged, strict=True):
            if not done:
                one.at = now + RETRY_S
                bisect.insort(self.due, one, key=lambda entry: entry.at)

    async def purge(self, due: Due) -> bool:
        """The request's records up to its end leave the log, then its entry the index."""
        request_id = due.entry.request_id
        try:
            async with asyncio.timeout(INDEX_TIMEOUT_S):
                if self.purgeable:  # up to its end: a later request of the same id keeps its records
                    await self.js.purge_stream(
                        self.names.token_log_stream,
                        subject=self.names.token_log(request_id),
                        seq=due.entry.end_sequence + 1,
                    )
                await self.js.purge_stream(
                    self.names.request_index_stream,
                    subject=self.names.request_closed(request_id),
                    seq=due.index_sequence + 1,
                )
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("could not purge %s from the token log (%s); trying again", request_id, exc)
            return False
        self.usage.release(request_id)
        self.metrics.log_purged.inc()
        self.metrics.log_client_bytes.labels(due.entry.owner).set(self.usage.clients[due.entry.owner])
        return True

    async def load_closed(self) -> None:
        """The closed entries in the index (a predecessor's), due in the order they ended."""
        found: list[Due] = []
        async for sequence, entry in self.read(self.names.request_closed_all):
            if isinstance(entry, LogClosed):
                self.usage.set(
                    entry.request_id, entry.owner, entry.size
                )  # (counted from its records, if read)
                found.append(Due(entry, sequence, entry.ended_at + self.keep_s))
        self.due.extend(sorted(found, key=lambda due: due.at))

    async def complete(self) -> bool:
        """Whether the index covers the whole log. It does not when the log is older than the
        index (an upgrade), or a takeover that filled the index from the whole log stopped midway:
        then the next takeover reads the whole log, and says it is done (`mark_complete`)."""
        try:
            await self.js.get_last_msg(self.names.request_index_stream, self.names.request_index_complete)
        except nats.js.errors.NotFoundError:
            tokens = await self.js.stream_info(self.names.token_log_stream)
            return tokens.state.messages == 0 and await self.mark_complete()
        return True

    async def mark_complete(self) -> bool:
        """Record that every request in the log is indexed. Raises ServiceError("log-unavailable")."""
        await self.write(self.names.request_index_complete, IndexComplete(since=time.time()))
        return True

    # ------------------------------------------------------------ the index

    async def open_ids(self) -> set[str]:
        """The requests indexed as running."""
        return {entry.request_id async for _, entry in self.read(self.names.request_open_all)}

    async def read(self, subject: str) -> AsyncIterator[tuple[int, IndexEntry]]:
        """The index's entries on `subject`, with their sequences; those that do not decode are
        skipped and reported (the log itself says what a request is)."""
        async for msg in bus.each_message(self.js, self.names.request_index_stream, subject):
            sequence = msg.metadata.sequence.stream
            try:
                entry = protocol.decode(_entry_decoder, msg.data)
            except protocol.BadMessage as exc:
                await self.skipped(protocol.PoisonedRecord("request-index", msg.subject, sequence, str(exc)))
            else:
                yield sequence, entry

    async def write(self, subject: str, entry: IndexEntry | IndexComplete) -> int:
        try:
            ack = await self.js.publish(subject, protocol.encode(entry), timeout=INDEX_TIMEOUT_S)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise bus.ServiceError(
                "log-unavailable", f"the request index did not take {subject}: {exc}"
            ) from exc
        return ack.seq
