"""The token log in JetStream: one subject per request, records LogStart, (LogDispatch, LogChunk*)*, LogEnd.

Chunk i of a request covers generated positions [i*k, (i+1)*k); only the last chunk, written at the
request's end, may be shorter. Each record is published with the dedupe id `<request>:<index>.<n>`
for a chunk of n tokens (the start and end records use `start` and `end`), so a retried or resumed
publish never duplicates tokens, while a short tail chunk and a later whole chunk of the same index
(an end whose request was resumed after all) are both kept: a reader places chunks by position,
so the longer one extends the log and duplicates change nothing.

The writer keeps one queue for all requests and appends in order in a background task, so a slow
or reconnecting server delays the log but never the token stream to clients.

Fencing: every append names the sequence of the last record on its request's subject that this
router knows of (JetStream's Nats-Expected-Last-Subject-Sequence). A successor router claims each
running request with a LogTakeover record, so whatever its predecessor still appends to that
subject is refused by the store itself (`fenced`), however late the predecessor wakes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import LogChunk, LogDispatch, LogEnd, LogRecord, LogStart, LogTakeover
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.router.log")

_record_decoder = protocol.decoder_for(LogRecord)
PUBLISH_TIMEOUT_S = 2.0
MAX_PUBLISH_TRIES = 60  # about two minutes of a server that does not answer
LOG_FULL_CODE = 10077  # JetStream's store failure; "maximum bytes exceeded" when full (discard NEW)
WRONG_LAST_SEQUENCE_CODE = 10071  # an expected-last-subject-sequence that is not the subject's last
ROOM_CHECK_S = 1.0  # how long a reading of the log's size is trusted
RECORD_OVERHEAD = 96  # what the store keeps per record beside subject and payload (headers, framing)
MAX_FILTER_SUBJECTS = 500  # subjects one reader's consumer filters on; more are read in turns


def record_id(record: LogRecord) -> str:
    """The record's dedupe id. A LogStart's is new at each call: a request id may be used again
    once its old records are purged, and an old start must never pass for a new one."""
    match record:
        case LogStart():
            return bus.log_msg_id(record.request_id, f"start.{uuid.uuid4().hex}")
        case LogChunk():
            return bus.log_msg_id(record.request_id, f"{record.index}.{len(record.tokens)}")
        case LogEnd():
            return bus.log_msg_id(record.request_id, "end")
        case LogTakeover():
            return bus.log_msg_id(record.request_id, f"takeover.{record.incarnation}")
        case LogDispatch():
            # An adopting router logs the attempt its predecessor dispatched: its own record.
            return bus.log_msg_id(record.request_id, f"dispatch.{record.incarnation}.{record.attempt}")


def stored_size(subject: str, data: bytes) -> int:
    """About what the store keeps for one record: its subject, payload, headers and framing."""
    return len(subject) + len(data) + RECORD_OVERHEAD


class Usage:
    """The bytes of the token log each client's requests hold: every record this router appended
    or read back, until the request's records are purged (retention.py)."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[str, int]] = {}  # request id -> (owner, bytes)
        self.clients: collections.Counter[str] = collections.Counter()  # owner -> bytes

    def add(self, record: LogRecord, size: int) -> None:
        owner = record.owner if isinstance(record, LogStart) else self.owner(record.request_id)
        self.count(record.request_id, owner, size)

    def count(self, request_id: str, owner: str, size: int) -> None:
        held = self.requests[request_id][1] if request_id in self.requests else 0
        self.requests[request_id] = (owner, held + size)
        self.clients[owner] += size

    def owner(self, request_id: str) -> str:
        return self.requests[request_id][0] if request_id in self.requests else ""

    def held(self, request_id: str) -> int:
        return self.requests[request_id][1] if request_id in self.requests else 0

    def set(self, request_id: str, owner: str, size: int) -> None:
        """What a request read back from the store holds (counted again from scratch)."""
        self.release(request_id)
        self.count(request_id, owner, size)

    def release(self, request_id: str) -> None:
        """Its records left the log."""
        if request_id not in self.requests:
            return
        owner, held = self.requests.pop(request_id)
        self.clients[owner] -= held
        if self.clients[owner] <= 0:
            del self.clients[owner]


def written_by(record: LogRecord) -> int:
    """The router incarnation a record names (a LogStart names none)."""
    return 0 if isinstance(record, LogStart) else record.incarnation


