"""The one service runtime: what every Belayer service process shares, written once.

A service is a setup coroutine `setup(runtime, config)` that builds its state, declares its
endpoints and timers on the runtime, and returns. The runtime owns everything around it:

- the NATS connection (one per process), which a stop request interrupts even while the server
  is unreachable and nats-py would otherwise retry forever;
- signals: the first SIGTERM/SIGINT drains, the second exits at once (exit status 1);
- the one error envelope: a handler's `ServiceError` becomes an `ErrorReply` with its typed code,
  every decode failure (RecursionError included) becomes "bad-request", anything else becomes
  "internal", logged with its traceback; all of them are counted by code;
- owned background tasks and timers, cancelled and awaited at shutdown; an essential task that
  ends on its own stops the process with exit status 1, so its supervisor restarts it;
- logging set-up, readiness (`ready()`), and a stats endpoint per process,
  `belayer.<cluster>.svc.<name>.stats`, where the error counts can be read;
- the process's metrics (shared/metrics.py): its registry (`metrics`, on which a service builds
  its group) and the HTTP endpoint with `/metrics` and `/healthz`, started before the setup (so a
  health check sees "starting" while NATS is still unreachable) and closed last.

The drain, in order: stop intake (unsubscribe every endpoint), let in-flight handlers finish and
run the service's drain hooks within `--drain-timeout`, cancel what is left (handlers, tasks,
timers), run the close callbacks in reverse order, close the connection.

Shape after uvicorn's `Server` (capture signals, serve, shutdown) and nats.py's micro `Service`
(endpoints with one handler wrapper that maps errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
import typing
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats.errors
import uvloop
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from belayer_rl.shared import bus, metrics, protocol
from belayer_rl.shared.access import INBOX
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import ConfigError, ServiceConfig
from belayer_rl.shared.metrics import Metrics, MetricsServer, ServiceCounts
from belayer_rl.shared.protocol import EndpointInfo, ErrorReply, Message, ServiceStats, StatsRequest
from belayer_rl.shared.subjects import event_kind

log = logging.getLogger("belayer.runtime")

C = TypeVar("C", bound=ServiceConfig)
T = TypeVar("T")
Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]  # Runtime.spawn, for a service's state
Skipped = Callable[[protocol.PoisonedRecord], Awaitable[None]]  # Runtime.record_skipped
CLOSE_TIMEOUT_S = 2.0  # closing the connection must not hang a stop when NATS is gone
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class Stopped(Exception):
    """A stop was requested before the setup finished (for example while NATS was unreachable)."""


@dataclass(frozen=True)
class Endpoint:
    """One subscription: the message types accepted on `subject` (a Struct or a union of them)
    and the handler that gets each decoded message.

    No queue groups: every Belayer service that serves a subject owns the state behind it (the
    active router, a host's servers, an engine's worker).

    `reply`: the handler's answer (or its error) goes back to the sender; one-way endpoints log and
    drop a failure. `concurrent`: each message runs as its own task, started in arrival order;
    otherwise messages are handled one after another, as they arrived. `with_subject`: the
    handler also gets the subject the message came on (for wildcard subscriptions)."""

    subject: str
    accepts: Any
    handler: Callable[..., Awaitable[Message | None]]
    reply: bool = True
    concurrent: bool = False
    with_subject: bool = False

    def info(self) -> EndpointInfo:
        return EndpointInfo(
            subject=self.subject, accepts=type_name(self.accepts).split(" | "), reply=self.reply
        )


def check_declared(endpoint: Endpoint) -> None:
    """An event subject is decoded as protocol.EVENT_TYPES declares its kind, and nowhere else:
    an endpoint that expects another type is a programming error, refused at start-up."""
    kind = event_kind(endpoint.subject)
    if not kind:
        return
    declared = protocol.EVENT_TYPES.get(kind, protocol.AnyEvent)  # a wildcard kind: any event
    if endpoint.accepts is not declared:
        raise TypeError(
            f"{endpoint.subject} carries {type_name(declared)}, not {type_name(endpoint.accepts)}"
        )


def check_sender(subject: str, message: Message) -> None:
    """An engine's event must name in its payload the engine its subject names: the subject is what
    the bus vouches for (an engine's credential publishes only its own), the payload is not."""
    kind = event_kind(subject)
    if kind not in protocol.ENGINE_EVENTS:
        return
    named = subject.split(".")[4] if subject.count(".") >= 4 else ""
    claimed: str = message.engine_id  # type: ignore[attr-defined]  # every ENGINE_EVENTS type has one
    if claimed != named:
        raise protocol.BadMessage(f"{kind} for engine {claimed!r} arrived on {named!r}'s subject")


def type_name(kind: Any) -> str:
    """A Struct's name, or a union's members joined by " | "."""
    return " | ".join(k.__name__ for k in typing.get_args(kind) or (kind,))


class Runtime:
    """One per process. Built by `run()`; the service's setup receives it."""

    def __init__(self, name: str, config: ServiceConfig, stats_key: str = "") -> None:
        self.name = name
        # Where it answers StatsRequest (Subjects.service_stats): its name, or for a process of a
        # family its name in tokens (worker.<engine>.<pid>), which a role's permission can scope.
        self.stats_key = stats_key or name
        self.config = config
        self.subjects = config.subjects  # this cluster's names
        self.stopping = asyncio.Event()
        self.errors: Counter[str] = Counter()  # error replies and dropped messages, by code
        self.records_skipped: Counter[str] = Counter()  # by store
        self._poisoned_seen: set[tuple[str, str, int]] = set()  # reported once each
        self.handled = 0
        self.started_at = time.time()
        self.is_ready = False
        self.standby = ""  # what a warm standby waits for; "" when it is none
        self._nc: NATS | None = None
        self._stack = contextlib.AsyncExitStack()
        self._subscriptions: list[Subscription] = []
        self._endpoints: list[Endpoint] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._on_reconnect: list[Callable[[], Awaitable[None]]] = []
        self._signals_captured = False
        self.failure = ""  # why the process stops on its own (exit status 1); "" for a requested stop
        self.metrics = Metrics(enabled=config.metrics_port != -1)
        self.metrics.export_service(self._counts)  # the counts above, read at each scrape
        self.metrics_port = 0  # where /metrics is served; 0 until then, and with metrics off

    # ------------------------------------------------------------ connection

    @property
    def nc(self) -> NATS:
        if self._nc is None:
            raise RuntimeError("not connected: call `await runtime.connect()` first")
        return self._nc

    async def connect(self) -> NATS:
        """Connect (once), retrying while NATS is unreachable; a stop request ends the wait."""
        if self._nc is not None:
            return self._nc

        async def reconnected() -> None:
            for callback in self._on_reconnect:
                await callback()

        connecting = bus.connect(
            self.config.nats_url, self.name, access=self.config.access, on_reconnect=reconnected
        )
        nc = await self.unless_stopped(connecting)
        self._nc = nc
        await self.serve(Endpoint(self.subjects.service_stats(self.stats_key), StatsRequest, self._on_stats))
        return nc

    def on_reconnect(self, callback: Callable[[], Awaitable[None]]) -> None:
        self._on_reconnect.append(callback)

    async def unless_stopped(self, work: Awaitable[T]) -> T:
        """`work`'s result; raises Stopped (and cancels `work`) if a stop is requested first
        (nats-py retries an unreachable server forever, and a service told to stop must go)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise Stopped

    async def publish(self, subject: str, message: Message) -> None:
        await bus.publish(self.nc, subject, message)

    async def record_skipped(self, poisoned: protocol.PoisonedRecord) -> None:
        """Count and report a stored record that does not decode, once per record: the service
        skips it and goes on (a crash would meet the same record at every start)."""
        seen = (poisoned.store, poisoned.key, poisoned.sequence)
        if seen in self._poisoned_seen:
            return
        self._poisoned_seen.add(seen)
        self.records_skipped[poisoned.store] += 1
        log.error("%s: skipped a record: %s", self.name, poisoned)
        alert = protocol.RecordSkipped(
            service=self.name[:64],
            store=poisoned.store,
            key=poisoned.key[:512],
            sequence=poisoned.sequence,
            reason=poisoned.reason[:1024],
        )
        with contextlib.suppress(Exception):  # the bus may be away; the count and the log stay
            await self.publish(self.subjects.event("record_skipped", self.name), alert)

    # ------------------------------------------------------------ declarations

    async def serve(self, *endpoints: Endpoint) -> None:
        """Subscribe each endpoint; messages are decoded with the types it declares."""
        for endpoint in endpoints:
            check_declared(endpoint)
            self._endpoints.append(endpoint)
            callback = self._callback(endpoint)
            sub = await self.nc.subscribe(endpoint.subject, cb=callback, pending_bytes_limit=256 << 20)
            self._subscriptions.append(sub)

    def spawn(
        self, work: Coroutine[Any, Any, Any], name: str, *, essential: bool = False
    ) -> asyncio.Task[Any]:
        """An owned background task: cancelled and awaited at shutdown; a crash is logged.

        `essential`: the process cannot do its job without it (a worker's scheduling loop, the
        router's log writer). If it ends before a stop was asked for, crashed or not, the process
        drains and exits with status 1, so its supervisor restarts it instead of keeping a
        process that heartbeats but serves nothing."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, essential=essential))
        return task

    def every(self, interval_s: float, tick: Callable[[], Awaitable[None] | None], name: str) -> None:
        """A timer: `tick` every `interval_s`; an error is logged and the timer goes on."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    result = tick()
                    if result is not None:
                        await result
                except Exception:
                    log.exception("%s: timer %s failed", self.name, name)

        self.spawn(loop(), name)

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Work to finish after intake stopped and before stragglers are cancelled (bounded by the
        drain timeout): a router flushes its token log here."""
        self._drain_hooks.append(hook)

    def on_close(self, callback: Callable[[], Any]) -> None:
        """Run at the very end, in reverse order of registration (sync or async)."""
        if asyncio.iscoroutinefunction(callback):
            self._stack.push_async_callback(callback)
        else:
            self._stack.callback(callback)

    def ready(self, detail: str) -> None:
        self.is_ready = True
        log.info("%s ready: %s", self.name, detail)

    def standing_by(self, waiting_for: str) -> None:
        """A warm standby, set up and waiting to take over: healthy (it does its job, a container
        orchestrator must not restart it), but not ready (it serves nothing yet)."""
        self.standby = waiting_for

    def health(self) -> tuple[bool, str]:
        """What /healthz says: serving only between `ready()` and the start of a drain, or
        standing by."""
        if self.stopping.is_set():
            return False, "draining"
        if self.is_ready:
            return True, "ok"
        return (True, f"standby: {self.standby}") if self.standby else (False, "starting")

    async def start_metrics(self) -> None:
        """Serve /metrics and /healthz (unless --metrics-port is -1), until the very end."""
        registry = self.metrics.registry
        if registry is None or self.metrics_port:
            return
        server = MetricsServer(registry, self.health)
        host, port = self.config.metrics_host, self.config.metrics_port
        try:
            self.metrics_port = await server.start(host, port)
        except OSError as exc:  # the port is taken, or the address is not this host's
            raise ConfigError(f"--metrics-port {port} on --metrics-host {host}: {exc}") from None
        self.on_close(server.close)
        log.info("%s: metrics on %s", self.name, metrics.url(host, self.metrics_port))

    def _counts(self) -> ServiceCounts:
        return ServiceCounts(
            errors=self.errors,
            handled=self.handled,
            ready=self.is_ready and not self.stopping.is_set(),  # a standby is healthy, not ready
            records_skipped=self.records_skipped,
        )

    # ------------------------------------------------------------ the error envelope

    def _callback(self, endpoint: Endpoint) -> Callable[[Msg], Awaitable[None]]:
        decoder = protocol.decoder_for(endpoint.accepts)

        async def handle(msg: Msg) -> None:
            if endpoint.reply and msg.reply and not msg.reply.startswith(INBOX + "."):
                # A reply subject is the sender's word, and the bus lets a service answer on it
                # whatever its own permissions: only an inbox is answered (and nothing is done), or
                # a requester could make this service publish onto a bucket or another role's subject.
                log.warning(
                    "%s: refused %s: reply subject %r is not an inbox", self.name, msg.subject, msg.reply
                )
                self._error("bad-request", f"reply subject {msg.reply!r} is not an inbox")
                return
            answer: Message | None
            try:
                message = protocol.decode(decoder, msg.data)
                check_sender(msg.subject, message)
                if endpoint.with_subject:
                    answer = await endpoint.handler(message, msg.subject)
                else:
                    answer = await endpoint.handler(message)
            except protocol.PoisonedRecord as exc:  # a stored record it needed, not the message
                await self.record_skipped(exc)
                answer = self._error("bad-record", str(exc))
            except protocol.BadMessage as exc:
                log.warning("%s: dropped bad message on %s: %s", self.name, msg.subject, exc)
                answer = self._error("bad-request", str(exc))
            except ServiceError as exc:
                log.info("%s: %s: %s", self.name, msg.subject, exc)
                answer = self._error(exc.code, exc.message)
            except Exception as exc:  # a handler bug must not kill the subscription
                log.exception("%s: handler for %s failed", self.name, msg.subject)
                answer = self._error("internal", f"{type(exc).__name__}: {exc}")
            self.handled += 1
            if endpoint.reply and msg.reply and answer is not None:
                try:
                    await self.nc.publish(msg.reply, protocol.encode(answer))
                except (nats.errors.Error, msgspec.EncodeError, ValueError) as exc:
                    log.warning("%s: could not reply on %s: %s", self.name, msg.subject, exc)

        async def on_message(msg: Msg) -> None:
            # Every handler runs as an owned task, so a drain can wait for it and then cancel it.
            task = asyncio.create_task(handle(msg))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            if not endpoint.concurrent:
                # In order: the next message waits for this one. An unsubscribe cancels this wait
                # (and with it nats-py's delivery loop, so no later message is taken); the handler
                # itself goes on, shielded, and the drain waits for it.
                await asyncio.shield(task)

        return on_message

    def _error(self, code: str, message: str) -> ErrorReply:
        """`code`: one of protocol.ErrorCode, or one a newer service answered and a handler passed on."""
        self.errors[code] += 1
        return ErrorReply(code=code, message=message)

    async def _on_stats(self, _: StatsRequest) -> ServiceStats:
        return ServiceStats(
            name=self.name,
            pid=os.getpid(),
            ready=self.is_ready,
            uptime_s=time.time() - self.started_at,
            handled=self.handled,
            errors=dict(self.errors),
            endpoints=[endpoint.info() for endpoint in self._endpoints],
            metrics_port=self.metrics_port,
        )

    def _task_done(self, task: asyncio.Task[Any], *, essential: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("%s: task %s crashed", self.name, task.get_name(), exc_info=task.exception())
        if essential and not self.stopping.is_set():
            self.failure = f"essential task {task.get_name()} ended"
            log.error("%s: %s; stopping", self.name, self.failure)
            self.stopping.set()

    # ------------------------------------------------------------ lifecycle

    def capture_signals(self) -> None:
        """First SIGTERM/SIGINT: drain. Second: exit at once. Idempotent."""
        if self._signals_captured:
            return
        self._signals_captured = True
        loop = asyncio.get_running_loop()

        def on_signal(sig: signal.Signals) -> None:
            if self.stopping.is_set():
                log.warning("%s: second %s, exiting now", self.name, sig.name)
                os._exit(1)
            log.info("%s: %s, draining (at most %.1fs)", self.name, sig.name, self.config.drain_timeout_s)
            self.stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        self.on_close(self._release_signals)

    def _release_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    async def shutdown(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        for sub in self._subscriptions:  # stop intake
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._subscriptions.clear()
        # In-flight handlers get the drain timeout, less half of it kept for the drain hooks (a
        # router's log flush must not be starved by one slow request).
        reserve = self.config.drain_timeout_s / 2 if self._drain_hooks else 0.0
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=max(0.0, deadline - reserve - time.monotonic()))
        for hook in self._drain_hooks:
            try:
                await asyncio.wait_for(hook(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("%s: a drain hook did not finish within the drain timeout", self.name)
            except Exception:
                log.exception("%s: a drain hook failed", self.name)
        stragglers = [*self._in_flight, *self._tasks]
        if stragglers:
            for task in stragglers:
                task.cancel()
            await asyncio.wait(stragglers, timeout=CLOSE_TIMEOUT_S)
        await self._stack.aclose()
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), CLOSE_TIMEOUT_S)
            except (TimeoutError, nats.errors.Error, RuntimeError, OSError) as exc:
                # nats-py flushes its pending buffer on close; with the server gone the transport
                # is already closed and says so with a RuntimeError. Nothing is left to save.
                log.warning("%s: closing the NATS connection: %s", self.name, exc or "timed out")


async def serve(
    name: str,
    config: C,
    setup: Callable[[Runtime, C], Awaitable[None]],
    *,
    signals_during_setup: bool = True,
    stats_key: str = "",
) -> str:
    """Run one service until a stop request: setup, then wait, then drain.

    `signals_during_setup=False` leaves SIGTERM's default action (die at once) in place until the
    setup returns: for a process that has nothing to drain until then, and must go without delay
    when its supervisor goes (a worker still building its engine)."""
    runtime = Runtime(name, config, stats_key)
    if signals_during_setup:
        runtime.capture_signals()
    try:
        await runtime.start_metrics()
        try:
            await runtime.unless_stopped(setup(runtime, config))
        except Stopped:
            log.info("%s: stopped before it was ready", name)
            return runtime.failure
        runtime.capture_signals()  # if the setup has not already
        await runtime.stopping.wait()
    finally:
        await runtime.shutdown()
    return runtime.failure


def run(
    name: str,
    config: C,
    setup: Callable[[Runtime, C], Awaitable[None]],
    *,
    signals_during_setup: bool = True,
    stats_key: str = "",
) -> None:
    """A service's `main`: logging, the event loop, and one clear line instead of a traceback for
    a config error (start-up refusals, such as a busy shared-memory prefix, are ones too)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        failure = uvloop.run(
            serve(name, config, setup, signals_during_setup=signals_during_setup, stats_key=stats_key)
        )
    except ConfigError as exc:
        sys.exit(f"{name}: {exc}")
    if failure:
        sys.exit(f"{name}: {failure}")
