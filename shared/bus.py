"""Thin helpers over nats-py: connection settings, typed RPC, events, stream declarations.

nats-py's defaults ping every two minutes and give up reconnecting after 60 tries, so a dead
server takes minutes to notice and a long outage kills a service. Here the connection pings every
second, declares the server dead after three missed pongs and reconnects forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from belayer_rl.shared import protocol
from belayer_rl.shared.access import Access
from belayer_rl.shared.protocol import Ack, ErrorReply, Message
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.bus")
ERROR_CODES = frozenset(typing.get_args(protocol.ErrorCode))

T = TypeVar("T")
M = TypeVar("M", bound=Message)


# Bounded retention: the token log of a request lives a day at most, and the stream is capped.
TOKEN_LOG_MAX_AGE_S = 24 * 3600
READER_IDLE_S = 5.0  # the consumer of a one-off reader of a stream or bucket goes this long after it stops
TOKEN_LOG_MAX_BYTES = 1 << 30
LOG_ROOM_FRACTION = 0.9  # past this share of its bound the token log takes no new request
DEDUPE_WINDOW_S = 600


@dataclass(frozen=True)
class BusOptions:
    ping_interval_s: float = 1.0
    max_outstanding_pings: int = 3
    reconnect_wait_s: float = 0.2
    connect_timeout_s: float = 2.0
    pending_bytes: int = 64 << 20  # publishes buffered while reconnecting


@dataclass(frozen=True)
class Target:
    """A cluster to talk to: where its NATS is, its names, and who we are there."""

    url: str
    subjects: Subjects = Subjects()
    access: Access = Access()

    async def connect(self, name: str, **kwargs: Any) -> NATS:
        return await connect(self.url, name, access=self.access, **kwargs)


class ServiceError(Exception):
    """An error that crosses the wire as an ErrorReply: `code` is one of protocol.ErrorCode (short
    and stable, what callers match), `message` says why. Raising one checks the code; one received
    in a reply (`from_reply`) is taken as it came, since a newer service may know more codes."""

    def __init__(self, code: protocol.ErrorCode, message: str) -> None:
        if code not in ERROR_CODES:  # a typo here would otherwise reach callers as a bad reply
            raise ValueError(f"unknown error code {code!r}; add it to protocol.ErrorCode")
        self._set(code, message)

    @classmethod
    def from_reply(cls, code: str, message: str) -> ServiceError:
        error = cls.__new__(cls)
        error._set(code, message)
        return error

    def _set(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: str = code
        self.message = message


async def connect(
    url: str,
    name: str,
    *,
    access: Access = Access(),
    options: BusOptions = BusOptions(),
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
) -> NATS:
    nc = NATS()
    servers = url.split(",")  # a cluster's seed servers, as the NATS tools write them
    # Options first: an unreadable credentials file is an error now, not an endless reconnect.
    credentials = access.connect_options()

    async def disconnected() -> None:
        if not nc.is_closed:  # closing on purpose is not news
            log.warning("%s: disconnected from NATS", name)

    async def reconnected() -> None:
        log.warning("%s: reconnected to NATS", name)
        if on_reconnect is not None:
            await on_reconnect()

    async def error(exc: Exception) -> None:
        log.warning("%s: NATS error: %s", name, exc)

    # nats-py annotates these as int but takes (and schedules) float seconds.
    seconds: dict[str, Any] = {
        "ping_interval": options.ping_interval_s,
        "reconnect_time_wait": options.reconnect_wait_s,
        "connect_timeout": options.connect_timeout_s,
    }
    await nc.connect(
        servers,
        name=name,
        max_outstanding_pings=options.max_outstanding_pings,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        pending_size=options.pending_bytes,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        error_cb=error,
        **seconds,
        **credentials,
    )
    return nc


# ---------------------------------------------------------------- request / reply

RECONNECT_CHECK_S = 0.25  # how often a waiting request looks for a lost connection


async def request(nc: NATS, subject: str, message: Message, timeout_s: float) -> Ack:
    """Send a typed request; return its Ack or raise ServiceError (with code "timeout" or
    "no-responders" when nobody answered)."""
    return await request_struct(nc, subject, message, Ack, timeout_s)


async def request_struct(nc: NATS, subject: str, message: Message, kind: type[T], timeout_s: float) -> T:
    """A typed request whose success reply is a `kind`; errors as in `request`. A request whose
    connection was lost and made again while it waited fails then, as a timeout: its reply is
    lost (a restarted nats-server refuses the responder's publish to an inbox it never saw)."""
    # Made while the connection is down, the request goes out on the next one: that reconnect
    # does not lose it.
    reconnects = nc.stats["reconnects"] + (0 if nc.is_connected else 1)
    pending = asyncio.ensure_future(nc.request(subject, protocol.encode(message), timeout=timeout_s))
    try:
        while not pending.done():
            await asyncio.wait({pending}, timeout=RECONNECT_CHECK_S)
            if not pending.done() and nc.stats["reconnects"] != reconnects:
                raise ServiceError(
                    "timeout", f"no reply on {subject}: the connection to NATS was lost meanwhile"
                )
        reply = pending.result()
    except nats.errors.NoRespondersError:
        raise ServiceError("no-responders", f"nobody serves {subject}") from None
    except (TimeoutError, nats.errors.TimeoutError):
        raise ServiceError("timeout", f"no reply on {subject} within {timeout_s}s") from None
    finally:
        if not pending.done():
            pending.cancel()
            # A reply or an error may land as it is cancelled: read, so nothing is left unretrieved.
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())
    decoder: msgspec.json.Decoder[T | ErrorReply] = protocol.decoder_for(kind | ErrorReply)
    answer = protocol.decode(decoder, reply.data)
    if isinstance(answer, ErrorReply):
        raise ServiceError.from_reply(answer.code, answer.message)
    return answer