async def append(
    js: JetStreamContext,
    names: Subjects,
    record: LogRecord,
    after: int,
    *,
    incarnation: int,
    usage: Usage | None = None,
) -> int:
    """Append one record after the subject's record at stream sequence `after` (0: the subject
    holds none yet) and wait for the server's ack; returns the record's sequence. Retries
    (bounded) through reconnects. Raises ServiceError("fenced") when a later router incarnation
    than `incarnation` wrote on the subject since: it claimed the request; and
    ServiceError("duplicate-request") when a LogStart finds its subject holding another request's
    records. What the store took is counted in `usage`."""
    subject = names.token_log(record.request_id)
    data = protocol.encode(record)
    msg_id = record_id(record)
    size = stored_size(subject, data)
    failure: Exception | None = None
    for attempt in range(1, MAX_PUBLISH_TRIES + 1):
        if attempt > 1:
            await asyncio.sleep(min(0.05 * attempt, 1.0))
        headers = {"Nats-Msg-Id": msg_id, "Nats-Expected-Last-Subject-Sequence": str(after)}
        try:
            ack = await js.publish(subject, data, timeout=PUBLISH_TIMEOUT_S, headers=headers)
            # A duplicate appended nothing. Its sequence is that of the record it repeats: ours,
            # landed on an earlier try whose ack was lost (a server that dedupes before it checks
            # the expected sequence), or an older one (a tail chunk an earlier router wrote), in
            # which case the subject's last record is still the one at `after`.
            if ack.duplicate:
                return max(after, ack.seq)
            if usage is not None:
                usage.add(record, size)
            return ack.seq
        except nats.js.errors.APIError as exc:
            if exc.err_code == LOG_FULL_CODE and "maximum" in (exc.description or ""):  # no retry frees space
                raise bus.ServiceError("log-full", f"token log full: {exc.description}") from exc
            failure = exc
            if exc.err_code != WRONG_LAST_SEQUENCE_CODE:
                continue
            # The subject moved past `after`: our own earlier try landed (its ack lost), or a
            # later router claimed the request. The last record says which.
            try:
                last = await js.get_last_msg(names.token_log_stream, subject)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as read_failure:
                failure = read_failure  # unreadable for now: ask again
                continue
            last_seq = last.seq or 0  # a stored record always has one
            if last.headers is not None and last.headers.get("Nats-Msg-Id") == msg_id:
                if usage is not None:
                    usage.add(record, size)
                return last_seq
            try:
                last_record: LogRecord | None = protocol.decode(_record_decoder, last.data or b"")
            except protocol.BadMessage:
                last_record = None  # a record nobody can read claims nothing
            writer = 0 if last_record is None else written_by(last_record)
            if writer > incarnation:
                raise bus.ServiceError(
                    "fenced",
                    f"router incarnation {writer} claimed {record.request_id}; this is {incarnation}",
                ) from exc
            if isinstance(record, LogStart):  # the subject is another request's (or an earlier one's)
                raise bus.ServiceError(
                    "duplicate-request", f"request {record.request_id} exists; attach to it"
                ) from exc
            if after > 0 and isinstance(last_record, LogStart):
                # The request this writer knew left the log and its id was started again: whatever
                # this writer still holds of the old one is stale (a router paused past --ended-keep).
                raise bus.ServiceError(
                    "fenced", f"{record.request_id} was started again after the request this router knew"
                ) from exc
            after = last_seq  # our own records, or older ones: follow the last
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            failure = exc
    raise bus.ServiceError("log-unavailable", f"token log append failed {MAX_PUBLISH_TRIES} times: {failure}")


