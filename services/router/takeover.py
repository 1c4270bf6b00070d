"""A router's takeover: what it does once it holds the lease, and when a client asks for a request
it did not know.

It rebuilds the running requests from the token log (those the request index names as open),
claims each with a LogTakeover after the last record read there, asks every serving engine what it
holds (which fences off every earlier router there), carries on the attempts whose tokens extend
the log, and resumes the rest from it. A request that ended before is read when a client asks for
it (`Router.load`), and remembered for --ended-keep.

Acts on the router's state and operations (router.py) through `RouterSide`: what a takeover may
touch of a router, and nothing else.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import Lease, LeaseLost
from belayer_rl.services.router.retention import Retention
from belayer_rl.services.router.state import ATTEMPT_BITS, EngineState, Request, end_message
from belayer_rl.services.router.token_log import LogWriter
from belayer_rl.shared import bus, protocol, registry
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.metrics import ResumeCause, RouterMetrics
from belayer_rl.shared.protocol import (
    MAX_BEAT_ATTEMPTS,
    AdoptReply,
    AdoptRequest,
    CancelDispatch,
    FinishReason,
    HeldAttempt,
    LogTakeover,
    RouterStarted,
    WorkerFrame,
)
from belayer_rl.shared.runtime import Skipped, Spawn
from belayer_rl.shared.subjects import Subjects

log = logging.getLogger("belayer.router")

CLAIM_TRIES = 5  # reads of the log at start-up, while a predecessor's last appends still land


class RouterSide(Protocol):
    """What a takeover uses of the router (router.Router)."""

    config: RouterConfig
    metrics: RouterMetrics
    subjects: Subjects
    nc: NATS
    js: JetStreamContext
    kv: KeyValue
    lease: Lease
    writer: LogWriter
    retention: Retention
    spawn: Spawn
    skipped: Skipped
    requests: dict[str, Request]
    running: dict[str, Request]
    ended: collections.deque[Request]
    engines: dict[str, EngineState]
    next_attempt: int
    adopting: list[tuple[WorkerFrame, str]] | None
    adopting_overflowed: bool

    def enqueue(self, request: Request) -> None: ...

    def interrupt(self, request: Request, cause: ResumeCause) -> None: ...

    def observe_next_token(self, request: Request) -> None: ...

    def log_dispatch(self, request_id: str, source: tuple[str, int, int], position: int) -> None: ...

    def log_full_chunks(self, request: Request, *, with_tail: bool = False) -> None: ...

    async def resume(
        self,
        request: Request,
        cause: ResumeCause,
        detail: str = "",
        *,
        prefer: str | None = None,
        for_s: float = 0.0,
    ) -> None: ...

    async def finish(self, request: Request, reason: FinishReason) -> None: ...

    async def handle_worker_message(self, frame: WorkerFrame, subject: str) -> None: ...

    async def announce_resumed(
        self, request_id: str, attempt: int, on: EngineState | AdoptReply, from_position: int, reason: str
    ) -> None: ...

    async def see_worker(self, engine_id: str, epoch: int, pid: int) -> None: ...

    async def distrust(self, engine_id: str, epoch: int, why: str) -> None: ...

    async def fenced_by_successor(self, engine_id: str, epoch: int, claim: str) -> bool: ...

    async def tell_worker(self, engine_id: str, cancel: CancelDispatch) -> None: ...


class Takeover:
    """The takeover of one router, which owns it (`Router.takeover`)."""

    def __init__(self, router: RouterSide) -> None:
        self.router = router

    async def rebuild(self) -> RouterStarted:
        """Rebuild the requests the index says are running from the token log; they are claimed
        and resumed. Those that ended before are read when a client asks for them (`load`).
        Called once the lease is held."""
        self.router.next_attempt = self.router.lease.incarnation << ATTEMPT_BITS
        self.router.writer.incarnation = self.router.lease.incarnation
        self.router.adopting = []  # from here on, what the workers stream waits until they are asked
        whole = not await self.router.retention.complete()  # an upgraded log: read it whole, once
        for _ in range(CLAIM_TRIES):
            indexed = await self.router.retention.open_ids()
            logged, skipped = await token_log.read_all(
                self.router.js, self.router.subjects, None if whole else indexed
            )
            for request_id, entry in logged.items():  # (before the takeovers are added)
                self.router.writer.usage.set(request_id, entry.start.owner, entry.size)
            if await self.claim(logged):
                break
        else:
            raise ServiceError("unavailable", f"the token log kept moving through {CLAIM_TRIES} reads")
        for poisoned in skipped:
            await self.router.skipped(poisoned)
        unreadable = {poisoned.key for poisoned in skipped}  # left where they are, met again
        for request_id in indexed - logged.keys():
            if self.router.subjects.token_log(request_id) not in unreadable:  # opened; its start never landed
                await self.router.retention.unopen(request_id)
        running: list[Request] = []
        for request_id, entry in logged.items():
            if entry.end is None:
                if request_id not in indexed:  # (an upgraded log)
                    await self.router.retention.open(request_id, entry.start.owner)
                running.append(self.rebuilt_running(entry))
            else:  # it ended before its index entry was closed
                self.remember_ended(entry)
                self.router.retention.ended(request_id, entry.last_sequence)
        if whole:  # every running request is indexed now; the ended ones are being closed
            await self.router.retention.mark_complete()
        # Ask the workers before placing the running requests: an engine the answers install
        # would otherwise dispatch them from the log at once.
        adopted = await self.adopt(running, {rid: entry.dispatches for rid, entry in logged.items()})
        for request in running:
            self.router.requests[request.request_id] = self.router.running[request.request_id] = request
            if request.request_id in adopted:
                await self.carry_on(request, *adopted[request.request_id])
            else:
                self.router.enqueue(request)
        # In arrival order, and what arrives meanwhile after them: placed by position, so what
        # the answers held already is skipped.
        while self.router.adopting:
            await self.router.handle_worker_message(*self.router.adopting.pop(0))
        self.router.adopting = None
        if self.router.adopting_overflowed:  # an adopted attempt's chunk or end may be among the dropped
            for request_id in adopted:
                request = self.router.requests[request_id]
                if request.end is None and request.engine_id is not None:
                    await self.router.resume(request, "gap", "worker messages dropped while adopting")
        return RouterStarted(
            router_pid=os.getpid(),
            rebuilt_requests=len(logged),
            resumed_requests=len(running),
            incarnation=self.router.lease.incarnation,
        )

    async def adopt(
        self, running: list[Request], dispatched: dict[str, set[tuple[str, int, int]]]
    ) -> dict[str, tuple[AdoptReply, HeldAttempt]]:
        """Ask every serving engine what it holds (which also fences off every earlier router
        there), and match each running request with the attempt whose tokens extend its log: those
        are carried on, not generated again. Attempts nobody adopts are cancelled.

        A worker's answer is its own engine's word, nothing more: it is taken only for the engine
        whose subject was asked (the bus lets nobody else answer there), and an attempt in it only
        where one of the request's LogDispatch records (`dispatched`) names that engine, epoch and
        attempt. Otherwise one engine could end another's request with tokens of its own making.
        A LogDispatch is queued, not awaited, so a real attempt may lack its record: it is
        counted, and its request adopts an older recorded attempt or resumes from the log."""
        entries, _ = await registry.entries(self.router.kv)
        wanted = [r.request_id for r in running][:MAX_BEAT_ATTEMPTS]  # the rest resume from the log
        answers = await asyncio.gather(
            *(self.ask_held(e.engine_id, e.epoch, wanted) for e in entries if e.health == "serving")
        )
        replies = [reply for reply in answers if reply is not None]
        newest: dict[str, tuple[AdoptReply, HeldAttempt]] = {}  # request id -> its latest attempt
        for reply in replies:
            await self.router.see_worker(reply.engine_id, reply.epoch, reply.pid)
            for held in reply.attempts:
                recorded = (reply.engine_id, reply.epoch, held.attempt) in dispatched.get(held.request_id, ())
                if not recorded or held.attempt >> ATTEMPT_BITS != held.incarnation:
                    self.router.metrics.adopt_refused.labels("unrecorded").inc()
                    continue
                seen = newest.get(held.request_id)
                if seen is None or held.attempt > seen[1].attempt:
                    newest[held.request_id] = (reply, held)
        adopted: dict[str, tuple[AdoptReply, HeldAttempt]] = {}  # request id -> the attempt carried on
        for request in running:
            found = newest.get(request.request_id)
            if found is None:
                continue
            reply, held = found
            engine = self.router.engines.get(reply.engine_id)
            if (
                engine is None
                or engine.epoch != reply.epoch
                or held.tokens[: len(request.tokens)] != request.tokens
            ):
                self.router.metrics.adopt_refused.labels("not-a-continuation").inc()
                continue  # another epoch, or not a continuation of the log: resumed from the log
            if held.logprobs_from > len(request.tokens):
                # Its dispatch carried tokens the log does not hold, and the worker has no logprobs
                # for them: resumed from the log, where those tokens are generated again, exactly.
                self.router.metrics.adopt_refused.labels("logprobs-missing").inc()
                continue
            adopted[request.request_id] = found
        taken = {(request_id, held.attempt) for request_id, (_, held) in adopted.items()}
        for reply in replies:
            for held in reply.attempts:
                if held.finish_reason is None and (held.request_id, held.attempt) not in taken:
                    cancel = CancelDispatch(
                        request_id=held.request_id,
                        attempt=held.attempt,
                        incarnation=self.router.lease.incarnation,
                        holder=self.router.lease.holder,
                    )
                    self.router.spawn(self.router.tell_worker(reply.engine_id, cancel), "cancel-dispatch")
        return adopted

    async def ask_held(self, engine_id: str, epoch: int, request_ids: list[str]) -> AdoptReply | None:
        """What the engine's worker of `epoch` (the registry's) holds of `request_ids`; None when
        it does not say, or says it as another engine (it is distrusted)."""
        try:
            reply = await bus.request_struct(
                self.router.nc,
                self.router.subjects.worker_adopt(engine_id),
                AdoptRequest(
                    incarnation=self.router.lease.incarnation,
                    request_ids=request_ids,
                    holder=self.router.lease.holder,
                ),
                AdoptReply,
                self.router.config.dispatch_timeout_s,
            )
        except ServiceError as exc:
            if exc.code == "fenced":  # the worker says it has seen a later router
                if await self.router.fenced_by_successor(engine_id, epoch, exc.message):
                    raise LeaseLost(f"engine {engine_id}: {exc.message}") from exc
                return None
            # A worker of an older version, or gone: its requests resume from the log.
            log.info("engine %s did not say what it holds: %s", engine_id, exc)
            return None
        except protocol.BadMessage as exc:
            log.warning("engine %s answered what it holds unreadably: %s", engine_id, exc)
            return None
        if reply.engine_id != engine_id:
            self.router.metrics.adopt_refused.labels("wrong-engine").inc(max(1, len(reply.attempts)))
            await self.router.distrust(
                engine_id, epoch, f"answered what it holds as engine {reply.engine_id!r}"
            )
            return None
        return reply

    async def carry_on(self, request: Request, reply: AdoptReply, held: HeldAttempt) -> None:
        """Take over a running request as its worker holds it: every token it generated so far,
        and its attempt, whose further chunks are accepted as they come (or its end, when it ended
        while no router listened)."""
        logged = len(request.tokens)
        upto = min(len(held.tokens), request.start.max_tokens)
        request.extend(
            held.tokens[logged:upto], held.logprobs[logged - held.logprobs_from : upto - held.logprobs_from]
        )
        request.replayed_to = len(request.tokens)  # what clients had came from these very tokens
        if len(request.tokens) > logged:  # positions new to the router: its first since the failure
            self.router.metrics.tokens_generated.inc(len(request.tokens) - logged)
            self.router.observe_next_token(request)
        log.info("%s adopted at %d from %s", request.request_id, len(request.tokens), reply.engine_id)
        await self.router.announce_resumed(
            request.request_id, held.attempt, reply, len(request.tokens), "adopt"
        )
        request.source = (reply.engine_id, reply.epoch, held.attempt)
        self.router.log_dispatch(request.request_id, request.source, logged)
        if held.finish_reason is not None:
            await self.router.finish(request, held.finish_reason)
            return
        engine = self.router.engines.get(reply.engine_id)
        if engine is None or not engine.alive or engine.epoch != reply.epoch:
            # It failed (or was replaced) since it answered: resumed from the tokens adopted,
            # whose whole chunks are logged now, under the attempt that made them.
            self.router.log_full_chunks(request)
            self.router.enqueue(request)
            return
        request.attempt, request.epoch, request.engine_id = held.attempt, reply.epoch, reply.engine_id
        engine.requests.add(request.request_id)
        request.dispatches += 1
        request.progress_at = time.monotonic()
        request.waiting_since = None
        self.router.log_full_chunks(request)

    def rebuilt_running(self, entry: token_log.LoggedRequest) -> Request:
        request = Request(start=entry.start, tokens=entry.tokens, logprobs=entry.logprobs)
        request.logged_chunks = len(entry.tokens) // entry.start.chunk_tokens
        request.resumes = 1
        request.replayed_to = len(entry.tokens)  # its clients may have had more
        self.router.interrupt(request, "router-restart")
        return request

    def remember_ended(self, entry: token_log.LoggedRequest) -> Request:
        """An ended request read from the log: attachable for --ended-keep from now."""
        assert entry.end is not None
        request = Request(start=entry.start, tokens=entry.tokens, logprobs=entry.logprobs)
        request.logged_chunks = len(entry.tokens) // entry.start.chunk_tokens
        request.resumes = entry.end.resumes
        request.end = end_message(entry.start, entry.end)
        request.ended_at = time.monotonic()
        self.router.requests[entry.start.request_id] = request
        self.router.ended.append(request)
        return request

    async def claim(self, logged: dict[str, token_log.LoggedRequest]) -> bool:
        """Write a LogTakeover on every running request's subject, after the last record read
        there; False when one of them moved meanwhile (a predecessor's last append landed), so the
        log must be read again."""
        running = {rid: entry for rid, entry in logged.items() if entry.end is None}
        for request_id, entry in running.items():
            if entry.incarnation > self.router.lease.incarnation:
                raise LeaseLost(f"{request_id} was claimed by incarnation {entry.incarnation}")
            self.router.writer.last[request_id] = entry.last_sequence

        async def take(request_id: str, entry: token_log.LoggedRequest) -> bool:
            takeover = LogTakeover(
                request_id=request_id, incarnation=self.router.lease.incarnation, position=len(entry.tokens)
            )
            try:
                await self.router.writer.append_now(takeover)
            except ServiceError as exc:
                if exc.code != "fenced":
                    raise
                return False
            return True

        taken = await asyncio.gather(*(take(rid, entry) for rid, entry in running.items()))
        return all(taken)