async def listen(
    nc: NATS, subject: str, kind: type[M], handler: Callable[[M], Awaitable[None]]
) -> Subscription:
    """A client's subscription to a one-way stream of `kind` messages; bad ones are logged and
    dropped. (Services declare endpoints on the runtime instead.)"""
    decoder = protocol.decoder_for(kind)

    async def on_message(msg: Msg) -> None:
        try:
            message = protocol.decode(decoder, msg.data)
        except protocol.BadMessage as exc:
            log.warning("dropped bad message on %s: %s", msg.subject, exc)
            return
        try:
            await handler(message)
        except Exception:
            log.exception("handler for %s failed", msg.subject)

    return await nc.subscribe(subject, cb=on_message, pending_bytes_limit=256 << 20)


async def publish(nc: NATS, subject: str, message: Message) -> None:
    await nc.publish(subject, protocol.encode(message))


# ---------------------------------------------------------------- JetStream


async def declare_jetstream(
    js: JetStreamContext,
    names: Subjects,
    *,
    replicas: int = 1,
    max_bytes: int = TOKEN_LOG_MAX_BYTES,
    ended_keep_s: float = DEDUPE_WINDOW_S,
) -> KeyValue:
    """Declare the token-log stream, the request index and the engine registry bucket; idempotent.
    Returns the bucket.

    Durable by construction: file storage and `replicas` copies (3 on a NATS cluster). A full log
    refuses new records (discard NEW) rather than evicting the oldest, which may be the LogStart
    of a request still running; the router stops taking requests before it is full (`log-full`).
    No record is deleted one by one. The router purges a request's subject once the request has
    been over for `ended_keep_s` (services/router/retention.py); the dedupe window is no longer,
    so a request id used again after that never has its records taken for an old request's."""
    config = StreamConfig(
        name=names.token_log_stream,
        subjects=[names.token_log_all],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=TOKEN_LOG_MAX_AGE_S,
        max_bytes=max_bytes,
        discard=DiscardPolicy.NEW,
        duplicate_window=min(DEDUPE_WINDOW_S, ended_keep_s),
        deny_delete=True,
        deny_purge=False,
    )
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError:
        existing = await js.stream_info(names.token_log_stream)
        if existing.config.deny_purge:
            # A log of an earlier version: JetStream never lifts a deny-purge. Its ended requests
            # age out instead of being purged (the router says so when it starts).
            config = dataclasses.replace(config, deny_purge=True)
        if (
            existing.config.discard == DiscardPolicy.OLD
            and existing.state.bytes >= LOG_ROOM_FRACTION * max_bytes
        ):
            # A log of an earlier version, full under its eviction rule: refusing new records now
            # would stop every request. It keeps evicting until it is given room (--log-max-mb).
            log.warning(
                "the token log holds %d bytes of %d and still evicts its oldest records: give it more"
                " room (--log-max-mb) to stop that",
                existing.state.bytes, max_bytes,
            )  # fmt: skip
            config = dataclasses.replace(config, discard=DiscardPolicy.OLD)
        await js.update_stream(config)
    index = StreamConfig(
        name=names.request_index_stream,
        subjects=[names.request_open_all, names.request_closed_all, names.request_index_complete],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        # What a purge missed goes with the log's own records. No bound of its own: an entry stands
        # for a request in the log, and is smaller than its records there.
        max_age=TOKEN_LOG_MAX_AGE_S,
        max_msgs_per_subject=1,
        deny_delete=True,
    )
    try:
        await js.add_stream(index)
    except nats.js.errors.BadRequestError:
        await js.update_stream(index)
    try:
        registry = await js.key_value(names.engine_registry_bucket)
    except nats.js.errors.BucketNotFoundError:
        registry = await js.create_key_value(
            KeyValueConfig(
                bucket=names.engine_registry_bucket, history=1, storage=StorageType.FILE, replicas=replicas
            )
        )
    # A KV bucket takes rollup headers, and a rollup on one's own key ("Nats-Rollup: all") purges
    # every key: an engine, which may write only its own entry, could wipe the others'. Nothing
    # here rolls up, so the registry refuses them.
    info = await js.stream_info(f"KV_{names.engine_registry_bucket}")
    if info.config.allow_rollup_hdrs:
        await js.update_stream(dataclasses.replace(info.config, allow_rollup_hdrs=False))
    return registry


