"""The rollout worker: one process serving one engine id with the built-in engine.

Owns: the engine (weights, KV arena, scheduler) and the attempts it is running.
Listens: `belayer.<cluster>.worker.<engine>.dispatch` (Dispatch), `belayer.<cluster>.worker.<engine>.cancel`.
Publishes: WorkerChunk / WorkerDone on its engine's stream `belayer.<cluster>.router.worker_stream.
<engine>` (the only stream its credential may publish on, whatever a dispatch names), a Heartbeat on
`belayer.<cluster>.evt.heartbeat.<engine>` every interval, a WorkerRegistration once it serves.

Its epoch comes from the engine registry (compare-and-set at start-up); a dispatch that names any
other epoch is refused, and every chunk it sends carries (epoch, attempt) so the router can drop
whatever a stale worker still says. The engine runs in a thread: `step()` is torch work and must not
block the loop that answers heartbeats and dispatches. The engine is touched only between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from belayer_rl.services.worker.engine import Engine, EngineRejected, SeqEvent, SeqSpec
from belayer_rl.services.worker.weights import PinnedWeights
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import WorkerConfig
from belayer_rl.shared.metrics import Metrics, WorkerMetrics
from belayer_rl.shared.protocol import (
    Ack,
    CancelDispatch,
    Dispatch,
    Heartbeat,
    WorkerChunk,
    WorkerDone,
    WorkerRegistration,
)

log = logging.getLogger("belayer.worker")


@dataclass
class Attempt:
    dispatch: Dispatch
    key: tuple[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.dispatch.request_id, self.dispatch.attempt)


# ---------------------------------------------------------------- state


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        nc: NATS,
        engine: Engine,
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
        self.ops: list[Callable[[], None]] = []  # engine calls queued for the gap between steps
        self.rejected: list[tuple[Attempt, str]] = []  # submits the engine refused, to report
        self.wake = asyncio.Event()
        self.stopping = stopping

    async def wake_up(self) -> None:
        """Wake the scheduling loop (it ends once `stopping` is set)."""
        self.wake.set()

    # ------------------------------------------------------------ handlers

    async def on_dispatch(self, dispatch: Dispatch) -> Ack:
        if dispatch.engine_id != self.config.engine_id:
            raise ServiceError("wrong-engine", f"this is {self.config.engine_id}, not {dispatch.engine_id}")
        if dispatch.epoch != self.epoch:
            raise ServiceError("stale-epoch", f"epoch {dispatch.epoch} is not the current {self.epoch}")
        version = dispatch.weight_version
        to_map = version is not None and version not in self.engine.weights
        if to_map and self.pins is None:
            raise ServiceError("weight-version", f"serving only {self.engine.weight_version}")
        previous = self.attempts.get(dispatch.request_id)
        if previous is not None and previous.dispatch.attempt >= dispatch.attempt:
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
            for attempt, why in rejected:
                await self._publish_done(attempt, "error", len(attempt.dispatch.prefix_tokens), why)
            if not self.engine.has_work():
                self.wake.clear()
                if not self.ops:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), idle_wait_s)
                continue
            started = time.perf_counter()
            events = await asyncio.to_thread(self.engine.step)
            self.metrics.step.observe(time.perf_counter() - started)
            for event in events:
                await self._publish_event(event)

    async def _publish_event(self, event: SeqEvent) -> None:
        request_id, attempt_id = event.key
        attempt = self.attempts.get(request_id)
        if attempt is None or attempt.dispatch.attempt != attempt_id:
            return  # cancelled or superseded while the step ran
        if event.new_tokens:
            chunk = WorkerChunk(
                request_id=request_id,
                attempt=attempt_id,
                epoch=self.epoch,
                engine_id=self.config.engine_id,
                position=event.position,
                tokens=event.new_tokens,
            )
            await bus.publish(self.nc, self.stream, chunk)
            self.metrics.tokens.inc(len(event.new_tokens))
        if event.finished is not None:
            del self.attempts[request_id]
            await self._publish_done(attempt, event.finished, event.position + len(event.new_tokens), "")

    async def _publish_done(self, attempt: Attempt, reason: str, num_tokens: int, error: str) -> None:
        done = WorkerDone(
            request_id=attempt.dispatch.request_id,
            attempt=attempt.dispatch.attempt,
            epoch=self.epoch,
            engine_id=self.config.engine_id,
            finish_reason=reason,  # type: ignore[arg-type]
            num_tokens=num_tokens,
            error=error,
        )
        await bus.publish(self.nc, self.stream, done)

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
