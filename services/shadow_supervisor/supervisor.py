"""The shadow supervisor: per engine, a main worker and one pre-initialised shadow; handover.

Owns: every rollout-worker process of its engines (it alone starts, replaces and kills them), each
engine's failure history and quarantine.
Listens: its workers' reports on stdout (shared/protocol.py's shadow pipe: WorkerIdle, MainFailed,
WorkerReady, WorkerUnhealthy, one per line), its children's exits, and
`belayer.<cluster>.engines.<engine>.restart` (EngineRestart) for each of its engines: the trainer's
rollout rebuild, which replaces the engine's workers by the cold path even though none reported
a failure (a main and shadow both stopped, say).
Publishes: `belayer.<cluster>.evt.handover.<engine>` with each phase's duration,
`belayer.<cluster>.evt.engine_quarantined.<engine>` and `engine_unstable`, process events; the
registry's quarantine mark.

A handover: (1) the shadow, or the main's exit, reports the failure; (2) the main is SIGKILLed
through a pidfd and its death confirmed by reaping it, and without that confirmation the arena is
not reused; (3) the weight and KV servers must answer and the arena is flushed; (4) the shadow
checks its device and installs itself under a new epoch (compare-and-set on the registry); (5) the
router sees the new epoch and resumes the interrupted requests on it. Anything not proven healthy
sends the engine down the cold path: a worker from scratch, with its own weights and arena.
A requested restart is a handover that takes the cold path on purpose; it is not a failure, so it
counts towards no quarantine.

Quarantine is for a device that is bad, and a process kill is no evidence of that: an engine is
quarantined when its workers fail `quarantine_after` times in a row, each within
`failure_window_s` of taking over (the replacement itself failing at once, again and again). The
last engine not quarantined never is, on timing alone: it takes the cold path after a backoff and
raises `engine_unstable`. The mark lives in the registry, so a restarted supervisor keeps it (and
starts no workers for the engine) until `belayer engines unquarantine` clears it.

A worker's stdout line that does not decode as a report is logged and dropped; commands (only
PromoteShadow so far) go to its stdin the same way, one encoded message per line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from belayer_rl.shared import bus, files, registry
from belayer_rl.shared.config import ShadowSupervisorConfig, WorkerConfig, to_argv
from belayer_rl.shared.metrics import ColdReason, Metrics, SupervisorMetrics
from belayer_rl.shared.model_folder import ModelFolderError, check_same_model
from belayer_rl.shared.processes import STOP_GRACE_S, dies_with_parent, kill_process
from belayer_rl.shared.protocol import (
    BadMessage,
    EngineEntry,
    EngineQuarantined,
    EngineRestart,
    EngineRestarted,
    EngineUnquarantine,
    EngineUnstable,
    EngineWorkers,
    Handover,
    KvFlush,
    KvServerAlive,
    MainFailed,
    ModelPublished,
    PoisonedRecord,
    ProcessEvent,
    PromoteShadow,
    ServerPing,
    ShadowCommand,
    ShadowState,
    WeightServerAlive,
    WorkerIdle,
    WorkerReady,
    WorkerReport,
    WorkerUnhealthy,
    decode,
    decoder_for,
    encode,
)
from belayer_rl.shared.runtime import Skipped

log = logging.getLogger("belayer.shadow_supervisor")

SERVER_PING_TIMEOUT_S = 0.5
RESTART_TIMEOUT_FACTOR = 2  # a restart waits for at most a handover and a cold start
MAX_BACKOFF_S = 8.0  # the last engine's cold path waits at most this: the router holds requests 30 s
REPORTS = decoder_for(WorkerReport)  # stateless: one decoder serves every worker's every line
R = TypeVar("R", WorkerIdle, WorkerReady)


class StartFailed(RuntimeError):
    """A worker process exited or said it was unhealthy before it was ready."""


# ---------------------------------------------------------------- worker processes


def parse_report(line: bytes, source: str) -> WorkerReport | None:
    """The report on one line of a worker's stdout, or None (logged) when the line is not one: a
    stray print or a corrupt line must not take the supervisor, or the engine, down."""
    try:
        return decode(REPORTS, line)
    except BadMessage as exc:
        log.warning("%s: ignored a stdout line that is not a report (%s): %.200r", source, exc, line)
        return None


# A main serves, a shadow idles until it takes over, a cold worker is started from nothing.
SlotRole = Literal["main", "shadow", "cold"]


@dataclass(eq=False)  # hashed by identity: the supervisor keeps a set of them
class WorkerProcess:
    role: SlotRole
    process: asyncio.subprocess.Process
    heartbeat_file: Path
    reports: asyncio.Queue[WorkerReport | None] = field(default_factory=asyncio.Queue)  # None: stdout closed
    # A shadow's idle report: the server instances that own what it mapped (empty for the others).
    idle: WorkerIdle = field(default_factory=WorkerIdle)
    reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def read_reports(self) -> None:
        assert self.process.stdout is not None
        source = f"{self.role} pid {self.pid}"
        while True:
            try:
                line = await self.process.stdout.readline()
            except ValueError:  # a line over the stream's limit: asyncio has dropped it
                log.warning("%s: ignored an oversized stdout line", source)
                continue
            if not line:
                break
            if (report := parse_report(line, source)) is not None:
                self.reports.put_nowait(report)
        self.reports.put_nowait(None)

    async def expect(self, kind: type[R], timeout_s: float) -> R:
        """The next report of `kind`; StartFailed once the worker exits or says it is unhealthy."""
        async with asyncio.timeout(timeout_s):
            while True:
                report = await self.reports.get()
                if report is None:
                    raise StartFailed(f"{self.role} pid {self.pid}: exited")
                if isinstance(report, WorkerUnhealthy):
                    raise StartFailed(f"{self.role} pid {self.pid}: unhealthy {report.why}")
                if isinstance(report, kind):
                    return report

    async def tell(self, command: ShadowCommand) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(encode(command) + b"\n")
        await self.process.stdin.drain()

    async def kill_confirmed(self, timeout_s: float) -> bool:
        """SIGKILL and reap: True once death is confirmed (False: stuck in the kernel, alive as far
        as we can tell)."""
        return await kill_process(self.process, timeout_s)


class ServerCheck(NamedTuple):
    """A server the shadow's mapping depends on, and the cold reasons it can give."""

    name: str
    down: ColdReason
    restarted: ColdReason
    owner: str | None  # the instance that owns what the shadow mapped; None: it mapped nothing
    subject: str
    reply: type[WeightServerAlive] | type[KvServerAlive]