async def object_store(js: JetStreamContext, bucket: str, max_bytes: int, replicas: int = 1) -> ObjectStore:
    """The object store `bucket`, created (file storage, bounded) when it does not exist yet."""
    try:
        return await js.object_store(bucket)
    except nats.js.errors.BucketNotFoundError:
        return await js.create_object_store(
            bucket, config=ObjectStoreConfig(storage=StorageType.FILE, max_bytes=max_bytes, replicas=replicas)
        )


async def engine_registry(js: JetStreamContext, names: Subjects, wait_s: float = 120.0) -> KeyValue:
    """The engine registry bucket, once the router has declared it. Workers and the shadow
    supervisor only look it up: their credentials may not create or change streams."""
    return await with_retries(
        "find the engine registry",
        lambda: js.key_value(names.engine_registry_bucket),
        attempts=int(wait_s / 0.25),
    )


async def each_message(
    js: JetStreamContext, stream: str, subject: str, subjects: Collection[str] | None = None
) -> AsyncIterator[Msg]:
    """Every message of `stream` on `subject` (or on each of `subjects`), in stream order, up to the
    last one there when it started; read by a one-off ordered consumer. The stream is named:
    looking it up by subject needs $JS.API.STREAM.NAMES, which few roles may use."""
    sub = await js.subscribe(
        subject,
        stream=stream,
        ordered_consumer=True,
        inactive_threshold=READER_IDLE_S,
        config=None if subjects is None else ConsumerConfig(filter_subjects=list(subjects)),
    )
    try:
        info = await sub.consumer_info()
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if (info.num_pending or 0) + (delivered or 0) == 0:  # (some may be on their way)
            return
        while True:
            msg = await sub.next_msg(timeout=READER_IDLE_S)
            yield msg
            if msg.metadata.num_pending == 0:  # (the last sequence may have been purged)
                break
    finally:
        await sub.unsubscribe()


def log_msg_id(request_id: str, index: int | str) -> str:
    """Dedupe id of a token-log record: a retried or resumed publish of the same chunk is dropped."""
    return f"{request_id}:{index}"


async def with_retries(
    what: str, call: Callable[[], Awaitable[T]], *, attempts: int = 20, wait_s: float = 0.25
) -> T:
    """Retry `call` while the server is unreachable or JetStream is not ready; bounded."""
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error, OSError) as exc:
            if attempt == attempts:
                raise ServiceError("unavailable", f"{what} failed {attempts} times: {exc}") from exc
            log.info("%s failed (%s), retrying", what, exc)
            await asyncio.sleep(wait_s)
    raise AssertionError("unreachable")


def decode_entry(kind: type[T], value: bytes) -> T:
    return msgspec.json.decode(value, type=kind)