class LogWriter:
    """Appends records in the order they were queued, in one owned background task. Each request's
    records follow the last one this router wrote or read on its subject (`last`)."""

    def __init__(
        self, js: JetStreamContext, names: Subjects, usage: Usage, on_end: Callable[[str, int], None]
    ) -> None:
        self.names = names
        self.js = js
        self.usage = usage
        self.on_end = on_end  # (request id, its LogEnd's sequence): the request index moves it
        self.incarnation = 0  # the router's, once it holds the lease
        # Each record with the future its appending resolves: None once appended, else why not.
        self.queue: asyncio.Queue[tuple[LogRecord, asyncio.Future[bus.ServiceError | None]]] = asyncio.Queue()
        self.appended = 0
        self.last: dict[str, int] = {}  # request id -> sequence of its subject's last record
        # request id -> its records from the first chunk dropped on. A reader places a chunk only
        # where it continues the log, so these are written again, in order, before anything else
        # of the request: above all before its end, which must not stand in the log without its
        # tokens. (Written twice, a record is deduplicated by its id.)
        self.unlogged: dict[str, list[LogRecord]] = {}

    def put(self, record: LogRecord) -> asyncio.Future[bus.ServiceError | None]:
        """Queue the record; the future says when it is durable (None) or why it was dropped."""
        appended: asyncio.Future[bus.ServiceError | None] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((record, appended))
        return appended

    async def append_now(self, record: LogRecord) -> None:
        """Append outside the queue and wait for it (a LogStart, a LogTakeover): for a request with
        nothing of it queued."""
        self.last[record.request_id] = await append(
            self.js,
            self.names,
            record,
            self.last.get(record.request_id, 0),
            incarnation=self.incarnation,
            usage=self.usage,
        )

    async def run(self) -> None:
        """Raises ServiceError("fenced") when the store refused an append because a successor
        router claimed the request: this router must stop (an essential task)."""
        while True:
            record, appended = await self.queue.get()
            try:
                await self.fill_gap(record.request_id)
                await self.append_now(record)
                self.appended += 1
                if isinstance(record, LogEnd):
                    self.on_end(record.request_id, self.last.pop(record.request_id))  # nothing follows
                appended.set_result(None)
            except bus.ServiceError as exc:
                appended.set_result(exc)
                if exc.code == "fenced":
                    log.error("the token log refused %s: %s", type(record).__name__, exc.message)
                    raise
                log.error("dropped %s of %s: %s", type(record).__name__, record.request_id, exc)
                if isinstance(record, LogChunk) or record.request_id in self.unlogged:
                    self.unlogged.setdefault(record.request_id, []).append(record)
            finally:
                self.queue.task_done()

    def forget(self, request_id: str) -> None:
        """The router forgot the request: nothing more of it will be written."""
        self.last.pop(request_id, None)
        self.unlogged.pop(request_id, None)

    async def fill_gap(self, request_id: str) -> None:
        """Write the request's records from its first dropped chunk on, in order; raises as
        `append` does at the first that fails again (it and the rest stay)."""
        pending = self.unlogged.get(request_id, [])
        while pending:
            await self.append_now(pending[0])
            self.appended += 1
            pending.pop(0)
        self.unlogged.pop(request_id, None)

    async def drain(self) -> None:
        """Until every queued record is appended (the caller bounds the wait)."""
        await self.queue.join()


class Room:
    """Whether the log may take another request: below bus.LOG_ROOM_FRACTION of its bound, so that the
    requests already running keep room for their chunks and ends. Read at most every ROOM_CHECK_S."""

    def __init__(self, js: JetStreamContext, names: Subjects) -> None:
        self.js, self.names = js, names
        self.checked_at = -ROOM_CHECK_S
        self.full: str | None = None  # why not, at the last reading

    async def check(self) -> None:
        """Raise ServiceError("log-full") when there is no room for a new request."""
        now = time.monotonic()
        if now - self.checked_at >= ROOM_CHECK_S:
            self.checked_at = now
            try:
                async with asyncio.timeout(ROOM_CHECK_S):
                    info = await self.js.stream_info(self.names.token_log_stream)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                # A leader election, say: the last reading stands, and the append itself will say
                # whether the log takes the request.
                log.info("token log size unknown (%s); the last reading stands", exc)
            else:
                self.full = _full(info.state.bytes, info.config.max_bytes or 0)
        if self.full is not None:
            raise bus.ServiceError("log-full", self.full)


def _full(used: int, bound: int) -> str | None:
    """Why a log holding `used` of `bound` bytes takes no new request, or None when it has room."""
    if bound <= 0 or used < bus.LOG_ROOM_FRACTION * bound:
        return None
    return (
        f"the token log holds {used} of its {bound} bytes; new requests wait for old logs to age out"
        " (raise --log-max-mb)"
    )


# ---------------------------------------------------------------- reading


