"""The token log in JetStream: one subject per request, records LogStart, LogChunk*, LogEnd.

Chunk i of a request covers generated positions [i*k, (i+1)*k); only the last chunk, written at the
request's end, may be shorter. Each record is published with the dedupe id `<request>:<index>` (the
start and end records use `start` and `end`), so a retried or resumed publish never duplicates
tokens, and a reader places chunks by position, so duplicates that slip through change nothing.

The writer keeps one queue for all requests and appends in order in a background task, so a slow
or reconnecting server delays the log but never the token stream to clients.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import LogChunk, LogEnd, LogRecord, LogStart
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.router.log")

_record_decoder = protocol.decoder_for(LogRecord)
PUBLISH_TIMEOUT_S = 2.0
MAX_PUBLISH_TRIES = 60  # about two minutes of a server that does not answer


def record_id(record: LogRecord) -> str:
    match record:
        case LogStart():
            return bus.log_msg_id(record.request_id, "start")
        case LogChunk():
            return bus.log_msg_id(record.request_id, record.index)
        case LogEnd():
            return bus.log_msg_id(record.request_id, "end")


async def append(js: JetStreamContext, names: Subjects, record: LogRecord) -> None:
    """Append one record and wait for the server's ack; retries (bounded) through reconnects."""
    subject = names.token_log(record.request_id)
    data = protocol.encode(record)
    headers = {"Nats-Msg-Id": record_id(record)}
    for attempt in range(1, MAX_PUBLISH_TRIES + 1):
        try:
            await js.publish(subject, data, timeout=PUBLISH_TIMEOUT_S, headers=headers)
            return
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            if attempt == MAX_PUBLISH_TRIES:
                raise bus.ServiceError("log-unavailable", f"token log append failed: {exc}") from exc
            await asyncio.sleep(min(0.05 * attempt, 1.0))


class LogWriter:
    """Appends records in the order they were queued, in one owned background task."""

    def __init__(self, js: JetStreamContext, names: Subjects) -> None:
        self.names = names
        self.js = js
        self.queue: asyncio.Queue[LogRecord] = asyncio.Queue()
        self.appended = 0

    def put(self, record: LogRecord) -> None:
        self.queue.put_nowait(record)

    async def run(self) -> None:
        while True:
            record = await self.queue.get()
            try:
                await append(self.js, self.names, record)
                self.appended += 1
            except bus.ServiceError as exc:
                log.error("dropped %s of %s: %s", type(record).__name__, record.request_id, exc)
            finally:
                self.queue.task_done()

    async def drain(self) -> None:
        """Until every queued record is appended (the caller bounds the wait)."""
        await self.queue.join()


# ---------------------------------------------------------------- reading


@dataclass
class LoggedRequest:
    start: LogStart
    tokens: list[int] = field(default_factory=list)
    end: LogEnd | None = None

    def place(self, chunk: LogChunk) -> None:
        """Reconcile by position: a chunk extends the log only where it continues it."""
        if chunk.position > len(self.tokens):
            log.warning("%s: gap in token log at %d", chunk.request_id, len(self.tokens))
            return
        self.tokens.extend(chunk.tokens[len(self.tokens) - chunk.position :])


async def read_all(
    js: JetStreamContext, names: Subjects
) -> tuple[dict[str, LoggedRequest], list[protocol.PoisonedRecord]]:
    """Every request in the stream, rebuilt from its records, and the records that do not decode
    (skipped: a record that stops every router start would stop the cluster)."""
    info = await js.stream_info(names.token_log_stream)
    requests: dict[str, LoggedRequest] = {}
    skipped: list[protocol.PoisonedRecord] = []
    if info.state.messages == 0:
        return requests, skipped
    # The stream is named: looking it up by subject needs $JS.API.STREAM.NAMES, which the router may not use.
    sub = await js.subscribe(names.token_log_all, stream=names.token_log_stream, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=5.0)
            try:
                record = protocol.decode(_record_decoder, msg.data)
            except protocol.BadMessage as exc:
                sequence = msg.metadata.sequence.stream
                skipped.append(protocol.PoisonedRecord("token-log", msg.subject, sequence, str(exc)))
                record = None
            match record:
                case LogStart():
                    requests.setdefault(record.request_id, LoggedRequest(record))
                case LogChunk() if record.request_id in requests:
                    requests[record.request_id].place(record)
                case LogEnd() if record.request_id in requests:
                    requests[record.request_id].end = record
            if msg.metadata.num_pending == 0:  # (the last sequence may have been purged)
                break
    finally:
        await sub.unsubscribe()
    return requests, skipped
