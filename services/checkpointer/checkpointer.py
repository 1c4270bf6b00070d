"""The checkpointer: the sandboxes of one Docker host, their FIFO, full_checkpoint and full_restore.

Owns: every sandbox container labelled with its host id, their records under `<state>/sandboxes`,
and the checkpoint store under `<state>/checkpoints`. Prefix pointers live in JetStream KV.
Each sandbox has one strict FIFO (an asyncio.Lock, which serves waiters in arrival order) through
which its actions, checkpoints and restores pass, so a checkpoint labelled k sees exactly the
state right after action k (invariant 3). Environment failures are judged from the container's
state and raised as ServiceError("env-failure") with an EnvFailure event (invariant 4).

Checkpoint phases: freeze (docker pause) -> archive the writable layer -> CRIU dump, leaving the
processes running -> unfreeze -> seal (checksums, manifest, fsync) -> publish (rename) -> advance
(pointer compare-and-set) -> checkpoint-ready event. A failure or crash before "advance" leaves
the previous pointer in effect; a folder published but never pointed at is deleted at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import aiodocker
import msgspec
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from belayer_rl.services.checkpointer import layer, pointer
from belayer_rl.services.checkpointer.sandbox import Engine, EnvironmentFailure, dump_in_flight
from belayer_rl.services.checkpointer.store import (
    CONTEXT,
    CRIU,
    LAYER,
    Context,
    CorruptCheckpoint,
    Manifest,
    Store,
)
from belayer_rl.services.checkpointer.store import digest_context as digest
from belayer_rl.shared import bus, subjects
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    Ack,
    CheckpointReady,
    CheckpointResult,
    EnvFailure,
    ExecResult,
    PrefixPointer,
    RestoreResult,
    RestoreSource,
    SandboxCheckpoint,
    SandboxCreate,
    SandboxDestroy,
    SandboxExec,
    SandboxInfo,
    SandboxList,
    SandboxListing,
    SandboxRestore,
    SandboxRestored,
    SandboxSpec,
    TrajectoryEnd,
)

log = logging.getLogger("belayer.checkpointer")

PHASES = ("freeze", "archive", "dump", "unfreeze", "seal", "publish", "advance")
CRIU_NAME = "criu"  # the checkpoint name under which the engine dumps and restores
WATCH_BACKOFF_S = 0.5
MAX_WATCH_BACKOFF_S = 10.0
ORPHAN_DUMP_WAIT_S = 600.0  # at start, how long a dump left running by a crash is waited for


@dataclass(frozen=True)
class CheckpointerConfig:
    nats_url: str
    host_id: str
    state_dir: Path
    docker_url: str | None = None  # None: DOCKER_HOST or the default socket
    disk_budget_gb: float = 50.0  # oldest non-latest checkpoints go first past it; 0: unbounded
    max_layer_gb: float = 16.0  # a layer archive holding more is refused at restore
    crash_at: str = ""  # chaos testing: SIGKILL this process when a checkpoint reaches this phase

    def __post_init__(self) -> None:
        from belayer_rl.shared.config import ConfigError

        if not self.host_id.replace("-", "").replace("_", "").isalnum() or len(self.host_id) > 64:
            raise ConfigError(f"--host-id must be 1-64 of [A-Za-z0-9_-], got {self.host_id!r}")
        if self.disk_budget_gb < 0:
            raise ConfigError(f"--disk-budget-gb must be >= 0, got {self.disk_budget_gb}")
        if self.crash_at and self.crash_at not in PHASES:
            raise ConfigError(f"--crash-at must be one of {', '.join(PHASES)}, got {self.crash_at!r}")


class SandboxRecord(msgspec.Struct, kw_only=True):
    """`<state>/sandboxes/<id>.json`: what survives a restart of the checkpointer."""

    sandbox: str
    spec: SandboxSpec
    container_id: str
    image_id: str
    step: int = 0
    state: Literal["running", "failed", "destroyed"] = "running"
    trajectory: str = ""
    incarnation: int = -1  # -1: not yet bound to a trajectory
    oom_seen: int = 0


@dataclass
class Sandbox:
    record: SandboxRecord
    fifo: asyncio.Lock = field(default_factory=asyncio.Lock)


class Checkpointer:
    def __init__(self, config: CheckpointerConfig, engine: Engine, nc: NATS, kv: KeyValue) -> None:
        self.config = config
        self.engine = engine
        self.nc = nc
        self.kv = kv
        self.store = Store(config.state_dir / "checkpoints")
        self.records_dir = config.state_dir / "sandboxes"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.sandboxes: dict[str, Sandbox] = {}
        self.tasks: set[asyncio.Task[object]] = set()

    # ------------------------------------------------------------ records

    def save(self, sb: Sandbox) -> None:
        path = self.records_dir / f"{sb.record.sandbox}.json"
        tmp = path.with_suffix(".part")
        tmp.write_bytes(msgspec.json.encode(sb.record))
        tmp.replace(path)

    def get(self, sandbox: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox)
        if sb is None or sb.record.state == "destroyed":
            raise ServiceError("no-sandbox", f"no sandbox {sandbox!r} on host {self.config.host_id}")
        return sb

    def info(self, sb: Sandbox) -> SandboxInfo:
        r = sb.record
        return SandboxInfo(
            sandbox=r.sandbox, host_id=self.config.host_id, container_id=r.container_id, image=r.spec.image,
            state=r.state, step=r.step, trajectory=r.trajectory, incarnation=max(r.incarnation, 0),
        )  # fmt: skip

    async def reconcile(self) -> None:
        """Match records, labelled containers and the store after a (re)start."""
        for path in self.records_dir.glob("*.json"):
            with contextlib.suppress(OSError, msgspec.DecodeError):
                record = msgspec.json.decode(path.read_bytes(), type=SandboxRecord)
                if record.state != "destroyed":
                    self.sandboxes[record.sandbox] = Sandbox(record)
        known = {sb.record.container_id: sb for sb in self.sandboxes.values()}
        for container in await self.engine.ours(self.config.host_id):
            sb = known.pop(container["Id"], None)
            if sb is None:  # created but never recorded (a crash right after create): not ours to keep
                log.info("removing unrecorded sandbox container %s", container["Id"][:12])
                await self.engine.remove(container["Id"])
                continue
            if container.get("State") == "paused":  # a crash mid-checkpoint left it frozen
                for _ in range(int(ORPHAN_DUMP_WAIT_S * 10)):  # a dump we started may still run
                    if not dump_in_flight(container["Id"]):
                        break
                    await asyncio.sleep(0.1)
                log.info("sandbox %s was left frozen: unfreezing", sb.record.sandbox)
                with contextlib.suppress(aiodocker.DockerError):
                    await self.engine.unpause(container["Id"])
            failure, _ = await self.engine.health(container["Id"], sb.record.oom_seen)
            if failure is not None and sb.record.state == "running":
                await self.env_failure(sb, failure)
        for sb in known.values():  # recorded, but its container is gone
            if sb.record.state == "running":
                await self.env_failure(
                    sb, EnvironmentFailure("missing", "container gone at checkpointer start")
                )
        for path in self.store.sweep():
            log.info("removed half-written checkpoint %s", path.name)
        for trajectory in self.store.trajectories():
            current, _ = await pointer.read(self.kv, trajectory)
            for stored in self.store.ready(trajectory):
                if current is None or stored.manifest.order > pointer.order(current):
                    log.info("removing checkpoint %s: never pointed at", stored.path.name)
                    self.store.remove(stored.path)

    async def watch(self) -> None:
        """Report sandboxes that die or hit OOM between actions as soon as the engine says so;
        after each (re)connection to the engine, check every idle sandbox for what was missed."""
        backoff = WATCH_BACKOFF_S
        while True:
            try:
                for sb in list(self.sandboxes.values()):
                    await self.check_idle(sb)
                async for container_id, action in self.engine.deaths(self.config.host_id):
                    backoff = WATCH_BACKOFF_S
                    for sb in list(self.sandboxes.values()):
                        if sb.record.container_id == container_id:
                            log.info("sandbox %s: engine reports %s", sb.record.sandbox, action)
                            await self.check_idle(sb)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("engine event stream: %s; reconnecting in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_WATCH_BACKOFF_S)

    async def check_idle(self, sb: Sandbox) -> None:
        """Judge an idle running sandbox's health; busy ones are judged by what keeps them busy."""
        if sb.record.state != "running" or sb.fifo.locked() or not sb.record.container_id:
            return
        failure, sb.record.oom_seen = await self.engine.health(sb.record.container_id, sb.record.oom_seen)
        if failure is not None and not sb.fifo.locked() and sb.record.state == "running":
            await self.env_failure(sb, failure)

    # ------------------------------------------------------------ events

    async def env_failure(self, sb: Sandbox, failure: EnvironmentFailure) -> ServiceError:
        if sb.record.state == "destroyed":
            return ServiceError("destroyed", f"sandbox {sb.record.sandbox} was destroyed")
        sb.record.state = "failed"
        self.save(sb)
        log.warning("sandbox %s: environment failure: %s", sb.record.sandbox, failure)
        event = EnvFailure(
            sandbox=sb.record.sandbox, host_id=self.config.host_id, container_id=sb.record.container_id,
            reason=failure.reason, detail=failure.detail, step=sb.record.step,
        )  # fmt: skip
        await self.publish(subjects.event("env_failure", sb.record.sandbox), event)
        return ServiceError("env-failure", f"{failure.reason}: {failure.detail}")

    async def publish(self, subject: str, message: msgspec.Struct) -> None:
        try:
            await bus.publish(self.nc, subject, message)  # type: ignore[arg-type]
        except Exception as exc:  # the bus may be reconnecting; the result still tells the caller
            log.warning("event on %s not published: %s", subject, exc)

    # ------------------------------------------------------------ create / exec / destroy

    async def on_create(self, req: SandboxCreate) -> SandboxInfo:
        name = req.sandbox or f"sb-{secrets.token_hex(6)}"
        if name in self.sandboxes and self.sandboxes[name].record.state != "destroyed":
            raise ServiceError("exists", f"sandbox {name!r} exists")
        try:
            image_id = (await self.engine.docker.images.inspect(req.spec.image))["Id"]
        except aiodocker.DockerError as exc:
            raise ServiceError("no-image", f"image {req.spec.image!r}: {exc.message}") from None
        sb = Sandbox(SandboxRecord(sandbox=name, spec=req.spec, container_id="", image_id=image_id))
        self.sandboxes[name] = sb
        async with sb.fifo:
            sb.record.container_id = await self.fresh_container(sb, image_id)
            await self.engine.start(sb.record.container_id)
            self.save(sb)
        return self.info(sb)

    async def fresh_container(self, sb: Sandbox, image: str) -> str:
        """Remove the sandbox's container, if any, and create a new one with the original settings."""
        if sb.record.container_id:
            await self.engine.remove(sb.record.container_id)
        spec = msgspec.structs.replace(sb.record.spec, image=image)
        try:
            container_id = await self.engine.create(spec, self.config.host_id, sb.record.sandbox)
        except aiodocker.DockerError as exc:
            if exc.status != 409:
                raise
            await self.engine.remove(f"belayer-{self.config.host_id}-{sb.record.sandbox}")
            container_id = await self.engine.create(spec, self.config.host_id, sb.record.sandbox)
        sb.record.container_id = container_id
        sb.record.oom_seen = 0
        return container_id

    async def on_exec(self, req: SandboxExec) -> ExecResult:
        sb = self.get(req.sandbox)
        async with sb.fifo:
            r = sb.record
            if r.state != "running":
                raise ServiceError("env-failure", f"sandbox {r.sandbox} is {r.state}: restore it first")
            if req.expect_step is not None and req.expect_step != r.step:
                raise ServiceError(
                    "wrong-step", f"sandbox {r.sandbox} has completed {r.step} actions, not {req.expect_step}"
                )
            failure: EnvironmentFailure | None = None
            try:
                out = await self.engine.run_action(r.container_id, req.command, req.timeout_s)
            except EnvironmentFailure as exc:
                failure = exc
            health, r.oom_seen = await self.engine.health(r.container_id, r.oom_seen)
            failure = health or failure  # the container's state explains a broken exec best
            if failure is not None:
                raise await self.env_failure(sb, failure)
            r.step += 1
            self.save(sb)
            return ExecResult(
                sandbox=r.sandbox, step=r.step, exit_code=out.exit_code,
                stdout=out.stdout.decode(errors="replace"), stderr=out.stderr.decode(errors="replace"),
                timed_out=out.timed_out, truncated=out.truncated, duration_s=out.duration_s,
            )  # fmt: skip

    async def on_destroy(self, req: SandboxDestroy) -> Ack:
        sb = self.get(req.sandbox)
        sb.record.state = "destroyed"  # an action running now ends as "destroyed", not as a failure
        await self.engine.remove(sb.record.container_id)
        async with sb.fifo:
            self.save(sb)
            (self.records_dir / f"{sb.record.sandbox}.json").unlink(missing_ok=True)
            self.sandboxes.pop(sb.record.sandbox, None)
        return Ack(detail=f"destroyed {req.sandbox}")

    async def on_list(self, req: SandboxList) -> SandboxListing:
        return SandboxListing(
            host_id=self.config.host_id, sandboxes=[self.info(sb) for sb in self.sandboxes.values()]
        )

    async def on_end(self, req: TrajectoryEnd) -> Ack:
        """GC: the trajectory is over, its checkpoints and pointer go."""
        await asyncio.to_thread(self.store.remove_trajectory, req.trajectory)
        await pointer.delete(self.kv, req.trajectory)
        return Ack(detail=f"trajectory {req.trajectory} ended")

    # ------------------------------------------------------------ full_checkpoint

    async def on_checkpoint(self, req: SandboxCheckpoint) -> CheckpointResult:
        """Run the checkpoint as its own task: past the timeout the caller gets an error and carries
        on, while the sandbox stays locked until the dump has really ended (it is then discarded)."""
        sb = self.get(req.sandbox)
        abandoned = asyncio.Event()
        await sb.fifo.acquire()  # in arrival order; full_checkpoint releases it when really done
        task = asyncio.create_task(self.full_checkpoint(sb, req, abandoned))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), req.timeout_s)
        except TimeoutError:
            abandoned.set()
            raise ServiceError("timeout", f"checkpoint of {req.sandbox} exceeded {req.timeout_s}s") from None

    async def phase(self, name: str) -> None:
        if self.config.crash_at == name:
            log.warning("chaos: killing the checkpointer at phase %s", name)
            os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(10)

    async def full_checkpoint(
        self, sb: Sandbox, req: SandboxCheckpoint, abandoned: asyncio.Event
    ) -> CheckpointResult:
        """Called with the sandbox's FIFO held; releases it."""
        try:
            r = sb.record
            if r.state != "running":
                raise ServiceError("env-failure", f"sandbox {r.sandbox} is {r.state}")
            if req.k != r.step:
                raise ServiceError(
                    "wrong-step", f"checkpoint k={req.k} refused: the last completed action is {r.step}"
                )
            if r.trajectory and r.trajectory != req.trajectory:
                raise ServiceError(
                    "wrong-trajectory", f"sandbox {r.sandbox} belongs to trajectory {r.trajectory}"
                )
            current, _ = await pointer.read(self.kv, req.trajectory)
            incarnation = r.incarnation if r.trajectory else (current.incarnation + 1 if current else 0)
            if current is not None and (incarnation, req.k) <= pointer.order(current):
                raise ServiceError(
                    "stale", f"pointer is at {pointer.order(current)}, not behind ({incarnation}, {req.k})"
                )
            started = time.monotonic()
            checkpoint_id = f"i{incarnation}-k{req.k}-{secrets.token_hex(4)}"
            staging = self.store.staging(req.trajectory, checkpoint_id)
            try:
                result = await self._checkpoint_phases(
                    sb, req, incarnation, checkpoint_id, staging, abandoned, started
                )
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, staging, True)
                raise
            r.trajectory, r.incarnation = req.trajectory, incarnation
            self.save(sb)
        finally:
            sb.fifo.release()
        await self.publish(
            subjects.event("checkpoint_ready", req.trajectory),
            CheckpointReady(
                trajectory=req.trajectory, sandbox=r.sandbox, host_id=self.config.host_id, checkpoint_id=checkpoint_id,
                incarnation=incarnation, k=req.k, context_digest=result.context_digest,
                bytes_written=result.bytes_written, freeze_s=result.freeze_s, total_s=result.total_s,
            ),
        )  # fmt: skip
        try:
            await asyncio.to_thread(self.collect_garbage)
        except Exception:  # the checkpoint is ready; a GC failure must not say otherwise
            log.exception("garbage collection after %s failed", result.checkpoint_id)
        return result

    async def _checkpoint_phases(
        self, sb: Sandbox, req: SandboxCheckpoint, incarnation: int, checkpoint_id: str,
        staging: Path, abandoned: asyncio.Event, started: float,
    ) -> CheckpointResult:  # fmt: skip
        r = sb.record
        context = Context(tokens=list(req.context_tokens), ref=req.context_ref)
        (staging / CONTEXT).write_bytes(msgspec.json.encode(context))
        self.write_trajectory_spec(req.trajectory, r)
        try:
            upper = Path((await self.engine.inspect(r.container_id))["GraphDriver"]["Data"]["UpperDir"])
        except (aiodocker.DockerError, KeyError) as exc:
            raise await self.env_failure(
                sb, EnvironmentFailure("daemon-error", f"inspect failed: {exc}")
            ) from None
        await self.phase("freeze")
        frozen_at = time.monotonic()
        try:
            await self.engine.pause(r.container_id)
        except aiodocker.DockerError as exc:
            failure, _ = await self.engine.health(r.container_id, r.oom_seen)
            if failure is not None:
                raise await self.env_failure(sb, failure) from None
            raise ServiceError("checkpoint-failed", f"freeze: {exc.message}") from None
        dump_s = 0.0
        try:
            await self.phase("archive")
            await asyncio.to_thread(layer.archive, upper, staging / LAYER)
            await self.phase("dump")
            dump_started = time.monotonic()
            await self.engine.checkpoint(r.container_id, staging / CRIU)
            dump_s = time.monotonic() - dump_started
        except (OSError, aiodocker.DockerError) as exc:
            raise ServiceError("checkpoint-failed", f"{type(exc).__name__}: {exc}") from None
        finally:
            await self.phase("unfreeze")
            try:
                await self.engine.unpause(r.container_id)
            except aiodocker.DockerError as exc:
                failure, _ = await self.engine.health(r.container_id, r.oom_seen)
                raise await self.env_failure(
                    sb, failure or EnvironmentFailure("daemon-error", exc.message)
                ) from None
        freeze_s = time.monotonic() - frozen_at
        await self.phase("seal")
        fields = dict(
            checkpoint_id=checkpoint_id, trajectory=req.trajectory, sandbox=r.sandbox, host_id=self.config.host_id,
            incarnation=incarnation, k=req.k, spec=r.spec, image_id=r.image_id, criu_name=CRIU_NAME,
            context_digest=digest(context), context_len=len(context.tokens), freeze_s=freeze_s, dump_s=dump_s,
        )  # fmt: skip
        try:
            manifest: Manifest = await asyncio.to_thread(self.store.seal, staging, fields)
        except OSError as exc:
            raise ServiceError("checkpoint-failed", f"seal: {exc}") from None
        if abandoned.is_set():
            raise ServiceError("timeout", "the caller gave up on this checkpoint; discarded")
        await self.phase("publish")
        path = await asyncio.to_thread(self.store.publish, staging, manifest)
        await self.phase("advance")
        new = PrefixPointer(
            trajectory=req.trajectory, host_id=self.config.host_id, sandbox=r.sandbox, checkpoint_id=checkpoint_id,
            incarnation=incarnation, k=req.k, context_digest=manifest.context_digest, context_len=manifest.context_len,
        )  # fmt: skip
        try:
            moved, now = await pointer.advance(self.kv, new)
        except Exception as exc:
            await asyncio.to_thread(self.store.remove, path)
            raise ServiceError("checkpoint-failed", f"pointer not advanced: {exc}") from None
        if not moved:
            await asyncio.to_thread(self.store.remove, path)
            raise ServiceError("stale", f"pointer moved to {now and pointer.order(now)} meanwhile")
        return CheckpointResult(
            trajectory=req.trajectory, sandbox=r.sandbox, checkpoint_id=checkpoint_id, incarnation=incarnation,
            k=req.k, context_digest=manifest.context_digest, bytes_written=manifest.bytes, freeze_s=freeze_s,
            total_s=time.monotonic() - started,
        )  # fmt: skip

    def write_trajectory_spec(self, trajectory: str, record: SandboxRecord) -> None:
        """What a restore from the base image needs even when every checkpoint is unusable."""
        folder = self.store.trajectory_dir(trajectory)
        folder.mkdir(parents=True, exist_ok=True)
        base = SandboxRecord(
            sandbox=record.sandbox, spec=record.spec, container_id="", image_id=record.image_id
        )
        tmp = folder / "trajectory.json.part"
        tmp.write_bytes(msgspec.json.encode(base))
        tmp.replace(folder / "trajectory.json")

    def collect_garbage(self) -> None:
        budget = int(self.config.disk_budget_gb * (1 << 30))
        keep = {s[0].path for t in self.store.trajectories() if (s := self.store.ready(t))}
        for path in self.store.enforce_budget(budget, keep):
            log.info("disk budget: removed checkpoint %s", path.name)

    # ------------------------------------------------------------ full_restore

    async def on_restore(self, req: SandboxRestore) -> RestoreResult:
        current, _ = await pointer.read(self.kv, req.trajectory)
        if current is None:
            raise ServiceError("no-checkpoint", f"trajectory {req.trajectory} has no prefix pointer")
        if current.host_id != self.config.host_id:
            raise ServiceError(
                "wrong-host", f"trajectory {req.trajectory} is checkpointed on host {current.host_id}"
            )
        sb = self.sandboxes.get(current.sandbox)
        if sb is None or sb.record.state == "destroyed":
            sb = Sandbox(self.base_record(req.trajectory, current))
            self.sandboxes[current.sandbox] = sb
        task = asyncio.create_task(self.full_restore(sb, current))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), req.timeout_s)
        except TimeoutError:
            raise ServiceError("timeout", f"restore of {req.trajectory} exceeded {req.timeout_s}s") from None

    def base_record(self, trajectory: str, current: PrefixPointer) -> SandboxRecord:
        path = self.store.trajectory_dir(trajectory) / "trajectory.json"
        try:
            base = msgspec.json.decode(path.read_bytes(), type=SandboxRecord)
        except (OSError, msgspec.DecodeError) as exc:
            raise ServiceError(
                "no-checkpoint", f"trajectory {trajectory}: no sandbox settings: {exc}"
            ) from None
        base.sandbox = current.sandbox
        return base

    async def full_restore(self, sb: Sandbox, current: PrefixPointer) -> RestoreResult:
        started = time.monotonic()
        async with sb.fifo:
            rejected: list[str] = []
            chosen: tuple[Manifest, Context] | None = None
            for stored in self.candidates(current):
                try:
                    chosen = await self.restore_from(sb, stored)
                    break
                except (
                    CorruptCheckpoint,
                    layer.HostileLayer,
                    EnvironmentFailure,
                    aiodocker.DockerError,
                    OSError,
                ) as exc:
                    reason = f"{stored.name}: {type(exc).__name__}: {exc}"
                    log.warning("restore of %s: rejected %s", current.trajectory, reason)
                    rejected.append(reason)
                    await asyncio.to_thread(self.store.remove, stored)
            if chosen is None:  # the base image, from the start
                sb.record.container_id = await self.fresh_container(sb, sb.record.image_id)
                await self.engine.start(sb.record.container_id)
                manifest, context = None, Context()
            else:
                manifest, context = chosen
            source: RestoreSource = (
                "base"
                if manifest is None
                else "latest"
                if manifest.checkpoint_id == current.checkpoint_id
                else "previous"
            )
            incarnation = current.incarnation if source == "latest" else current.incarnation + 1
            k = manifest.k if manifest is not None else 0
            checkpoint_id = manifest.checkpoint_id if manifest is not None else ""
            if source != "latest":
                new = msgspec.structs.replace(
                    current, incarnation=incarnation, k=k, checkpoint_id=checkpoint_id,
                    context_digest=digest(context), context_len=len(context.tokens),
                )  # fmt: skip
                moved, now = await pointer.advance(self.kv, new)
                if not moved:
                    raise ServiceError(
                        "stale", f"pointer moved to {now and pointer.order(now)} during the restore"
                    )
            r = sb.record
            r.state, r.step, r.trajectory, r.incarnation = "running", k, current.trajectory, incarnation
            self.save(sb)
        elapsed = time.monotonic() - started
        await self.publish(
            subjects.event("sandbox_restored", current.trajectory),
            SandboxRestored(
                trajectory=current.trajectory, sandbox=r.sandbox, host_id=self.config.host_id, source=source,
                checkpoint_id=checkpoint_id, incarnation=incarnation, k=k, rejected=rejected, restore_s=elapsed,
            ),
        )  # fmt: skip
        return RestoreResult(
            trajectory=current.trajectory, sandbox=r.sandbox, container_id=r.container_id, source=source,
            checkpoint_id=checkpoint_id, incarnation=incarnation, k=k, context_tokens=context.tokens,
            context_ref=context.ref, context_digest=digest(context), rejected=rejected, restore_s=elapsed,
        )  # fmt: skip

    def candidates(self, current: PrefixPointer) -> list[Path]:
        """The pointed-at checkpoint first, then older ready ones, newest first."""
        ready = self.store.ready(current.trajectory)
        head = [s.path for s in ready if s.path.name == current.checkpoint_id]
        older = [
            s.path
            for s in ready
            if s.path.name != current.checkpoint_id and s.manifest.order < pointer.order(current)
        ]
        return head + older

    async def restore_from(self, sb: Sandbox, path: Path) -> tuple[Manifest, Context]:
        """Verify, recreate, install the layer and the CRIU images, start from the checkpoint."""
        manifest = await asyncio.to_thread(self.store.verify, path)
        context = self.store.context(path)
        entries = await asyncio.to_thread(
            layer.check, path / LAYER, int(self.config.max_layer_gb * (1 << 30))
        )
        sb.record.spec = manifest.spec
        container_id = await self.fresh_container(sb, manifest.image_id)
        try:
            upper = Path((await self.engine.inspect(container_id))["GraphDriver"]["Data"]["UpperDir"])
            await asyncio.to_thread(layer.install, path / LAYER, entries, upper)
            target = self.engine.container_dir(container_id) / "checkpoints" / CRIU_NAME
            await asyncio.to_thread(shutil.copytree, path / CRIU, target, copy_function=link_or_copy)
            await self.engine.start(container_id, checkpoint=CRIU_NAME)
            state = (await self.engine.inspect(container_id))["State"]
            if state.get("Paused"):
                await self.engine.unpause(container_id)
            failure, sb.record.oom_seen = await self.engine.health(container_id, 0)
            if failure is not None:
                raise failure
        except BaseException:
            with contextlib.suppress(Exception):
                await self.engine.remove(container_id)
            sb.record.container_id = ""
            raise
        return manifest, context

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task


def link_or_copy(src: str, dst: str) -> None:
    """CRIU images are only read by the engine: a hardlink saves copying them (same filesystem)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