@dataclass
class LoggedRequest:
    start: LogStart
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of tokens[:len(logprobs)] (Request.logprobs)
    end: LogEnd | None = None
    last_sequence: int = 0  # of the last record on its subject, whatever it was
    incarnation: int = 0  # the highest router incarnation that claimed it (LogTakeover)
    # (engine, epoch, attempt) of every LogDispatch: the attempts a router placed or carried on.
    dispatches: set[tuple[str, int, int]] = field(default_factory=set)
    size: int = 0  # what its records take in the store (Usage)

    def place(self, chunk: LogChunk) -> None:
        """Reconcile by position: a chunk extends the log only where it continues it."""
        if chunk.position > len(self.tokens):
            log.warning("%s: gap in token log at %d", chunk.request_id, len(self.tokens))
            return
        skip = len(self.tokens) - chunk.position
        if len(self.logprobs) == len(self.tokens) and chunk.logprobs:
            self.logprobs.extend(chunk.logprobs[skip:])
        self.tokens.extend(chunk.tokens[skip:])


@dataclass
class StoredRecord:
    subject: str
    sequence: int
    record: LogRecord | None  # None: it does not decode, for `error`
    error: str = ""
    size: int = 0  # stored_size


async def each_record(
    js: JetStreamContext, names: Subjects, subjects: Collection[str] | None = None
) -> AsyncIterator[StoredRecord]:
    """Every record in the stream, or on `subjects` alone, in stream order."""
    if subjects is not None and not subjects:
        return
    async for msg in bus.each_message(js, names.token_log_stream, names.token_log_all, subjects):
        sequence = msg.metadata.sequence.stream
        size = stored_size(msg.subject, msg.data)
        try:
            record = protocol.decode(_record_decoder, msg.data)
        except protocol.BadMessage as exc:
            yield StoredRecord(msg.subject, sequence, None, str(exc), size)
        else:
            yield StoredRecord(msg.subject, sequence, record, size=size)


async def read_all(
    js: JetStreamContext, names: Subjects, request_ids: Collection[str] | None = None
) -> tuple[dict[str, LoggedRequest], list[protocol.PoisonedRecord]]:
    """Every request in the stream (or those of `request_ids`), rebuilt from its records, and the
    records that do not decode (skipped: a record that stops every router start would stop the
    cluster). A requested id with no LogStart in the log is not in the answer."""
    if request_ids is None:
        return await read_requests(js, names, None)
    requests: dict[str, LoggedRequest] = {}
    skipped: list[protocol.PoisonedRecord] = []
    ids = sorted(request_ids)
    for first in range(0, len(ids), MAX_FILTER_SUBJECTS):
        subjects = [names.token_log(request_id) for request_id in ids[first : first + MAX_FILTER_SUBJECTS]]
        some, poisoned = await read_requests(js, names, subjects)
        requests.update(some)
        skipped += poisoned
    return requests, skipped


async def read_request(js: JetStreamContext, names: Subjects, request_id: str) -> LoggedRequest | None:
    """One request from its records, or None when the log holds no start of it. Costs one
    look-up when it holds nothing on the subject."""
    try:
        await js.get_last_msg(names.token_log_stream, names.token_log(request_id))
    except nats.js.errors.NotFoundError:
        return None
    requests, _ = await read_requests(js, names, [names.token_log(request_id)])
    return requests.get(request_id)


async def read_requests(
    js: JetStreamContext, names: Subjects, subjects: Collection[str] | None
) -> tuple[dict[str, LoggedRequest], list[protocol.PoisonedRecord]]:
    requests: dict[str, LoggedRequest] = {}
    skipped: list[protocol.PoisonedRecord] = []
    last_sequence: dict[str, int] = {}  # subject -> its last record's stream sequence
    size: collections.Counter[str] = collections.Counter()  # request id -> bytes of its records
    async for stored in each_record(js, names, subjects):
        last_sequence[stored.subject] = stored.sequence
        record = stored.record
        if record is not None:
            size[record.request_id] += stored.size
        if record is None:
            skipped.append(
                protocol.PoisonedRecord("token-log", stored.subject, stored.sequence, stored.error)
            )
        match record:
            case LogStart():
                requests.setdefault(record.request_id, LoggedRequest(record))
            case LogChunk() if record.request_id in requests:
                requests[record.request_id].place(record)
            case LogEnd() if record.request_id in requests:
                requests[record.request_id].end = record
            case LogDispatch() if record.request_id in requests:
                requests[record.request_id].dispatches.add((record.engine_id, record.epoch, record.attempt))
            case LogTakeover() if record.request_id in requests:
                entry = requests[record.request_id]
                entry.incarnation = max(entry.incarnation, record.incarnation)
    for request_id, entry in requests.items():
        entry.last_sequence = last_sequence[names.token_log(request_id)]
        entry.size = size[request_id]
    return requests, skipped
