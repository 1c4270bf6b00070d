"""The rollout worker: one process serving one engine id, with the built-in engine or vLLM.

Owns: the engine (weights, KV arena, scheduler) and the attempts it is running.
Listens: `belayer.<cluster>.worker.<engine>.dispatch` (Dispatch), `belayer.<cluster>.worker.<engine>.cancel`,
and routers' start events (RouterStarted), for the newest router incarnation.
Publishes: a WorkerFrame per engine step, for every sequence that moved, on its engine's stream `belayer.<cluster>.router.worker_stream.
<engine>` (the only stream its credential may publish on, whatever a dispatch names), a Heartbeat on
`belayer.<cluster>.evt.heartbeat.<engine>` every interval, a WorkerRegistration once it serves.

Its epoch comes from the engine registry (compare-and-set at start-up); a dispatch that names any
other epoch is refused, and every chunk it sends carries (epoch, attempt) so the router can drop
whatever a stale worker still says. Likewise a dispatch or cancel from a router incarnation below
the highest this worker has seen (in a dispatch, a cancel or a router's start event) is refused:
a router that lost its lease cannot steer the workers. The engine runs in a thread: `step()` is torch work and must not
block the loop that answers heartbeats and dispatches. The engine is touched only between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from nats.aio.client import Client as NATS

from belayer_rl.services.worker.engine import EngineRejected, SeqEvent, SeqSpec, ServingEngine
from belayer_rl.services.worker.weights import PinnedWeights
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import WorkerConfig
from belayer_rl.shared.metrics import Metrics, WorkerMetrics
from belayer_rl.shared.protocol import (
    MAX_BEAT_ATTEMPTS,
    Ack,
    AdoptReply,
    AdoptRequest,
    CancelDispatch,
    Dispatch,
    Heartbeat,
    HeldAttempt,
    RouterStarted,
    WorkerFrame,
    WorkerRegistration,
)

log = logging.getLogger("belayer.worker")

ENDED_KEPT_S = 30.0  # how long an ended attempt stays adoptable
# An adopt answer's size, well under NATS's 1 MiB payload: tokens travel as JSON numbers.
ADOPT_REPLY_BYTES = 768 << 10
BYTES_PER_TOKEN = 6
BYTES_PER_LOGPROB = 25  # a float64 in JSON at its longest: -1.2345678901234567e-123,
FRAME_SEQS = 512  # sequences per WorkerFrame, well under a NATS payload even at the longest tokens
HELD_OVERHEAD_BYTES = 256


def order(dispatch: Dispatch) -> tuple[int, int]:
    return dispatch.incarnation, dispatch.attempt


@dataclass
class Attempt:
    dispatch: Dispatch
    key: tuple[str, int] = field(init=False)
    tokens: list[int] = field(init=False)  # every generated token of the request: prefix and its own
    logprobs: list[float] = field(init=False)  # of tokens[logprobs_from:]
    logprobs_from: int = field(init=False)  # 0 when the dispatch carried the prefix's logprobs

    def __post_init__(self) -> None:
        self.key = (self.dispatch.request_id, self.dispatch.attempt)
        self.tokens = list(self.dispatch.prefix_tokens)
        self.logprobs = list(self.dispatch.prefix_logprobs)
        self.logprobs_from = len(self.tokens) - len(self.logprobs)

    def held(self, finish_reason: protocol.FinishReason | None = None) -> HeldAttempt:
        return HeldAttempt(
            request_id=self.dispatch.request_id,
            attempt=self.dispatch.attempt,
            incarnation=self.dispatch.incarnation,
            tokens=list(self.tokens),
            finish_reason=finish_reason,
            logprobs=list(self.logprobs),
            logprobs_from=self.logprobs_from,
        )


class Ended(NamedTuple):
    """An ended attempt as a router that takes over may adopt it (its dispatch, prompt and all,
    is not kept)."""

    held: HeldAttempt
    ended_at: float


# ---------------------------------------------------------------- state


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        nc: NATS,
        engine: ServingEngine,
        epoch: int,
        stopping: asyncio.Event,
        pins: PinnedWeights | None = None,  # None: the engine owns its one weight version
        metrics: WorkerMetrics | None = None,  # None: counts nothing (outside a runtime)
    ) -> None:
        self.config = config
        self.metrics = metrics or WorkerMetrics(Metrics(enabled=False), config.engine_id)
        self.subjects = config.subjects
        # Chunks go to this engine's own stream, whatever a dispatch names: the bus lets this
        # engine publish nowhere else, and the router reads the engine from the subject.
        self.stream = self.subjects.worker_stream(config.engine_id)
        self.nc = nc
        self.engine = engine
        self.epoch = epoch
        self.pins = pins
        self.attempts: dict[str, Attempt] = {}  # request id -> the attempt this worker runs
        self.router_incarnation = 0  # the highest router incarnation seen; lower ones are refused
        self.router_holder = ""  # the first router of that incarnation heard from ("": none yet)
        # Attempts that ended, kept ENDED_KEPT_S for a router that takes over to adopt: their
        # end may have gone to a router that was dead by then. Request id -> what it made.
        self.ended: dict[str, Ended] = {}
        self.ops: list[Callable[[], None]] = []  # engine calls queued for the gap between steps
        self.rejected: list[tuple[Attempt, str]] = []  # submits the engine refused, to report
        self.wake = asyncio.Event()
        self.stopping = stopping

    async def wake_up(self) -> None:
        """Wake the scheduling loop (it ends once `stopping` is set)."""
        self.wake.set()

    # ------------------------------------------------------------ handlers

    def fence(self, incarnation: int, holder: str) -> None:
        """Refuse a router incarnation below the highest seen, and another router (`holder`) of the
        highest than the first one seen (two can hold one incarnation only if a lease revision
        was lost); remember a higher one."""
        if incarnation < self.router_incarnation:
            self.metrics.fenced.inc()
            raise ServiceError(
                "fenced", f"router incarnation {incarnation} is older than {self.router_incarnation}"
            )
        if incarnation == self.router_incarnation and holder and self.router_holder not in ("", holder):
            self.metrics.fenced.inc()
            raise ServiceError("fenced", f"router incarnation {incarnation} is held by another router")
        if incarnation > self.router_incarnation or not self.router_holder:
            self.router_holder = holder
        self.router_incarnation = incarnation

    async def on_adopt(self, request: AdoptRequest) -> AdoptReply:
        """What this worker holds of the requests asked about, for a router that just took the
        lease: running attempts with every token so far, and those that ended lately. Fences off
        every lower incarnation. The answer stays within ADOPT_REPLY_BYTES: what does not fit is
        resumed from the log by the router (tokens generated again, nothing lost)."""
        self.fence(request.incarnation, request.holder)
        self.forget_ended()
        held: list[HeldAttempt] = []
        budget = ADOPT_REPLY_BYTES
        for request_id in request.request_ids:
            attempt, ended = self.attempts.get(request_id), self.ended.get(request_id)
            found = attempt.held() if attempt is not None else ended.held if ended is not None else None
            if found is None:
                continue
            budget -= (
                HELD_OVERHEAD_BYTES
                + BYTES_PER_TOKEN * len(found.tokens)
                + BYTES_PER_LOGPROB * len(found.logprobs)
            )
            if budget < 0:
                break
            held.append(found)
        return AdoptReply(engine_id=self.config.engine_id, epoch=self.epoch, pid=os.getpid(), attempts=held)

    def forget_ended(self) -> None:
        """Drop ended attempts past ENDED_KEPT_S or past the count bound (the dict is in end order)."""
        now = time.monotonic()
        while self.ended:
            request_id, oldest = next(iter(self.ended.items()))
            if now - oldest.ended_at < ENDED_KEPT_S and len(self.ended) <= MAX_BEAT_ATTEMPTS:
                return
            del self.ended[request_id]

    async def on_router_started(self, started: RouterStarted) -> None:
        if started.incarnation > self.router_incarnation:
            self.router_incarnation, self.router_holder = started.incarnation, ""

    async def on_dispatch(self, dispatch: Dispatch) -> Ack:
        if dispatch.engine_id != self.config.engine_id:
            raise ServiceError("wrong-engine", f"this is {self.config.engine_id}, not {dispatch.engine_id}")
        if dispatch.epoch != self.epoch:
            raise ServiceError("stale-epoch", f"epoch {dispatch.epoch} is not the current {self.epoch}")
        self.fence(dispatch.incarnation, dispatch.holder)
        version = dispatch.weight_version
        to_map = version is not None and version not in self.engine.weights
        if to_map and self.pins is None:
            raise ServiceError("weight-version", f"serving only {self.engine.weight_version}")
        previous = self.attempts.get(dispatch.request_id)
        # Ordered by router incarnation first: ids of a router from before incarnations existed
        # (incarnation 0) came from the wall clock and are larger than any since.
        if previous is not None and order(previous.dispatch) >= order(dispatch):
            raise ServiceError("stale-attempt", f"already running attempt {previous.dispatch.attempt}")
        attempt = Attempt(dispatch)
        self.attempts[dispatch.request_id] = attempt  # before any wait: a cancel must find it
        if previous is not None:
            self.ops.append(lambda: self._cancel(previous.key))
        if to_map and self.pins is not None:
            try:
                await self.pins.ensure(version)  # "unknown-version" goes back as is
            except BaseException:
                if self.attempts.get(dispatch.request_id) is attempt:
                    del self.attempts[dispatch.request_id]
                raise
            if self.attempts.get(dispatch.request_id) is not attempt:
                return Ack(detail=f"attempt {dispatch.attempt} cancelled while its weights were mapped")
        spec = SeqSpec(
            key=attempt.key,
            prompt_tokens=list(dispatch.prompt_tokens),
            prefix_tokens=list(dispatch.prefix_tokens),
            max_new_tokens=dispatch.max_tokens,
            seed=dispatch.sampling.seed,
            temperature=dispatch.sampling.temperature,
            stop=tuple(dispatch.sampling.stop),
            weight_version=version,
            min_new_tokens=dispatch.sampling.min_tokens,
            allowed_tokens=tuple(dispatch.sampling.allowed_tokens),
        )
        self.ops.append(lambda: self._submit(attempt, spec))
        self.wake.set()
        return Ack(detail=f"attempt {dispatch.attempt} queued on {self.config.engine_id}")

    async def on_cancel(self, cancel: CancelDispatch) -> Ack:
        self.fence(cancel.incarnation, cancel.holder)
        attempt = self.attempts.get(cancel.request_id)
        if attempt is None or cancel.attempt not in (0, attempt.dispatch.attempt):
            return Ack(detail="nothing to cancel")
        del self.attempts[cancel.request_id]
        self.ops.append(lambda: self._cancel(attempt.key))
        self.wake.set()
        return Ack(detail="cancelled")

    # ------------------------------------------------------------ engine (between steps only)

    def _submit(self, attempt: Attempt, spec: SeqSpec) -> None:
        try:
            self.engine.submit(spec)
        except EngineRejected as exc:
            self.attempts.pop(attempt.dispatch.request_id, None)
            self.rejected.append((attempt, str(exc)))

    def _cancel(self, key: tuple[str, int]) -> None:
        self.engine.cancel(key)

    async def run_engine(self) -> None:
        """The scheduling loop. Each turn refreshes the heartbeat file's mtime, so a stuck step
        (or a frozen process) shows as a stale file to whoever watches it."""
        idle_wait_s = self.config.heartbeat_interval_s
        if self.pins is not None:
            self.pins.serving = True
        while not self.stopping.is_set():
            if self.config.heartbeat_file is not None:
                self.config.heartbeat_file.touch()
            ops, self.ops = self.ops, []
            for op in ops:
                op()
            if self.pins is not None:
                queued = {a.dispatch.weight_version for a in self.attempts.values()}
                self.pins.release_unused(keep={v for v in queued if v is not None})
            rejected, self.rejected = self.rejected, []
            await self._publish_frame([self._refusal(attempt, why) for attempt, why in rejected])
            if not self.engine.has_work():
                self.wake.clear()
                if not self.ops:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), idle_wait_s)
                continue
            started = time.perf_counter()
            events = await asyncio.to_thread(self.engine.step)
            self.metrics.step.observe(time.perf_counter() - started)
            await self._publish_frame(
                [seq for event in events if (seq := self._frame_seq(event)) is not None]
            )

    def _frame_seq(self, event: SeqEvent) -> protocol.FrameSeq | None:
        """What `event` adds to its attempt, for this step's frame; None if the attempt was cancelled
        or superseded while the step ran, or nothing happened to it."""
        request_id, attempt_id = typing.cast(tuple[str, int], event.key)  # an Attempt's key
        attempt = self.attempts.get(request_id)
        if attempt is None or attempt.dispatch.attempt != attempt_id:
            return None
        if event.new_tokens:
            del attempt.tokens[event.position :]
            del attempt.logprobs[max(0, event.position - attempt.logprobs_from) :]
            attempt.tokens.extend(event.new_tokens)
            attempt.logprobs.extend(event.new_logprobs)
            self.metrics.tokens.inc(len(event.new_tokens))
        if event.finished is not None:
            del self.attempts[request_id]
            self.ended.pop(request_id, None)  # (re-inserted last: the dict stays in end order)
            self.ended[request_id] = Ended(attempt.held(event.finished), time.monotonic())
            self.forget_ended()
        elif not event.new_tokens:
            return None
        return protocol.FrameSeq(
            request_id,
            attempt_id,
            event.position,
            event.new_tokens,
            event.new_logprobs,
            event.finished,
            event.position + len(event.new_tokens),
        )

    def _refusal(self, attempt: Attempt, why: str) -> protocol.FrameSeq:
        prefix = len(attempt.dispatch.prefix_tokens)
        return protocol.FrameSeq(
            attempt.dispatch.request_id, attempt.dispatch.attempt, prefix, [], [], "error", prefix, why[:1024]
        )

    async def _publish_frame(self, seqs: list[protocol.FrameSeq]) -> None:
        for start in range(0, len(seqs), FRAME_SEQS):
            frame = WorkerFrame(
                epoch=self.epoch, engine_id=self.config.engine_id, seqs=seqs[start : start + FRAME_SEQS]
            )
            await bus.publish(self.nc, self.stream, frame)

    # ------------------------------------------------------------ heartbeat

    async def heartbeat(self) -> None:
        subject = self.subjects.event("heartbeat", self.config.engine_id)
        while not self.stopping.is_set():
            running, waiting, outstanding = self.engine.load()
            beat = Heartbeat(
                engine_id=self.config.engine_id,
                epoch=self.epoch,
                pid=os.getpid(),
                running=running,
                waiting=waiting,
                outstanding_tokens=outstanding,
                weight_version=self.engine.weight_version,
                attempts=[a.dispatch.attempt for a in self.attempts.values()][:MAX_BEAT_ATTEMPTS],
            )
            try:
                await bus.publish(self.nc, subject, beat)
            except Exception as exc:  # reconnecting: the next beat will go out
                log.warning("heartbeat not sent: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.config.heartbeat_interval_s)

    def registration(self) -> WorkerRegistration:
        return WorkerRegistration(
            engine_id=self.config.engine_id,
            epoch=self.epoch,
            pid=os.getpid(),
            preset=self.config.preset,
            weight_version=self.engine.weight_version,
        )