@dataclass
class EngineSlot:
    engine_id: str
    main: WorkerProcess | None = None
    shadow: WorkerProcess | None = None
    streak: int = 0  # failures in a row, each within the failure window of the worker taking over
    took_over_at: float = 0.0  # monotonic time the current main began to serve
    quarantined: bool = False
    generation: int = 0  # names heartbeat files uniquely
    shadow_started: asyncio.Event = field(default_factory=asyncio.Event)
    # Restart requests not yet answered: the watch hands over on `restart_asked`, then gives each
    # waiter the handover (None when no worker could be started).
    restart_asked: asyncio.Event = field(default_factory=asyncio.Event)
    restart_waiters: list[asyncio.Future[Handover | None]] = field(default_factory=list)


# ---------------------------------------------------------------- the supervisor


class ShadowSupervisor:
    def __init__(
        self,
        config: ShadowSupervisorConfig,
        nc: NATS,
        kv: KeyValue,
        skipped: Skipped,
        metrics: SupervisorMetrics | None = None,  # None: counts nothing (outside a runtime)
    ) -> None:
        self.config = config
        self.skipped = skipped  # the runtime's report of a registry entry that does not decode
        self.metrics = metrics or SupervisorMetrics(Metrics(enabled=False))
        self.subjects = config.subjects
        self.nc = nc
        self.kv = kv
        self.slots = {engine_id: EngineSlot(engine_id) for engine_id in config.engines}
        self.workers: set[WorkerProcess] = set()  # every worker process not yet reaped, starting ones too
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.quarantining = asyncio.Lock()  # quarantines and unquarantines, one at a time
        # Built-in workers map weights and KV arena from the servers, which a handover checks and
        # flushes; a vLLM worker holds its own copies of both, so there is nothing to check.
        self.maps_servers = config.kind == "builtin"
        # vllm: the newest published model folder, which every worker started from now on loads
        # (a running one replaces its weights in place; services/worker/vllm_service.py).
        self.model_path = config.model_path
        self.newest_model: ModelPublished | None = None  # the last publication, told again (below)
        config.state_dir.mkdir(parents=True, exist_ok=True)

    def spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------ starting workers

    def worker_argv(
        self, slot: EngineSlot, role: SlotRole, heartbeat_file: Path, watch: WorkerProcess | None
    ) -> list[str]:
        c = self.config
        worker = WorkerConfig(
            **c.bus_settings(),
            engine_id=slot.engine_id,
            kind=c.kind,
            preset=c.preset,
            model_path=self.model_path,
            max_model_len=c.max_model_len,
            vllm_kv_cache_gib=c.vllm_kv_cache_gib,
            engine_python=c.engine_python,
            weights_seed=c.weights_seed,
            num_blocks=c.num_blocks,
            role="main" if role == "cold" else role,
            heartbeat_file=heartbeat_file,
            shared_memory=role != "cold" and self.maps_servers,
            follow_versions=role == "cold",  # a trainer's versions, once the weight server answers
            watch_pid=watch.pid if watch is not None else 0,
            watch_file=watch.heartbeat_file if watch is not None else None,
            hang_timeout_s=c.hang_timeout_s,
        )
        if c.engine_creds is not None:  # the engine's own credential: its subjects only
            worker = dataclasses.replace(worker, nats_creds=c.engine_creds / f"engine-{slot.engine_id}.creds")
        python = str(c.engine_python or sys.executable)
        return [python, "-m", "belayer_rl.services.worker", *to_argv(worker)]

    async def start_worker(
        self, slot: EngineSlot, role: SlotRole, watch: WorkerProcess | None = None
    ) -> WorkerProcess:
        """Start a worker; return once it serves (main, cold) or idles ready to take over (shadow)."""
        slot.generation += 1
        started_from = self.model_path
        heartbeat_file = self.config.state_dir / f"{slot.engine_id}.{slot.generation}.heartbeat"
        log_path = self.config.state_dir / f"worker-{slot.engine_id}.log"
        with log_path.open("ab") as err:
            process = await asyncio.create_subprocess_exec(
                *self.worker_argv(slot, role, heartbeat_file, watch),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                # SIGKILL, not SIGTERM, which a stopped or hung worker would not act on: the KV
                # server hands its arena to nobody else while it lives.
                preexec_fn=dies_with_parent(signal.SIGKILL),
            )
        worker = WorkerProcess(role, process, heartbeat_file)
        self.workers.add(worker)
        worker.reader = asyncio.create_task(worker.read_reports())
        worker.reader.add_done_callback(lambda _: self.workers.discard(worker))
        await self.announce(
            ProcessEvent(name=f"worker-{slot.engine_id}-{role}", pid=worker.pid, state="started")
        )
        try:
            if role == "shadow":
                worker.idle = await worker.expect(WorkerIdle, timeout_s=self.config.start_timeout_s)
            else:
                await worker.expect(WorkerReady, timeout_s=self.config.start_timeout_s)
        except (StartFailed, TimeoutError):
            await worker.kill_confirmed(self.config.death_timeout_s)
            raise
        if self.newest_model is not None and self.model_path != started_from:
            # Published while it started, perhaps before it listened: said again now that it does
            # (a worker that holds the version already lets it pass).
            subject = self.subjects.event("model_published", self.newest_model.version)
            await bus.publish(self.nc, subject, self.newest_model)
        return worker

    async def start(self) -> None:
        for slot in self.slots.values():
            entry = await self.entry(slot.engine_id)
            slot.quarantined = entry is not None and entry.health == "quarantined"
            if slot.quarantined:
                log.error("engine %s is quarantined: no workers until it is unquarantined", slot.engine_id)
        serving = [slot for slot in self.slots.values() if not slot.quarantined]
        for slot in serving:
            try:
                slot.main = await self.start_worker(slot, "main")
            except (StartFailed, TimeoutError) as exc:  # its arena still held by a worker of ours?
                log.error(
                    "engine %s: main not started on the shared arena (%s): cold path", slot.engine_id, exc
                )
                slot.main = await self.start_worker(slot, "cold")
            slot.took_over_at = time.monotonic()
        for slot in serving:
            try:
                slot.shadow = await self.start_worker(slot, "shadow", watch=slot.main)
                slot.shadow_started.set()
            except (StartFailed, TimeoutError) as exc:  # served, without a shadow: failures go cold
                log.error("engine %s: no shadow: %s", slot.engine_id, exc)
            self.spawn_task(self.watch(slot), f"watch-{slot.engine_id}")
        self.write_state()

    async def on_unquarantine(self, _: EngineUnquarantine, subject: str) -> EngineRestarted:
        """Clear the quarantine of the engine the subject names and start its main and shadow."""
        arrived = time.monotonic()
        engine_id = subject.split(".")[-2]
        slot = self.slots.get(engine_id)
        if slot is None:
            raise bus.ServiceError("unknown-engine", f"this supervisor does not run engine {engine_id!r}")
        if not slot.quarantined:
            raise bus.ServiceError("bad-request", f"engine {engine_id} is not quarantined")
        async with self.quarantining:
            await registry.unquarantine(self.kv, engine_id)
            slot.quarantined, slot.streak = False, 0
            slot.restart_asked.clear()
        try:
            slot.main = await self.start_worker(slot, "main")
        except (StartFailed, TimeoutError) as exc:
            await self.quarantine(slot)  # as it was: nothing serves it
            raise bus.ServiceError("restart-failed", f"engine {engine_id}: {exc}") from exc
        slot.took_over_at = time.monotonic()
        self.write_state()
        self.spawn_task(self.replace_shadow(slot), f"shadow-{engine_id}")
        self.spawn_task(self.watch(slot), f"watch-{engine_id}")
        entry = await self.entry(engine_id)
        log.warning("engine %s unquarantined: worker pid %d", engine_id, slot.main.pid)
        return EngineRestarted(
            engine_id=engine_id,
            old_pid=0,
            new_pid=slot.main.pid,
            epoch=entry.epoch if entry else 0,
            took_s=time.monotonic() - arrived,
        )

    # ------------------------------------------------------------ watching

    async def watch(self, slot: EngineSlot) -> None:
        """Wait for the main to fail (its exit, or the shadow's report) or a restart request, and
        hand over; forever."""
        try:
            while not self.stopping and not slot.quarantined:
                assert slot.main is not None
                main_exit = asyncio.create_task(slot.main.process.wait())
                report = asyncio.create_task(self.shadow_report(slot))
                asked = asyncio.create_task(slot.restart_asked.wait())
                waits = (main_exit, report, asked)
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                detected_at = time.time()
                for task in waits:
                    task.cancel()
                if self.stopping:
                    return
                if main_exit in done:
                    reason = "exit"
                elif report in done and not report.cancelled():
                    reason = report.result()
                else:
                    reason = "restart"
                if reason == "shadow-gone":
                    await self.replace_shadow(slot)
                    continue
                slot.restart_asked.clear()  # a request made from here on gets the next handover
                waiters, slot.restart_waiters = slot.restart_waiters, []
                event = None
                try:
                    event = await self.handover(slot, reason, detected_at)
                except Exception:  # the bus or the registry failed mid-way: watch on, try again
                    log.exception("engine %s: handover after %s failed", slot.engine_id, reason)
                    await asyncio.sleep(1.0)
                finally:
                    for waiter in waiters:  # any replacement made after the request answers it
                        if not waiter.done():
                            waiter.set_result(event)
        finally:
            slot.restart_asked.clear()
            for waiter in slot.restart_waiters:  # quarantined or stopping: nothing will restart it
                if not waiter.done():
                    waiter.set_result(None)
            slot.restart_waiters = []

    async def on_model_published(self, published: ModelPublished) -> None:
        if self.config.kind != "vllm" or self.model_path is None:
            return
        folder = Path(published.path)
        try:  # a folder the workers refuse must not become what every later worker starts from
            await asyncio.to_thread(check_same_model, self.model_path, folder)
        except (OSError, ModelFolderError) as exc:
            log.error("weight version %s not adopted for later workers: %s", published.version, exc)
            return
        log.info("workers started from now on load weight version %s (%s)", published.version, folder)
        self.model_path = folder
        self.newest_model = published

    async def on_restart(self, request: EngineRestart, subject: str) -> EngineRestarted:
        """Restart the engine the subject names by the cold path; answer once its new worker
        serves."""
        arrived = time.monotonic()
        engine_id = subject.split(".")[-2]
        slot = self.slots.get(engine_id)
        if slot is None:
            raise bus.ServiceError("unknown-engine", f"this supervisor does not run engine {engine_id!r}")
        if slot.quarantined:
            raise bus.ServiceError("engine-quarantined", f"engine {engine_id} is quarantined")
        log.info("engine %s: restart requested: %s", engine_id, request.reason)
        answered: asyncio.Future[Handover | None] = asyncio.get_running_loop().create_future()
        slot.restart_waiters.append(answered)
        slot.restart_asked.set()
        try:
            event = await asyncio.wait_for(
                asyncio.shield(answered), RESTART_TIMEOUT_FACTOR * self.config.start_timeout_s
            )
        except TimeoutError:
            raise bus.ServiceError("restart-failed", f"engine {engine_id}: no new worker in time") from None
        if event is None:
            raise bus.ServiceError("restart-failed", f"engine {engine_id}: no worker could be started")
        return EngineRestarted(
            engine_id=engine_id,
            old_pid=event.old_pid,
            new_pid=event.new_pid,
            epoch=event.epoch,
            took_s=time.monotonic() - arrived,
        )

    async def shadow_report(self, slot: EngineSlot) -> Literal["exit", "hang", "shadow-gone"]:
        """ "exit" or "hang" when the shadow reports its main failed; "shadow-gone" if it died."""
        while slot.shadow is None:  # a new shadow is starting: only the main's exit is watched
            slot.shadow_started.clear()
            await slot.shadow_started.wait()
        shadow = slot.shadow
        while True:
            report = await shadow.reports.get()
            if report is None:
                return "shadow-gone"
            if isinstance(report, MainFailed):
                return report.reason

    async def replace_shadow(self, slot: EngineSlot) -> None:
        old = slot.shadow
        slot.shadow = None
        if old is not None:
            await old.kill_confirmed(self.config.death_timeout_s)
            await self.announce(
                ProcessEvent(name=f"worker-{slot.engine_id}-shadow", pid=old.pid, state="exited")
            )
        behind = slot.main
        try:
            shadow = await self.start_worker(slot, "shadow", watch=behind)
        except (StartFailed, TimeoutError) as exc:
            log.error("engine %s: no shadow: %s", slot.engine_id, exc)
            return
        # Quarantined, or the main replaced (a restart) while this shadow started: it stands by for
        # nothing, and a shadow watching a dead main would report it failed at once.
        if slot.quarantined or slot.main is not behind or slot.shadow is not None:
            await shadow.kill_confirmed(self.config.death_timeout_s)
            return
        slot.shadow = shadow
        slot.shadow_started.set()
        self.write_state()

    # ------------------------------------------------------------ handover

    async def handover(self, slot: EngineSlot, reason: str, detected_at: float) -> Handover | None:
        """Replace the main (the shadow path, else the cold path); the event, or None when the
        engine was quarantined or no worker could be started."""
        assert slot.main is not None
        old, shadow = slot.main, slot.shadow
        phases: dict[str, float] = {}
        t = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = round(1000 * (now - t), 3)
            self.metrics.phase.labels(name).observe(now - t)
            t = now

        cold: list[tuple[ColdReason, str]] = []  # why not the shadow path, each with its detail
        if not await old.kill_confirmed(self.config.death_timeout_s):
            cold.append(("kill-unconfirmed", f"old main pid {old.pid} not confirmed dead"))
        phase("kill_confirmed")
        backoff_s = 0.0
        if reason == "restart":
            cold.append(("restart-requested", "restart requested"))
        else:
            at_once = time.monotonic() - slot.took_over_at < self.config.failure_window_s
            slot.streak = slot.streak + 1 if at_once else 1
            bound = self.config.quarantine_after
            if bound and slot.streak >= bound:
                async with self.quarantining:  # two engines at their bound: one decides first
                    if await self.another_engine_serves(slot.engine_id):
                        await self.quarantine(slot)
                        return None
                backoff_s = min(2.0 ** (slot.streak - bound), MAX_BACKOFF_S)
                cold.append(("unstable", f"failed {slot.streak} times in a row; the last healthy engine"))
                await self.alert_unstable(slot, backoff_s)
        if self.maps_servers:
            cold += await self.servers_unfit(shadow)
        phase("servers_checked")
        if not cold and self.maps_servers:
            try:  # for the dead main's epoch: the KV server refuses it for any other
                dead = await self.entry(slot.engine_id)
                flush = KvFlush(engine_id=slot.engine_id, epoch=dead.epoch if dead is not None else 0)
                await bus.request(self.nc, self.subjects.kv_flush(slot.engine_id), flush, 2.0)
            except bus.ServiceError as exc:
                cold.append(("flush-failed", f"arena flush failed: {exc}"))
        phase("arena_flushed")
        if shadow is None:
            cold.append(("no-shadow", "no shadow"))
        new: WorkerProcess | None = None
        if not cold and shadow is not None:
            await shadow.tell(PromoteShadow())
            try:
                await shadow.expect(WorkerReady, timeout_s=self.config.start_timeout_s)
                new = shadow
            except (StartFailed, TimeoutError) as exc:
                cold.append(("promotion-failed", f"shadow not promoted: {exc}"))
        phase("promoted")
        if new is None:
            if shadow is not None:
                await shadow.kill_confirmed(self.config.death_timeout_s)
            slot.shadow = None
            await asyncio.sleep(backoff_s)
            try:
                new = await self.start_worker(slot, "cold")
            except (StartFailed, TimeoutError) as exc:
                log.error("engine %s: cold start failed: %s", slot.engine_id, exc)
                return None
            phase("cold_started")
        slot.main = new
        slot.took_over_at = time.monotonic()
        slot.shadow = None
        self.write_state()
        entry = await self.entry(slot.engine_id)
        event = Handover(
            engine_id=slot.engine_id,
            reason=reason,
            path="cold" if cold else "shadow",
            cold_reason="; ".join(detail for _, detail in cold),
            old_pid=old.pid,
            new_pid=new.pid,
            epoch=entry.epoch if entry else 0,
            detected_at=detected_at,
            phases_ms=phases,
        )
        await bus.publish(self.nc, self.subjects.event("handover", slot.engine_id), event)
        self.count(event, cold, time.time() - detected_at)
        log.info("engine %s handover after %s (%s path): %s", slot.engine_id, reason, event.path, phases)
        self.spawn_task(self.replace_shadow(slot), f"shadow-{slot.engine_id}")
        return event

    def count(self, event: Handover, cold: list[tuple[ColdReason, str]], took_s: float) -> None:
        """The handover's metrics: one handover, and each reason for a cold path once."""
        self.metrics.handovers.labels(event.engine_id, event.reason, event.path).inc()
        self.metrics.duration.labels(event.path).observe(took_s)
        for reason in dict.fromkeys(reason for reason, _ in cold):
            self.metrics.cold_paths.labels(reason).inc()

    async def servers_unfit(self, shadow: WorkerProcess | None) -> list[tuple[ColdReason, str]]:
        """Why the weight and KV servers cannot be trusted now: one does not answer, or it is a
        new instance that does not own what the shadow mapped. Empty when both are fit."""
        unfit: list[tuple[ColdReason, str]] = []
        mapped = shadow.idle if shadow is not None else WorkerIdle()
        weights = ServerCheck(
            "weight server", "weight-server-down", "weight-server-restarted",
            mapped.weights_instance, self.subjects.weights_ping, WeightServerAlive,
        )  # fmt: skip
        arenas = ServerCheck(
            "KV server", "kv-server-down", "kv-server-restarted",
            mapped.kv_instance, self.subjects.kv_ping, KvServerAlive,
        )  # fmt: skip
        for check in (weights, arenas):
            try:
                alive = await bus.request_struct(
                    self.nc, check.subject, ServerPing(), check.reply, SERVER_PING_TIMEOUT_S
                )
            except bus.ServiceError as exc:
                unfit.append((check.down, f"{check.name} not answering ({exc.code})"))
                continue
            if check.owner not in (None, alive.instance):
                why = f"{check.name} restarted: instance {alive.instance} does not own the shadow's mapping"
                unfit.append((check.restarted, why))
        return unfit

    async def entry(self, engine_id: str) -> EngineEntry | None:
        """The engine's registry entry; None when absent, or when it does not decode (reported:
        the engine's next worker overwrites it)."""
        try:
            entry, _ = await registry.read(self.kv, engine_id)
        except PoisonedRecord as poisoned:
            await self.skipped(poisoned)
            return None
        return entry

    async def another_engine_serves(self, engine_id: str) -> bool:
        """Whether an engine other than `engine_id` is not quarantined (the registry's word, so
        other hosts' engines count too; an entry that does not decode counts as not serving)."""
        try:
            found, poisoned = await asyncio.wait_for(registry.entries(self.kv), SERVER_PING_TIMEOUT_S * 4)
        except Exception as exc:
            log.warning("engine %s: the registry could not be listed (%s): not quarantined", engine_id, exc)
            return False
        for bad in poisoned:
            await self.skipped(bad)
        return any(e.engine_id != engine_id and e.health == "serving" for e in found)

    async def alert_unstable(self, slot: EngineSlot, backoff_s: float) -> None:
        alert = EngineUnstable(
            engine_id=slot.engine_id,
            failures=slot.streak,
            window_s=self.config.failure_window_s,
            backoff_s=backoff_s,
        )
        await bus.publish(self.nc, self.subjects.event("engine_unstable", slot.engine_id), alert)
        log.error(
            "engine %s failed %d times in a row, but it is the last healthy engine: not quarantined;"
            " the cold path in %.1f s",
            slot.engine_id, slot.streak, backoff_s,
        )  # fmt: skip

    async def quarantine(self, slot: EngineSlot) -> None:
        slot.quarantined = True
        await registry.quarantine(self.kv, slot.engine_id)  # first: another engine's check reads it
        if slot.shadow is not None:
            await slot.shadow.kill_confirmed(self.config.death_timeout_s)
            slot.shadow = None
        self.metrics.quarantines.labels(slot.engine_id).inc()
        self.write_state()
        alert = EngineQuarantined(
            engine_id=slot.engine_id, failures=slot.streak, window_s=self.config.failure_window_s
        )
        await bus.publish(self.nc, self.subjects.event("engine_quarantined", slot.engine_id), alert)
        log.error("engine %s quarantined after %d failures in a row", slot.engine_id, slot.streak)

    # ------------------------------------------------------------ events, state file and shutdown

    def write_state(self) -> None:
        """`<state-dir>/engines.json`: each engine's main and shadow pid, for status and tests."""
        state: ShadowState = {
            slot.engine_id: EngineWorkers(
                main=slot.main.pid if slot.main else 0,
                shadow=slot.shadow.pid if slot.shadow else 0,
                quarantined=slot.quarantined,
            )
            for slot in self.slots.values()
        }
        files.write_whole(self.config.state_dir / "engines.json", msgspec.json.encode(state))

    async def announce(self, event: ProcessEvent) -> None:
        with contextlib.suppress(Exception):
            await bus.publish(self.nc, self.subjects.event("process", event.name), event)

    async def stop(self) -> None:
        self.stopping = True
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for worker in list(self.workers):  # mains, shadows, and any still starting
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.terminate()
                try:
                    await asyncio.wait_for(worker.process.wait(), STOP_GRACE_S)
                except TimeoutError:
                    await worker.kill_confirmed(self.config.death_timeout_s)
            if worker.reader is not None:
                worker.reader.cancel()
