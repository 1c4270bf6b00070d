"""The router: routes generations to engines, relays their tokens, keeps the token log, resumes.

Owns: every request's state (tokens so far, current attempt, engine) and the router's view of the
engines (epoch, pid, last heartbeat). There is one active router, the holder of the router lease
(services/router/lease.py); a new one rebuilds the in-flight requests from the JetStream token log,
claims each with a LogTakeover record, and adopts or resumes them (takeover.py). A router acts only while its lease holds:
a router that wakes from a pause past its lease drops what it hears and sends nothing.
What it listens to, publishes and owns is its declaration (declaration.py); it also asks the
weight server which version is newest, for a request that names none, and streams each request's
chunks and end into its clients' inboxes.

Exactness rests on three rules: a worker's token is accepted only from the request's current
(engine, epoch, attempt); tokens are placed by position, so a duplicate changes nothing and a gap
triggers a resume; a resume dispatches prompt + every token accepted so far with the same seed and
the remaining budget, and the engine's sampling is keyed by (seed, position).

Attempt ids start with the router's incarnation (incarnation << 32 | n), so a later router's
attempts order after every earlier router's, and a worker can tell them apart.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import Lease
from belayer_rl.services.router.retention import Retention
from belayer_rl.services.router.state import EngineState, Request
from belayer_rl.services.router.takeover import Takeover
from belayer_rl.services.router.token_log import LogWriter
from belayer_rl.shared import bus, protocol, registry, subjects, tokenizer
from belayer_rl.shared.access import INBOX
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.metrics import Metrics, ResumeCause, RouterMetrics
from belayer_rl.shared.protocol import (
    Ack,
    AdoptReply,
    AttachRequest,
    CancelDispatch,
    CancelRequest,
    ClientKeepAlive,
    Dispatch,
    EngineQuarantined,
    EngineStatus,
    FinishReason,
    FrameSeq,
    GenerateEnd,
    GenerateError,
    GenerateRequest,
    Heartbeat,
    LogChunk,
    LogDispatch,
    LogEnd,
    LogStart,
    RequestFailed,
    RequestResumed,
    RequestStatus,
    RouterStarted,
    RouterStatus,
    StatusRequest,
    TokenChunk,
    WeightsList,
    WeightVersions,
    WorkerFailed,
    WorkerFrame,
    WorkerRegistration,
)
from belayer_rl.shared.runtime import Skipped, Spawn

log = logging.getLogger("belayer.router")

# Ended requests are forgotten a pass at a time, so the loop never stalls on a million at once.
MAX_FORGOTTEN_PER_PASS = 10_000
DISPATCH_RETRY_S = 0.05  # pause before re-placing a request whose dispatch was not acknowledged
WEIGHTS_LIST_TIMEOUT_S = 0.5  # asking the weight server which version is newest
WEIGHTS_QUIET_S = 10.0  # after it timed out, how long the router stops asking
MAX_HELD_MESSAGES = 100_000  # worker messages kept while a new router adopts attempts
END_RETRY_MAX_S = 5.0  # the longest pause before a LogEnd the writer gave up on is queued again
END_DURABLE_S = 2.0  # a cancel waits this long for its LogEnd to be appended, then says so
MAX_WATCHERS = 8  # inboxes one request streams to at once: the newest that attached
# A resumed dispatch carries its prefix's logprobs up to this many tokens (about 20 bytes each on
# the wire), so that its worker can hand them back to a router that adopts the attempt; a longer
# prefix goes without, and such an attempt is resumed, not adopted.
PREFIX_LOGPROBS_MAX = 16384
# The resume cause of an engine's failure, by WorkerFailed.reason.
FAILURE_CAUSE: dict[str, ResumeCause] = {"exit": "worker-exit", "heartbeat-timeout": "heartbeat-timeout"}


# ---------------------------------------------------------------- state


class Router:
    def __init__(
        self,
        config: RouterConfig,
        nc: NATS,
        js: JetStreamContext,
        kv: KeyValue,
        lease: Lease,
        spawn: Spawn,
        skipped: Skipped,
        metrics: RouterMetrics | None = None,  # None: counts nothing (a router outside a runtime)
    ) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics(Metrics(enabled=False))
        self.subjects = config.subjects
        self.spawn = spawn  # the runtime's owned tasks: cancelled and awaited at shutdown
        self.skipped = skipped  # the runtime's report of a stored record that does not decode
        self.nc = nc
        self.js = js
        self.kv = kv
        self.lease = lease
        usage = token_log.Usage()
        self.retention = Retention(js, self.subjects, config, usage, self.metrics, skipped)
        self.writer = LogWriter(js, self.subjects, usage, self.retention.ended)
        self.log_room = token_log.Room(js, self.subjects)
        # Every request this router knows, by id; the running ones again, and the ended ones in the
        # order they ended. A training run ends hundreds of requests a second and keeps each
        # for --ended-keep: the watchdog walks the running ones and drops the oldest ended
        # ones, never all of them.
        self.requests: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.ended: collections.deque[Request] = collections.deque()
        self.engines: dict[str, EngineState] = {}
        # Attempt ids grow across router incarnations, so whatever a worker still runs for an
        # earlier router can never match a current attempt. Set once the lease is taken.
        self.next_attempt = 0
        self.dropped_chunks = 0
        self.reported_weights: str | None = None  # what workers last said they serve
        self.weight_server_quiet_until = 0.0  # after a timeout, not asked again for a while
        # While a new router adopts its workers' attempts: the worker messages that arrived meanwhile.
        self.adopting: list[tuple[WorkerFrame, str]] | None = None
        self.adopting_overflowed = False  # some were dropped: adopted requests are resumed instead
        # Reads of requests from the token log in progress (`owned`), by id and asking client.
        self.loading: dict[tuple[str, str], asyncio.Future[Request | None]] = {}
        # (engine, epoch) of workers that answered what no honest worker would: never used again.
        self.distrusted: set[tuple[str, int]] = set()
        self.takeover = Takeover(self)  # rebuilds from the log what this router did not see

    async def rebuild(self) -> RouterStarted:
        """Once the lease is held: the running requests rebuilt from the token log, claimed, and
        adopted or resumed (takeover.py)."""
        return await self.takeover.rebuild()

    # ------------------------------------------------------------ client RPC

    async def on_generate(self, message: GenerateRequest, subject: str) -> Ack:
        self.lease.check()
        check_inbox(message.reply_to)
        weight_version = message.weight_version or await self.newest_weights()
        if message.request_id in self.requests:
            raise ServiceError("duplicate-request", f"request {message.request_id} exists; attach to it")
        await self.log_room.check()  # a full log refuses new requests, never drops running ones
        if message.prompt_tokens is not None:
            if message.prompt:
                raise ServiceError("bad-request", "give `prompt` or `prompt_tokens`, not both")
            if not message.prompt_tokens or max(message.prompt_tokens) >= tokenizer.VOCAB_SIZE:
                raise ServiceError(
                    "bad-request",
                    f"prompt_tokens must be a non-empty list of ids below {tokenizer.VOCAB_SIZE}",
                )
        if message.sampling.allowed_tokens and max(message.sampling.allowed_tokens) >= tokenizer.VOCAB_SIZE:
            raise ServiceError("bad-request", f"allowed_tokens must be ids below {tokenizer.VOCAB_SIZE}")
        start = LogStart(
            request_id=message.request_id,
            prompt_tokens=(
                tokenizer.encode(message.prompt) if message.prompt_tokens is None else message.prompt_tokens
            ),
            max_tokens=message.max_tokens,
            sampling=message.sampling,
            weight_version=weight_version,
            chunk_tokens=self.config.chunk_tokens,
            owner=client_of(subject),
        )
        self.retention.check_share(start)  # one client's requests hold at most its share of the log
        if message.request_id in self.requests:  # a retry of it got here while this one waited above
            raise ServiceError("duplicate-request", f"request {message.request_id} exists; attach to it")
        request = Request(start=start, watchers={message.reply_to: None})
        self.requests[message.request_id] = self.running[message.request_id] = request
        opened: int | None = None
        try:
            opened = await self.retention.open(start.request_id, start.owner)  # a successor finds it there
            await self.writer.append_now(start)  # durable before the client hears "accepted"
            # The append may have outlived the lease (a pause): then a successor, which did not
            # read this request, serves it; the client's retry reaches it.
            self.lease.check()
        except ServiceError as exc:
            # It may have ended meanwhile (a cancel, a dispatch that failed it): forget it either
            # way, and take it off the engine a dispatch gave it to.
            self.detach(request)
            if self.requests.get(message.request_id) is request:
                del self.requests[message.request_id]
            if self.running.get(message.request_id) is request:
                del self.running[message.request_id]
            self.writer.last.pop(message.request_id, None)
            if opened is not None and exc.code in ("duplicate-request", "log-full"):  # no start landed
                await self.retention.unopen(message.request_id, opened)
            if exc.code == "fenced":  # a later router claimed the request: the client asks it
                raise ServiceError("not-leader", exc.message) from None
            raise
        self.metrics.requests.inc()
        self.enqueue(request)
        return Ack(detail=f"request {message.request_id} accepted")

    async def on_attach(self, message: AttachRequest, subject: str) -> Ack:
        self.lease.check()
        check_inbox(message.reply_to)
        request = await self.owned(message.request_id, subject)
        request.followed_at = time.monotonic()
        if request.replayed_to is not None and message.from_position > request.client_had:
            request.client_had = message.from_position
            self.count_replayed(request)
        if message.from_position < len(request.tokens):
            chunk = TokenChunk(
                request_id=request.request_id,
                position=message.from_position,
                tokens=request.tokens[message.from_position :],
                logprobs=request.logprobs_of(message.from_position, len(request.tokens)),
            )
            await bus.publish(self.nc, message.reply_to, chunk)
        if request.end is not None and self.end_is_durable(request):
            await bus.publish(self.nc, message.reply_to, request.end)
        else:  # running, or its end is told once it is durable (tell_end)
            request.watchers.pop(message.reply_to, None)  # the newest goes last
            request.watchers[message.reply_to] = None
            while len(request.watchers) > MAX_WATCHERS:  # each token goes to each: a bound
                # The oldest is dropped, not the newest refused: inboxes are never said to be gone,
                # and a client that re-attaches with a new one must not be shut out of its own
                # request. A dropped stream that is still followed re-attaches when it stalls.
                del request.watchers[next(iter(request.watchers))]
        return Ack(detail=f"attached at {message.from_position} of {len(request.tokens)}")

    async def on_cancel(self, message: CancelRequest, subject: str) -> Ack:
        self.lease.check()
        request = await self.owned(message.request_id, subject)
        if request.end is None:
            await self.cancel(request)
            detail = "cancelled"
        else:
            detail = f"already ended: {type(request.end).__name__}"
        await self.end_durable(request)
        return Ack(detail=detail)

    async def end_durable(self, request: Request) -> None:
        """Wait until the request's LogEnd is in the token log: a cancel acknowledged before would
        be undone by a successor router that rebuilds from the log and finds the request running.
        Raises ServiceError("log-unavailable") when it is not durable in time (the client asks
        again); a LogEnd the writer gave up on is queued again (it is idempotent)."""
        if request.end_logged is None:  # an end read back from the log at start-up
            return
        try:
            dropped = await asyncio.wait_for(asyncio.shield(request.end_logged), END_DURABLE_S)
        except TimeoutError:
            raise ServiceError(
                "log-unavailable", "the request ended, but its end is not yet in the token log"
            ) from None
        if dropped is not None and dropped.code == "fenced":  # a successor claimed it without this end
            raise ServiceError("not-leader", "a newer router took this request over; ask it")
        if dropped is not None:
            assert request.end_record is not None
            request.end_logged = self.writer.put(request.end_record)
            raise ServiceError(
                "log-unavailable", f"the request ended, but its end was not logged: {dropped.message}"
            )

    async def on_keepalive(self, message: ClientKeepAlive, subject: str) -> None:
        now, client = time.monotonic(), client_of(subject)
        for request_id in message.request_ids:
            request = self.requests.get(request_id)
            if request is not None and request.start.owner in ("", client):
                request.followed_at = now

    async def owned(self, request_id: str, subject: str) -> Request:
        """The request, if the client that called on `subject` started it. Another client's request
        is not found: whether it exists is not that client's business."""
        client = client_of(subject)
        request = self.requests.get(request_id)
        if request is None:
            key = (request_id, client)
            loading = self.loading.get(key)
            if loading is None:  # one read of the log per id and client at a time
                loading = self.loading[key] = asyncio.ensure_future(self.load(request_id, client))
                loading.add_done_callback(lambda _: self.loading.pop(key, None))
            request = await asyncio.shield(loading)
        if request is None or request.start.owner not in ("", client):
            raise ServiceError("unknown-request", f"no request {request_id}")
        return request

    async def load(self, request_id: str, client: str) -> Request | None:
        """A request this router does not hold, read from the token log: one that ended before this
        router took over (attachable until it leaves the log), or a running one whose start a
        stale predecessor logged after the takeover read the index (claimed and resumed, as at a
        takeover, but only when its owner asks). None when the log holds no start of it."""
        try:
            entry = await token_log.read_request(self.js, self.subjects, request_id)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise ServiceError(
                "log-unavailable", f"could not read {request_id} from the token log: {exc}"
            ) from exc
        if entry is None or request_id in self.requests:
            return self.requests.get(request_id)
        if entry.start.owner not in ("", client):
            return None  # another client's: not this one's to wake
        self.writer.usage.set(request_id, entry.start.owner, entry.size)  # (before a takeover is added)
        if entry.end is None and not await self.takeover.claim({request_id: entry}):
            raise ServiceError(
                "log-unavailable", f"{request_id} moved in the token log as it was read; ask again"
            )
        if request_id in self.requests:  # started by a generate meanwhile
            return self.requests[request_id]
        if entry.end is not None:
            return self.takeover.remember_ended(entry)
        request = self.takeover.rebuilt_running(entry)
        self.requests[request_id] = self.running[request_id] = request
        try:
            await self.retention.open(request_id, entry.start.owner)
        finally:
            self.enqueue(request)  # claimed: this router carries it on, indexed or not
        return request

    async def cancel(self, request: Request) -> None:
        if request.engine_id is not None:
            cancel = CancelDispatch(
                request_id=request.request_id,
                attempt=request.attempt,
                incarnation=self.lease.incarnation,
                holder=self.lease.holder,
            )
            self.spawn(self.tell_worker(request.engine_id, cancel), "cancel-dispatch")
        await self.finish(request, "cancelled")

    async def on_status(self, _: StatusRequest) -> RouterStatus:
        self.lease.check()
        engines = [
            EngineStatus(
                engine_id=e.engine_id,
                epoch=e.epoch,
                pid=e.pid,
                alive=e.alive,
                outstanding_tokens=self.outstanding(e),
                weight_version=e.weight_version,
            )
            for e in self.engines.values()
        ]
        requests = [
            RequestStatus(
                request_id=r.request_id,
                engine_id=r.engine_id or "",
                attempt=r.attempt,
                num_tokens=len(r.tokens),
                max_tokens=r.start.max_tokens,
                resumes=r.resumes,
            )
            for r in self.running.values()
        ]
        return RouterStatus(engines=engines, requests=requests, incarnation=self.lease.incarnation)

    # ------------------------------------------------------------ worker stream

    async def on_worker_stream(self, frame: WorkerFrame, subject: str) -> None:
        if self.adopting is not None:  # a new router asking its workers what they hold: wait
            if len(self.adopting) < MAX_HELD_MESSAGES:
                self.adopting.append((frame, subject))
            else:
                self.adopting_overflowed = True
            return
        await self.handle_worker_message(frame, subject)

    async def handle_worker_message(self, frame: WorkerFrame, subject: str) -> None:
        # The engine is the one the subject names: the bus lets only that engine publish there,
        # while the payload's engine id is whatever its sender wrote.
        if not self.lease.held() or frame.engine_id != subjects.sender(subject):
            self.dropped_chunks += len(frame.seqs)
            self.metrics.fenced.inc(len(frame.seqs))
            return
        for seq in frame.seqs:
            await self.handle_seq(frame, seq)

    async def handle_seq(self, frame: WorkerFrame, seq: FrameSeq) -> None:
        request = self.requests.get(seq.request_id)
        if (
            request is None
            or request.end is not None
            or (not self.config.debug_accept_stale and self.stale(request, frame, seq))
        ):
            self.dropped_chunks += 1  # a stale attempt, epoch or engine: fenced off
            self.metrics.fenced.inc()
            return
        if seq.tokens:
            await self.accept(request, frame, seq)
        if seq.finish_reason is None or request.end is not None:
            return
        if not self.config.debug_accept_stale and self.stale(request, frame, seq):  # a gap resumed it
            return
        if seq.finish_reason == "error":
            await self.fail(request, "engine-rejected", seq.error)
        elif seq.num_tokens != len(request.tokens) and request.remaining > 0:
            await self.resume(request, "lost-tokens", f"worker ended at {seq.num_tokens}")
        elif seq.num_tokens != len(request.tokens):  # it overran max_tokens: the budget ended it
            await self.finish(request, "length")
        else:
            await self.finish(request, seq.finish_reason)

    @staticmethod
    def stale(request: Request, frame: WorkerFrame, seq: FrameSeq) -> bool:
        """Whether the sequence comes from anything but the request's current attempt."""
        return (frame.engine_id, frame.epoch, seq.attempt) != (
            request.engine_id,
            request.epoch,
            request.attempt,
        )

    async def accept(self, request: Request, frame: WorkerFrame, seq: FrameSeq) -> None:
        have = len(request.tokens)
        if seq.position > have:
            await self.resume(request, "gap", f"chunk at {seq.position}, have {have}")
            return
        skip = have - seq.position
        fresh, fresh_logprobs = seq.tokens[skip:], seq.logprobs[skip:]
        if len(fresh) > request.remaining:  # never past max_tokens, whatever a worker sends
            log.warning(
                "%s: %s sent %d tokens past max_tokens; dropped",
                request.request_id, frame.engine_id, len(fresh) - request.remaining,
            )  # fmt: skip
            fresh, fresh_logprobs = fresh[: request.remaining], fresh_logprobs[: request.remaining]
        self.metrics.tokens_accepted.inc(len(seq.tokens))
        if len(fresh) < len(seq.tokens):  # positions it holds already: computed twice
            self.metrics.tokens_regenerated.inc(len(seq.tokens) - len(fresh))
        if not fresh:
            return
        self.observe_next_token(request)
        request.extend(fresh, fresh_logprobs)
        request.source = (frame.engine_id, frame.epoch, seq.attempt)
        request.progress_at = time.monotonic()
        self.metrics.tokens_generated.inc(len(fresh))
        if request.replayed_to is not None:
            self.count_replayed(request)
        relay = TokenChunk(
            request_id=request.request_id,
            position=have,
            tokens=fresh,
            logprobs=request.logprobs_of(have, have + len(fresh)),
        )
        await self.tell_clients(request, relay)
        self.log_full_chunks(request)

    def observe_next_token(self, request: Request) -> None:
        """New tokens arrived: if they are the first since a failure, time them."""
        if request.interrupted is not None:
            noticed_at, cause = request.interrupted
            self.metrics.next_token.labels(cause).observe(time.monotonic() - noticed_at)
            request.interrupted = None

    def count_replayed(self, request: Request) -> None:
        """Count as regenerated the positions of a rebuilt request that a client had already
        received from the previous router and that this one now holds again, each once."""
        assert request.replayed_to is not None
        upto = min(request.client_had, len(request.tokens))
        if upto > request.replayed_to:
            self.metrics.tokens_regenerated.inc(upto - request.replayed_to)
            request.replayed_to = upto

    def log_full_chunks(self, request: Request, *, with_tail: bool = False) -> None:
        """Queue every whole chunk not yet logged; `with_tail` (at the end) also the partial last one."""
        k = request.start.chunk_tokens
        while len(request.tokens) >= (request.logged_chunks + 1) * k or (
            with_tail and len(request.tokens) > request.logged_chunks * k
        ):
            index = request.logged_chunks
            engine_id, epoch, attempt = request.source
            self.writer.put(
                LogChunk(
                    request_id=request.request_id,
                    index=index,
                    position=index * k,
                    tokens=request.tokens[index * k : (index + 1) * k],
                    logprobs=request.logprobs_of(index * k, min((index + 1) * k, len(request.tokens))),
                    attempt=attempt,
                    engine_id=engine_id,
                    epoch=epoch,
                    incarnation=self.lease.incarnation,
                )
            )
            request.logged_chunks += 1

    # ------------------------------------------------------------ ending

    async def finish(self, request: Request, reason: FinishReason) -> None:
        end = GenerateEnd(
            request_id=request.request_id,
            finish_reason=reason,
            num_tokens=len(request.tokens),
            resumes=request.resumes,
            weight_version=request.start.weight_version,
        )
        record = LogEnd(
            request_id=request.request_id,
            finish_reason=reason,
            num_tokens=len(request.tokens),
            resumes=request.resumes,
            incarnation=self.lease.incarnation,
        )
        await self.close(request, end, record)

    async def fail(self, request: Request, code: str, message: str) -> None:
        error = GenerateError(
            request_id=request.request_id, code=code, message=message, num_tokens=len(request.tokens)
        )
        record = LogEnd(
            request_id=request.request_id,
            finish_reason="error",
            num_tokens=len(request.tokens),
            resumes=request.resumes,
            error_code=code,
            error=message,
            incarnation=self.lease.incarnation,
        )
        await self.close(request, error, record)
        failed = RequestFailed(request_id=request.request_id, code=code, message=message)
        await bus.publish(self.nc, self.subjects.event("request_failed", request.request_id), failed)

    async def close(self, request: Request, end: GenerateEnd | GenerateError, record: LogEnd) -> None:
        self.detach(request)
        request.end = end
        request.ended_at = time.monotonic()
        self.running.pop(request.request_id, None)
        self.ended.append(request)
        request.waiting_since = None
        request.interrupted = None  # ended before its next token: no time to the next token
        self.metrics.ends.labels(record.finish_reason).inc()
        self.log_full_chunks(request, with_tail=True)
        request.end_record, request.end_logged = record, self.writer.put(record)
        self.spawn(self.tell_end(request), f"end-{request.request_id}")

    def end_is_durable(self, request: Request) -> bool:
        """Whether the request's LogEnd is in the token log (an end read from it at start-up is)."""
        logged = request.end_logged
        return logged is None or (logged.done() and logged.result() is None)

    async def tell_end(self, request: Request) -> None:
        """Tell the request's clients it ended once its LogEnd is durable, never before: a successor
        that rebuilds from the log must not find running a request whose end a client was told
        (with an engine whose resume is not exact, the tail it makes could differ). A LogEnd the
        writer gave up on (a full or unreachable log) is queued again, backing off up to
        END_RETRY_MAX_S, for as long as the router keeps the request (--ended-keep) and holds its
        lease; a fenced one is a successor's to end, and the clients' re-attach reaches it."""
        assert request.end is not None and request.end_record is not None
        pause = DISPATCH_RETRY_S
        while True:
            assert request.end_logged is not None
            dropped = await asyncio.shield(request.end_logged)
            if dropped is None:
                await self.tell_clients(request, request.end)
                request.watchers.clear()
                return
            if dropped.code == "fenced" or not self.lease.held():
                return
            if time.monotonic() - request.ended_at > self.config.ended_keep_s:
                log.error(
                    "%s ended, but its end could not be logged: its clients are not told", request.request_id
                )
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, END_RETRY_MAX_S)
            request.end_logged = self.writer.put(request.end_record)

    async def tell_clients(self, request: Request, message: TokenChunk | GenerateEnd | GenerateError) -> None:
        """Relay to every client following the request, only while the lease holds: a router that
        woke from a pause past its lease must not end a request its successor carries on."""
        if not self.lease.held():
            return
        for inbox in request.watchers:
            await bus.publish(self.nc, inbox, message)

    # ------------------------------------------------------------ routing and resumption

    def detach(self, request: Request) -> None:
        if request.engine_id is not None and request.engine_id in self.engines:
            self.engines[request.engine_id].requests.discard(request.request_id)
        request.engine_id = None

    def outstanding(self, engine: EngineState) -> int:
        return sum(self.requests[r].remaining for r in engine.requests)

    def enqueue(self, request: Request) -> None:
        """Put the request in line for an engine and try to dispatch it now."""
        if request.waiting_since is None:  # a new wait: what an earlier one saw says nothing of it
            request.waiting_since = time.monotonic()
            request.last_dispatch_error = ""
        if not request.dispatching:
            self.spawn(self.dispatch(request), f"dispatch-{request.request_id}")

    async def resume(
        self,
        request: Request,
        cause: ResumeCause,
        detail: str = "",
        *,
        prefer: str | None = None,
        for_s: float = 0.0,
    ) -> None:
        """Re-place the request from the tokens it has. With `prefer`, only that engine is used
        for `for_s` seconds (the grace period in which a shadow takes over a failed engine)."""
        if request.end is not None:
            return
        log.info("resuming %s at %d: %s %s", request.request_id, len(request.tokens), cause, detail)
        request.prefer_engine = prefer
        request.prefer_until = time.monotonic() + for_s
        self.detach(request)
        self.interrupt(request, cause)
        request.resumes += 1
        request.attempt = 0  # nothing from the interrupted attempt is accepted any more
        self.enqueue(request)

    def interrupt(self, request: Request, cause: ResumeCause) -> None:
        """Count a resume; the time to the next token runs from the first failure it has not yet
        recovered from (a quarantine after an exit does not restart the clock)."""
        self.metrics.resumes.labels(cause).inc()
        if request.interrupted is None:
            request.interrupted = (time.monotonic(), cause)

    async def dispatch(self, request: Request) -> None:
        request.dispatching = True
        try:
            while request.end is None and request.engine_id is None and self.lease.held():
                alive = [e for e in self.engines.values() if e.alive]
                engines = [e for e in alive if (e.engine_id, e.epoch) not in request.refused_by]
                if alive and not engines:  # every live engine said it cannot serve these weights
                    await self.fail(request, "unknown-weight-version", "; ".join(request.refused_by.values()))
                    return
                if request.prefer_engine is not None and time.monotonic() < request.prefer_until:
                    engines = [e for e in engines if e.engine_id == request.prefer_engine]
                if not engines:
                    return  # a new epoch or the watchdog retries; past the deadline it fails
                if request.dispatches >= self.config.max_dispatch_attempts:
                    limit = self.config.max_dispatch_attempts
                    await self.fail(request, "too-many-attempts", f"dispatched {limit} times")
                    return
                engine = min(engines, key=self.outstanding)
                self.next_attempt += 1
                dispatch = Dispatch(
                    request_id=request.request_id,
                    attempt=self.next_attempt,
                    epoch=engine.epoch,
                    engine_id=engine.engine_id,
                    prompt_tokens=request.start.prompt_tokens,
                    prefix_tokens=list(request.tokens),
                    prefix_logprobs=(
                        request.logprobs_of(0, len(request.tokens))
                        if len(request.tokens) <= PREFIX_LOGPROBS_MAX
                        else []
                    ),
                    max_tokens=request.start.max_tokens,
                    sampling=request.start.sampling,
                    weight_version=request.start.weight_version,
                    reply_to=self.subjects.worker_stream(
                        engine.engine_id
                    ),  # informative: workers use their own
                    incarnation=self.lease.incarnation,
                    holder=self.lease.holder,
                )
                # Claim before the round trip: chunks can arrive before the ack does.
                request.attempt, request.epoch, request.engine_id = (
                    dispatch.attempt,
                    engine.epoch,
                    engine.engine_id,
                )
                engine.requests.add(request.request_id)
                request.dispatches += 1
                request.progress_at = time.monotonic()
                self.log_dispatch(
                    request.request_id,
                    (engine.engine_id, engine.epoch, dispatch.attempt),
                    len(dispatch.prefix_tokens),
                )
                try:
                    await bus.request(
                        self.nc,
                        self.subjects.worker_dispatch(engine.engine_id),
                        dispatch,
                        self.config.dispatch_timeout_s,
                    )
                except ServiceError as exc:
                    log.warning("dispatch of %s to %s failed: %s", request.request_id, engine.engine_id, exc)
                    request.last_dispatch_error = f"{engine.engine_id} epoch {engine.epoch}: {exc}"
                    if request.attempt == dispatch.attempt:
                        self.detach(request)
                        request.attempt = 0
                    if exc.code == "fenced":  # the worker says it has seen a later router
                        if await self.fenced_by_successor(engine.engine_id, engine.epoch, exc.message):
                            return
                        await asyncio.sleep(DISPATCH_RETRY_S)  # distrusted, or asked again later
                    elif exc.code == "stale-epoch":
                        await self.engine_failed(engine, "exit", "the registry moved to a new epoch")
                    elif exc.code == "weight-version":  # this engine owns other weights: try another
                        request.refused_by[(engine.engine_id, engine.epoch)] = (
                            f"{engine.engine_id}: {exc.message}"
                        )
                    elif exc.code == "unknown-version":  # the weight server has no such version
                        if request.end is None:
                            await self.fail(request, "unknown-weight-version", exc.message)
                        return
                    else:  # a worker that does not answer is left to the heartbeat timeout
                        await asyncio.sleep(DISPATCH_RETRY_S)
                    continue
                if request.attempt != dispatch.attempt:
                    continue  # interrupted while the dispatch was in flight; loop to re-place it
                request.waiting_since = None
                if len(request.tokens) or request.resumes:
                    await self.announce_resumed(
                        request.request_id, dispatch.attempt, engine, len(dispatch.prefix_tokens), "resume"
                    )
        finally:
            request.dispatching = False

    def log_dispatch(self, request_id: str, source: tuple[str, int, int], position: int) -> None:
        """Record in the log that the attempt `source` (engine, epoch, attempt) alone supplies the
        request's tokens from now on; queued behind the chunks already accepted, ahead of its own."""
        engine_id, epoch, attempt = source
        self.writer.put(
            LogDispatch(
                request_id=request_id, attempt=attempt, engine_id=engine_id, epoch=epoch,
                position=position, incarnation=self.lease.incarnation,
            )
        )  # fmt: skip

    async def announce_resumed(
        self, request_id: str, attempt: int, on: EngineState | AdoptReply, from_position: int, reason: str
    ) -> None:
        """The event of a request carried on by `attempt` on engine `on` from `from_position`."""
        resumed = RequestResumed(
            request_id=request_id,
            attempt=attempt,
            engine_id=on.engine_id,
            epoch=on.epoch,
            from_position=from_position,
            reason=reason,
        )
        await bus.publish(self.nc, self.subjects.event("request_resumed", request_id), resumed)

    async def tell_worker(self, engine_id: str, cancel: CancelDispatch) -> None:
        try:
            await bus.request(
                self.nc, self.subjects.worker_cancel(engine_id), cancel, self.config.dispatch_timeout_s
            )
        except ServiceError as exc:
            log.info("cancel on %s not delivered: %s", engine_id, exc)

    # ------------------------------------------------------------ engines

    async def on_heartbeat(self, beat: Heartbeat) -> None:
        self.reported_weights = beat.weight_version or self.reported_weights
        await self.see_worker(beat.engine_id, beat.epoch, beat.pid)
        engine = self.engines.get(beat.engine_id)
        if engine is not None and engine.epoch == beat.epoch:
            engine.weight_version = beat.weight_version
            held, now = set(beat.attempts), time.monotonic()
            for request_id in engine.requests:
                request = self.requests[request_id]
                if request.attempt in held:  # queued or decoding there: not stalled
                    request.progress_at = now

    async def on_registration(self, registration: WorkerRegistration) -> None:
        self.reported_weights = registration.weight_version
        await self.see_worker(registration.engine_id, registration.epoch, registration.pid)

    async def newest_weights(self) -> str | None:
        """The weights of a request that names none: the newest version as the weight server says
        at this moment (a publication that has returned is seen), or without a weight server
        answering, what the workers report serving."""
        if time.monotonic() < self.weight_server_quiet_until:
            return self.reported_weights
        try:
            versions = await bus.request_struct(
                self.nc, self.subjects.weights_list, WeightsList(), WeightVersions, WEIGHTS_LIST_TIMEOUT_S
            )
        except ServiceError as exc:
            if exc.code == "timeout":  # generates are handled one by one: do not wait on every one
                self.weight_server_quiet_until = time.monotonic() + WEIGHTS_QUIET_S
            return self.reported_weights
        return versions.newest

    async def see_worker(self, engine_id: str, epoch: int, pid: int) -> None:
        if (engine_id, epoch) in self.distrusted:
            return
        engine = self.engines.get(engine_id)
        now = time.monotonic()
        if engine is not None and engine.epoch == epoch:
            if engine.alive:
                engine.last_beat = now
            elif engine.failed_reason == "heartbeat-timeout" and engine.pid == pid and not engine.quarantined:
                # It stalled and is back. Its interrupted attempts were replaced, so whatever it
                # still sends for them is dropped; it may take new work. An engine whose worker
                # exited stays failed however late its last heartbeat arrives: only a new epoch
                # brings it back.
                log.warning("engine %s (pid %d) answers again after a heartbeat timeout", engine_id, pid)
                engine.alive, engine.failed_reason, engine.last_beat = True, "", now
                self.dispatch_waiting()
            return
        if engine is not None and epoch < engine.epoch:
            return  # an old worker still talking: fenced off
        entry, _ = await registry.read(self.kv, engine_id)
        if entry is None or entry.epoch != epoch or entry.pid != pid or entry.health == "quarantined":
            log.warning("ignored worker %s epoch %d pid %d: not in the registry", engine_id, epoch, pid)
            return
        # Read again: while the registry answered, another message of this worker (a heartbeat
        # and its registration arrive together) may have installed it and requests placed on it.
        engine = self.engines.get(engine_id)
        if engine is not None and engine.epoch >= epoch:
            return
        if engine is not None:
            await self.engine_failed(engine, "exit", f"replaced by epoch {epoch}")
        log.info("engine %s: worker pid %d at epoch %d", engine_id, pid, epoch)
        self.engines[engine_id] = EngineState(engine_id=engine_id, epoch=epoch, pid=pid, last_beat=now)
        self.dispatch_waiting()

    async def fenced_by_successor(self, engine_id: str, epoch: int, claim: str) -> bool:
        """A worker answered `fenced`: it says a later router asked it. Only the lease bucket can
        say so, since anyone holding that engine's credential can send the answer. Confirmed, this
        router steps down (True). Denied, the engine's word is false and its epoch is distrusted;
        when the bucket does not say (unreadable, or no lease that decodes), nothing is decided and
        the caller asks again later (bounded by its own limit)."""
        superseded = await self.lease.superseded()
        if superseded:
            self.lease.lost.set()
            return True
        if superseded is False:
            why = f"answered 'fenced' ({claim}) while the lease names incarnation {self.lease.incarnation}"
            await self.distrust(engine_id, epoch, why)
        return False

    async def distrust(self, engine_id: str, epoch: int, why: str) -> None:
        """Stop using the engine's worker of `epoch` for good: it answered what no honest worker
        would. Its requests move to other engines at once (no grace period: no handover is coming),
        and nothing it says counts until a new epoch, which only its supervisor installs."""
        if (engine_id, epoch) in self.distrusted:
            return
        self.distrusted.add((engine_id, epoch))
        self.metrics.distrusted.inc()
        log.error("engine %s epoch %d distrusted: %s", engine_id, epoch, why)
        engine = self.engines.get(engine_id)
        if engine is None or engine.epoch != epoch:
            return
        engine.alive, engine.failed_reason = False, "exit"  # an exit is final for the epoch
        for request in [self.requests[r] for r in engine.requests]:
            await self.resume(request, "distrusted", f"engine {engine_id}: {why}")

    async def on_worker_failed(self, failed: WorkerFailed) -> None:
        engine = self.engines.get(failed.engine_id)
        if engine is not None and engine.pid == failed.pid and failed.epoch in (0, engine.epoch):
            await self.engine_failed(engine, failed.reason, failed.detail, announce=False)

    async def engine_failed(
        self, engine: EngineState, reason: protocol.EngineFailure, detail: str, *, announce: bool = True
    ) -> None:
        if engine.failed_reason != "exit":  # an exit is final; a stall may end
            engine.failed_reason = reason
        if not engine.alive and not engine.requests:
            return
        engine.alive = False
        interrupted = [self.requests[r] for r in engine.requests]
        log.warning("engine %s (pid %d) failed: %s %s", engine.engine_id, engine.pid, reason, detail)
        if announce:
            failed = WorkerFailed(
                engine_id=engine.engine_id,
                epoch=engine.epoch,
                pid=engine.pid,
                reason=reason,
                detail=f"{detail}; {len(interrupted)} requests interrupted",
            )
            await bus.publish(self.nc, self.subjects.event("worker_failed", engine.engine_id), failed)
        grace = self.config.handover_grace_s
        for request in interrupted:
            await self.resume(
                request,
                FAILURE_CAUSE[reason],
                f"engine {engine.engine_id}",
                prefer=engine.engine_id,
                for_s=grace,
            )

    async def on_quarantined(self, alert: EngineQuarantined) -> None:
        """Move the engine's requests at once, spread evenly over the healthy engines."""
        engine = self.engines.get(alert.engine_id)
        if engine is None:
            return
        engine.quarantined = True
        engine.alive = False
        interrupted = [self.requests[r] for r in engine.requests]
        for request in self.running.values():  # also those waiting out its grace period
            if request.prefer_engine == alert.engine_id and request.engine_id is None:
                interrupted.append(request)
        healthy = sorted(
            (e for e in self.engines.values() if e.alive),
            key=lambda e: (len(e.requests), self.outstanding(e)),
        )
        log.error("engine %s quarantined: moving %d requests", alert.engine_id, len(interrupted))
        for i, request in enumerate(interrupted):
            target = healthy[i % len(healthy)].engine_id if healthy else None
            await self.resume(request, "quarantine", f"engine {alert.engine_id}", prefer=target, for_s=60.0)

    def dispatch_waiting(self) -> None:
        for request in self.running.values():
            if request.engine_id is None and not request.dispatching:
                self.enqueue(request)

    async def watchdog(self) -> None:
        """Heartbeat timeouts, orphaned requests, requests whose client is gone, the no-engine
        deadline and eviction of old finished requests."""
        period = self.config.heartbeat_timeout_s / 4
        while True:
            await asyncio.sleep(period)
            if not self.lease.held():
                # Stopped past its lease, say: its clocks of heartbeats and client keepalives
                # are stale, and a successor may carry its requests by now.
                continue
            now = time.monotonic()
            for engine in list(self.engines.values()):
                if engine.alive and now - engine.last_beat > self.config.heartbeat_timeout_s:
                    silent = now - engine.last_beat
                    await self.engine_failed(engine, "heartbeat-timeout", f"silent for {silent:.2f}s")
            for _ in range(MAX_FORGOTTEN_PER_PASS):
                if not self.ended or now - self.ended[0].ended_at <= self.config.ended_keep_s:
                    break
                request = self.ended.popleft()
                if self.requests.get(request.request_id) is request:  # not one forgotten already
                    del self.requests[request.request_id]
                    self.writer.forget(request.request_id)
            for request in list(self.running.values()):
                if request.end is not None:
                    continue  # ended by an earlier request's handling in this pass
                if now - request.followed_at > self.config.client_timeout_s:
                    # Its client is gone (a live one sends keepalives): stop spending an engine on it.
                    log.warning(
                        "cancelling %s: no client for %.0fs", request.request_id, now - request.followed_at
                    )
                    await self.cancel(request)
                    continue
                holder = self.engines.get(request.engine_id) if request.engine_id is not None else None
                if request.engine_id is not None and (
                    holder is None or request.request_id not in holder.requests
                ):
                    # Cannot happen while every claim and detach keeps both sides; if it does, the
                    # request would wait forever for an engine that does not know it.
                    log.error(
                        "request %s placed on %s, which does not hold it",
                        request.request_id,
                        request.engine_id,
                    )
                    await self.resume(request, "orphaned", f"not held by {request.engine_id}")
                    continue
                if (
                    request.engine_id is not None
                    and now - request.progress_at > self.config.progress_deadline_s
                ):
                    # Its engine is alive but this attempt says nothing: its end (or a chunk) was
                    # lost on the way, or the worker forgot it. Nothing else would ever move it.
                    stalled = f"no token from {request.engine_id} for {now - request.progress_at:.1f}s"
                    cancel = CancelDispatch(
                        request_id=request.request_id,
                        attempt=request.attempt,
                        incarnation=self.lease.incarnation,
                        holder=self.lease.holder,
                    )
                    self.spawn(self.tell_worker(request.engine_id, cancel), "cancel-dispatch")
                    if request.remaining == 0:
                        await self.finish(request, "length")
                    else:
                        await self.resume(request, "stalled", stalled)
                    continue
                if request.engine_id is None and request.waiting_since is not None:
                    waited = now - request.waiting_since
                    if waited > self.config.no_worker_deadline_s:
                        await self.fail(request, "no-workers", self.why_no_engine(request, waited))
                    elif not request.dispatching:
                        self.enqueue(request)

    def why_no_engine(self, request: Request, waited: float) -> str:
        """A no-workers error's text: how long it waited and, where live engines were there all the
        same, which, and why its last dispatch to one went unacknowledged."""
        alive = [f"{e.engine_id} epoch {e.epoch}" for e in self.engines.values() if e.alive]
        if not alive:
            return f"no healthy engine for {waited:.1f}s"
        last = request.last_dispatch_error or "none was tried"
        return f"no engine took it for {waited:.1f}s; live: {', '.join(alive)}; last dispatch: {last}"

    # ------------------------------------------------------------ restart and reconnect

    async def on_reconnect(self) -> None:
        """Messages in flight while the server was away are lost: resume everything running."""
        for request in list(self.running.values()):
            if request.end is None and request.engine_id is not None:
                await self.resume(request, "reconnect")


def client_of(subject: str) -> str:
    """The client a call came from (Subjects.router_generate)."""
    return subjects.caller(subject)


def check_inbox(reply_to: str) -> None:
    """A client names where its chunks go; only an inbox is taken. The router may publish to any
    client's inbox, so a payload naming another role's subject (a worker's dispatch, say) would
    otherwise make the router forge messages for the sender."""
    if not reply_to.startswith(INBOX + "."):
        raise ServiceError("bad-request", f"reply_to must be an inbox ({INBOX}.*), got {reply_to!r}")
