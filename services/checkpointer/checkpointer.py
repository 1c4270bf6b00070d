"""The checkpointer: the sandboxes of one Docker host, their records, their FIFO, their health.

Owns: every sandbox container labelled with its host id, their records under `<state>/sandboxes`,
and the checkpoint store under `<state>/checkpoints`. Prefix pointers live in JetStream KV.
Each sandbox has one strict FIFO (an asyncio.Lock, which serves waiters in arrival order) through
which its actions, checkpoints and restores pass, so a checkpoint labelled k sees exactly the
state right after action k (invariant 3). Environment failures are judged from the container's
state and raised as ServiceError("env-failure") with an EnvFailure event (invariant 4).
full_checkpoint and full_restore themselves are in checkpoint.py and restore.py; this module queues them, bounds
them in time, saves the record and announces what they did, and reconciles what a crash in the
middle left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker
import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from belayer_rl.services.checkpointer import checkpoint, layer, objects, pointer, restore
from belayer_rl.services.checkpointer.client import container_name
from belayer_rl.services.checkpointer.host import Host, fresh_container
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE
from belayer_rl.services.checkpointer.records import SandboxRecord
from belayer_rl.services.checkpointer.sandbox import (
    OUTPUT_CAP,
    DockerEngine,
    EnvironmentFailure,
    SandboxPolicy,
    host_memory_mb,
    host_trouble,
)
from belayer_rl.services.checkpointer.store import TRAJECTORY, CorruptCheckpoint, Store, checkpoint_key
from belayer_rl.shared import bus, files, protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.config import CheckpointerConfig, ConfigError
from belayer_rl.shared.metrics import CheckpointerMetrics, Metrics
from belayer_rl.shared.protocol import (
    Ack,
    CheckpointReady,
    CheckpointResult,
    EnvFailure,
    ExecResult,
    PoisonedRecord,
    PrefixPointer,
    RestoreResult,
    SandboxCheckpoint,
    SandboxCreate,
    SandboxDestroy,
    SandboxExec,
    SandboxInfo,
    SandboxList,
    SandboxListing,
    SandboxRestore,
    SandboxRestored,
    TrajectoryEnd,
    TrajectoryEnded,
)
from belayer_rl.shared.runtime import Skipped

log = logging.getLogger("belayer.checkpointer")

WATCH_BACKOFF_S = 0.5
MAX_WATCH_BACKOFF_S = 10.0
ORPHAN_DUMP_WAIT_S = 600.0  # at start, how long a dump left running by a crash is waited for
UNRECORDED_REMOVE_TRIES, UNRECORDED_REMOVE_RETRY_S = 7, 2.0  # a busy overlay: 42 s of waits in all


@dataclass
class Sandbox:
    record: SandboxRecord
    fifo: asyncio.Lock = field(default_factory=asyncio.Lock)


class Checkpointer:
    def __init__(
        self,
        config: CheckpointerConfig,
        engine: DockerEngine,
        nc: NATS,
        kv: KeyValue,
        skipped: Skipped,
        metrics: CheckpointerMetrics | None = None,  # None: counts nothing (outside a runtime)
    ) -> None:
        self.config = config
        self.skipped = skipped  # the runtime's report of a pointer that does not decode
        self.metrics = metrics or CheckpointerMetrics(Metrics(enabled=False))
        self.subjects = config.subjects
        self.engine = engine
        self.nc = nc
        self.kv = kv
        state_dir = config.state  # resolved by the config
        state_dir.mkdir(parents=True, exist_ok=True)
        try:  # a key file named by the operator must exist: a new key would disown every checkpoint
            key = checkpoint_key(
                config.checkpoint_key or state_dir / "checkpoint.key",
                create=config.checkpoint_key is None,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--checkpoint-key: {exc}") from None
        self.store = Store(state_dir / "checkpoints", key)
        self.records_dir = state_dir / "sandboxes"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.sandboxes: dict[str, Sandbox] = {}
        self.tasks: set[asyncio.Task[object]] = set()
        self.objects: ObjectStore | None = None  # set when config.object_store
        self.host = Host(
            host_id=config.host_id, engine=engine, store=self.store, kv=kv,
            max_layer_bytes=int(config.max_layer_gb * (1 << 30)), crash_at=config.crash_at,
            debug_older_environment=config.debug_older_environment,
            policy=SandboxPolicy(
                allow_network=config.allow_network,
                allow_root_user=config.allow_root_user,
                max_memory_mb=config.sandbox_memory_mb or host_memory_mb(),
                max_cpus=config.sandbox_cpus or float(os.cpu_count() or 1),
                max_pids=config.sandbox_pids,
            ),
        )  # fmt: skip

    def spawn(self, what: str, coro: Coroutine[object, object, object]) -> None:
        """Background work owned by the checkpointer: tracked, its failure logged."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed", what)

        task = asyncio.create_task(guarded(), name=what)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ------------------------------------------------------------ records

    def save(self, sb: Sandbox) -> None:
        try:
            files.write_whole(self.records_dir / f"{sb.record.sandbox}.json", msgspec.json.encode(sb.record))
        except OSError as exc:
            raise host_trouble(exc) or exc from None

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
        """Match records, labelled containers and the store after a (re)start.

        A dump that a crash left running keeps its sandbox frozen and locked until it ends (up to
        ORPHAN_DUMP_WAIT_S), in the background: the host's other sandboxes are served meanwhile."""
        for path in self.records_dir.glob("*.json"):
            with contextlib.suppress(OSError, msgspec.DecodeError):
                record = msgspec.json.decode(path.read_bytes(), type=SandboxRecord)
                if record.state != "destroyed":
                    self.sandboxes[record.sandbox] = Sandbox(record)
        dumps = await self.engine.procs.dumps_in_flight()
        writing = {cid: self.store.staging_of(images) for cid, images in (dumps or {}).items()}
        known = {sb.record.container_id: sb for sb in self.sandboxes.values()}
        for container in await self.engine.ours(self.config.host_id):
            sb = known.pop(container.id, None)
            if sb is None:  # created but never recorded (a crash right after create): not ours to keep
                self.spawn(f"container {container.id[:12]}: removal", self.remove_unrecorded(container.id))
                continue
            if container.state == "paused" or container.id in (dumps or {}):  # a crash mid-checkpoint
                await sb.fifo.acquire()  # free: nothing is served yet. after_orphaned_dump releases it
                orphan = self.after_orphaned_dump(sb, writing.get(container.id))
                self.spawn(f"sandbox {sb.record.sandbox}: orphaned dump", orphan)
                continue
            await self.judge_at_start(sb)
        for sb in known.values():  # recorded, but its container is gone
            if sb.record.state == "running":
                await self.env_failure(
                    sb, EnvironmentFailure("missing", "container gone at checkpointer start")
                )
        if dumps is None:
            log.warning("/proc not read in time: half-written checkpoints are left for the next start")
        else:
            for path in self.store.sweep(keep={folder for folder in writing.values() if folder}):
                log.info("removed half-written checkpoint %s", path.name)
        for trajectory in self.store.trajectories():
            try:
                current, _ = await pointer.read(self.kv, trajectory)
            except PoisonedRecord as poisoned:  # which checkpoint it named is unknown: keep them all
                await self.skipped(poisoned)
                continue
            try:
                await self.rebuild_pointer(trajectory, current)
            except Exception:  # the bus, say: this trajectory keeps its pointer; the others go on
                log.exception("trajectory %s: pointer not rebuilt", trajectory)

    async def remove_unrecorded(self, container_id: str) -> None:
        """Remove a container no record names, in the background and with retries: after a dockerd
        restart its overlay can stay busy for a while ("device or resource busy"), and no sandbox
        waits on it, so it must not stop the checkpointer from serving the others."""
        log.info("removing unrecorded sandbox container %s", container_id[:12])
        for attempt in range(UNRECORDED_REMOVE_TRIES):
            if attempt:
                await asyncio.sleep(UNRECORDED_REMOVE_RETRY_S * attempt)
            try:
                await self.engine.remove(container_id)
                return
            except aiodocker.DockerError as exc:
                log.warning("container %s not removed yet (%s)", container_id[:12], exc.message)
        log.error("container %s not removed: it is left for the next start", container_id[:12])

    async def judge_at_start(self, sb: Sandbox) -> None:
        """Fail a sandbox that died while no checkpointer watched, or whose action a crash cut."""
        failure, _ = await self.engine.health(sb.record.container_id, sb.record.oom_seen)
        if failure is None and sb.record.acting:
            failure = EnvironmentFailure.interrupted(sb.record.step)
        if failure is not None and sb.record.state == "running":
            await self.env_failure(sb, failure)

    async def after_orphaned_dump(self, sb: Sandbox, staging: Path | None) -> None:
        """Wait for the dump a crash left running on the sandbox (`staging`: the folder it writes
        to, None when not seen), then unfreeze the sandbox, remove what the dump wrote, and judge it.
        Releases the sandbox's lock, which reconcile took."""
        try:
            deadline = time.monotonic() + ORPHAN_DUMP_WAIT_S
            ended = False
            while not ended and time.monotonic() < deadline:
                dumps = await self.engine.procs.dumps_in_flight()  # None: not known, so waited on
                ended = dumps is not None and sb.record.container_id not in dumps
                if not ended:
                    await asyncio.sleep(0.1)
            log.info("sandbox %s was left frozen by a crash mid-checkpoint: unfreezing", sb.record.sandbox)
            with contextlib.suppress(aiodocker.DockerError):  # a dump not yet frozen left it running
                await self.engine.unpause(sb.record.container_id)
            if staging is not None and ended:
                await asyncio.to_thread(shutil.rmtree, staging, True)
            await self.judge_at_start(sb)
        finally:
            sb.fifo.release()

    async def rebuild_pointer(self, trajectory: str, current: PrefixPointer | None) -> PrefixPointer | None:
        """Move the trajectory's pointer to its newest checkpoint here that is ahead of `current`
        and verifies against its authenticated manifest; return the pointer then in effect.

        A checkpoint ahead of the pointer was sealed and published, but its pointer update was
        lost: a crash between publish and advance, or a broker that lost, purged or never had the
        pointer. It is a whole checkpoint of one action boundary (E_k with its own L_k), so
        adopting it keeps the trajectory prefix-consistent, and nothing is deleted for want of
        metadata. Checkpoints that do not verify are left for the restore that meets them."""
        newer = [
            s for s in await asyncio.to_thread(self.store.ready, trajectory)
            if s.manifest.trajectory == trajectory
            and (current is None or s.manifest.order > pointer.order(current))
        ]  # fmt: skip
        for stored in newer:
            try:
                manifest = await asyncio.to_thread(self.store.verify, stored.path)
            except (CorruptCheckpoint, OSError) as exc:
                log.warning("trajectory %s: not adopting %s: %s", trajectory, stored.path.name, exc)
                continue
            # The host that took it: a folder copied or fetched from elsewhere keeps its origin, so
            # a restore here still counts as a move (a new incarnation).
            adopted = PrefixPointer(
                trajectory=trajectory, host_id=manifest.host_id, sandbox=manifest.sandbox,
                checkpoint_id=manifest.checkpoint_id, incarnation=manifest.incarnation, k=manifest.k,
                context_digest=manifest.context_digest, context_len=manifest.context_len, owner=manifest.owner,
            )  # fmt: skip
            moved, now = await pointer.advance(self.kv, adopted)
            if moved:
                log.warning(
                    "trajectory %s: pointer %s rebuilt from checkpoint %s %s",
                    trajectory, current and pointer.order(current), manifest.checkpoint_id, manifest.order,
                )  # fmt: skip
            return now
        return current

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
        async with sb.fifo:  # health thaws a frozen cgroup: never one that a checkpoint froze
            failure, sb.record.oom_seen = await self.engine.health(sb.record.container_id, sb.record.oom_seen)
        if failure is not None and host_trouble(failure) is not None:
            return  # the daemon's trouble says nothing of the sandbox: its next action will tell
        if failure is not None and not sb.fifo.locked() and sb.record.state == "running":
            await self.env_failure(sb, failure)

    # ------------------------------------------------------------ events

    async def env_failure(self, sb: Sandbox, failure: EnvironmentFailure) -> ServiceError:
        if sb.record.state == "destroyed":
            return ServiceError("destroyed", f"sandbox {sb.record.sandbox} was destroyed")
        sb.record.state, sb.record.failure = "failed", str(failure)
        self.save(sb)
        self.metrics.env_failures.labels(failure.reason).inc()
        log.warning("sandbox %s: environment failure: %s", sb.record.sandbox, failure)
        event = EnvFailure(
            sandbox=sb.record.sandbox, host_id=self.config.host_id, container_id=sb.record.container_id,
            reason=failure.reason, detail=failure.detail, step=sb.record.step,
        )  # fmt: skip
        await self.publish(self.subjects.event("env_failure", sb.record.sandbox), event)
        return ServiceError("env-failure", f"{failure.reason}: {failure.detail}")

    async def publish(self, subject: str, message: protocol.Message) -> None:
        try:
            await bus.publish(self.nc, subject, message)
        except Exception as exc:  # the bus may be reconnecting; the result still tells the caller
            log.warning("event on %s not published: %s", subject, exc)

    # ------------------------------------------------------------ create / exec / destroy

    async def check_client(self, request: protocol.SandboxRequest, client: str) -> None:
        """Only the client that made a sandbox may act on it, and only the client that owns a
        trajectory may checkpoint, restore or end it; to another, the sandbox does not exist. A
        trajectory belongs to the client whose sandbox first checkpointed it. A sandbox or
        trajectory with no owner (from before owners) is anyone's.

        Nothing here waits for an action, checkpoint or destroy: they take the sandbox's FIFO in
        arrival order, so a checkpoint's trajectory owner is checked under it (full_checkpoint)."""
        if isinstance(request, SandboxExec | SandboxCheckpoint | SandboxDestroy):
            sb = self.sandboxes.get(request.sandbox)
            if sb is not None and sb.record.owner not in ("", client):
                raise ServiceError(
                    "no-sandbox", f"no sandbox {request.sandbox!r} on host {self.config.host_id}"
                )
        if isinstance(request, SandboxRestore | TrajectoryEnd):
            owner = await self.trajectory_owner(request.trajectory)
            if owner not in ("", client):
                raise ServiceError("not-allowed", f"trajectory {request.trajectory} is another client's")

    async def trajectory_owner(self, trajectory: str) -> str:
        """The owner of the sandbox bound to `trajectory` here, else the pointer's (which every host
        reads, and only checkpointers write), else this host's signed base record's; "" when none
        says."""
        for sb in self.sandboxes.values():
            if sb.record.trajectory == trajectory and sb.record.state != "destroyed":
                return sb.record.owner
        with contextlib.suppress(protocol.PoisonedRecord):  # unreadable: the signed record decides
            current, _ = await pointer.read(self.kv, trajectory)
            if current is not None:
                return current.owner
        path = self.store.trajectory_dir(trajectory) / TRAJECTORY
        try:
            signed = await asyncio.to_thread(self.store.read_signed, path)
            return msgspec.json.decode(signed, type=SandboxRecord).owner
        except (CorruptCheckpoint, msgspec.DecodeError):
            return ""

    async def on_create(self, req: SandboxCreate, owner: str = "") -> SandboxInfo:
        name = req.sandbox or f"sb-{secrets.token_hex(6)}"
        if name in self.sandboxes and self.sandboxes[name].record.state != "destroyed":
            raise ServiceError("exists", f"sandbox {name!r} exists")
        if why := self.host.policy.refusal(req.spec):
            raise ServiceError("not-allowed", f"sandbox {name}: {why}")
        self.check_room()
        sb = Sandbox(SandboxRecord(sandbox=name, spec=req.spec, container_id="", image_id="", owner=owner))
        self.sandboxes[name] = sb  # the name is taken before the first wait
        async with sb.fifo:
            try:
                image = await self.engine.inspect_image(req.spec.image)
                sb.record.image_id = image.id
                await fresh_container(self.host, sb.record, image)
                await self.engine.start(sb.record.container_id)
            except (aiodocker.DockerError, msgspec.ValidationError, ServiceError) as exc:
                # ValidationError: the engine's reply does not fit; a daemon error like the others.
                # ServiceError: the image's USER is no user a spec may name.
                self.sandboxes.pop(name, None)
                if sb.record.container_id:
                    with contextlib.suppress(aiodocker.DockerError):
                        await self.engine.remove(sb.record.container_id)
                if isinstance(exc, ServiceError):
                    raise
                if (trouble := host_trouble(exc)) is not None:
                    raise trouble from None
                detail = exc.message if isinstance(exc, aiodocker.DockerError) else str(exc)
                if sb.record.image_id:
                    raise ServiceError(
                        "create-failed", f"sandbox {name} from {req.spec.image!r}: {detail}"
                    ) from None
                if isinstance(exc, aiodocker.DockerError) and exc.status == 404:
                    detail = (
                        f"not on the Docker engine of host {self.config.host_id} (load it there;"
                        f" `python -m belayer_rl.services.checkpointer.image` builds {DEFAULT_IMAGE})"
                    )
                raise ServiceError(
                    "no-image", f"sandbox {name}: image {req.spec.image!r}: {detail}"
                ) from None
            self.save(sb)
        await self.check_idle(sb)  # an engine event that came while it was created was not judged
        return self.info(sb)

    def check_room(self) -> None:
        """Raise ServiceError("host-full") when this host runs --max-sandboxes already: before a
        create, and before a restore that brings a sandbox back."""
        live = sum(sb.record.state != "destroyed" for sb in self.sandboxes.values())
        if live >= self.config.max_sandboxes:
            raise ServiceError("host-full", f"this host runs {live} sandboxes, its most (--max-sandboxes)")

    async def on_exec(self, req: SandboxExec) -> ExecResult:
        sb = self.get(req.sandbox)
        async with sb.fifo:
            r = sb.record
            if r.state != "running":
                why = f" ({r.failure})" if r.failure else ""
                raise ServiceError("env-failure", f"sandbox {r.sandbox} is {r.state}{why}: restore it first")
            if r.acting:  # an earlier action ended in an unexpected error: it may have run
                raise await self.env_failure(sb, EnvironmentFailure.interrupted(r.step))
            if req.expect_step is not None and req.expect_step != r.step:
                raise ServiceError(
                    "wrong-step", f"sandbox {r.sandbox} has completed {r.step} actions, not {req.expect_step}"
                )
            r.acting = True
            try:
                self.save(sb)
            except BaseException:
                r.acting = False  # not started
                raise
            failure: EnvironmentFailure | None = None
            try:
                out = await self.engine.run_action(r.container_id, req.command, req.timeout_s, r.spec.user)
            except EnvironmentFailure as exc:
                failure = exc
            health, r.oom_seen = await self.engine.health(r.container_id, r.oom_seen)
            failure = health or failure  # the container's state explains a broken exec best
            if failure is not None:
                raise await self.env_failure(sb, failure)
            r.step, r.acting = r.step + 1, False
            self.save(sb)
            stdout, cut_stdout = protocol.encoded_text(out.stdout, OUTPUT_CAP)
            stderr, cut_stderr = protocol.encoded_text(out.stderr, OUTPUT_CAP)
            return ExecResult(
                sandbox=r.sandbox, step=r.step, exit_code=out.exit_code, stdout=stdout, stderr=stderr,
                timed_out=out.timed_out, truncated=out.truncated or cut_stdout or cut_stderr,
                duration_s=out.duration_s,
            )  # fmt: skip

    async def on_destroy(self, req: SandboxDestroy) -> Ack:
        sb = self.get(req.sandbox)
        was, sb.record.state = sb.record.state, "destroyed"  # a running action ends as "destroyed"
        # By id, and by name: a restore whose cleanup met an unreachable daemon left its container.
        try:
            for container in (sb.record.container_id, container_name(self.config.host_id, sb.record.sandbox)):
                if container:
                    await self.engine.remove(container)
        except aiodocker.DockerError as exc:
            sb.record.state = was  # not destroyed: the caller may ask again
            raise host_trouble(exc) or exc from None
        async with sb.fifo:
            if self.sandboxes.get(sb.record.sandbox) is not sb:  # a create took the name meanwhile
                return Ack(detail=f"destroyed {req.sandbox}")
            # A restore that held the sandbox meanwhile may have made a container since.
            try:
                await self.engine.remove(container_name(self.config.host_id, sb.record.sandbox))
            except aiodocker.DockerError as exc:
                sb.record.state = was
                raise host_trouble(exc) or exc from None
            sb.record.state = "destroyed"
            self.save(sb)
            (self.records_dir / f"{sb.record.sandbox}.json").unlink(missing_ok=True)
            self.sandboxes.pop(sb.record.sandbox, None)
        return Ack(detail=f"destroyed {req.sandbox}")

    async def on_list(self, req: SandboxList) -> SandboxListing:
        return SandboxListing(
            host_id=self.config.host_id, sandboxes=[self.info(sb) for sb in self.sandboxes.values()]
        )

    async def on_end(self, req: TrajectoryEnd) -> Ack:
        """GC: the trajectory is over, its checkpoints and pointer go, here and (through the
        event) on every host that holds copies of its own, from before the trajectory moved."""
        await asyncio.to_thread(self.store.remove_trajectory, req.trajectory)
        if self.objects is not None:
            await objects.delete_trajectory(self.objects, req.trajectory)
        await pointer.delete(self.kv, req.trajectory)
        ended = TrajectoryEnded(trajectory=req.trajectory, host_id=self.config.host_id)
        await self.publish(self.subjects.event("trajectory_ended", req.trajectory), ended)
        return Ack(detail=f"trajectory {req.trajectory} ended")

    async def on_trajectory_ended(self, event: TrajectoryEnded) -> None:
        """Another host ended a trajectory: this host's own copies go too. A host that was down
        then keeps them until its disk budget evicts them."""
        if event.host_id != self.config.host_id:
            await asyncio.to_thread(self.store.remove_trajectory, event.trajectory)

    # ------------------------------------------------------------ full_checkpoint

    async def on_checkpoint(self, req: SandboxCheckpoint) -> CheckpointResult:
        """Run the checkpoint as its own task: past the timeout the caller gets an error and carries
        on, while the sandbox stays locked until the dump has really ended (it is then discarded)."""
        sb = self.get(req.sandbox)
        abandoned = asyncio.Event()
        await sb.fifo.acquire()  # in arrival order; checkpoint() releases it when really done
        task = asyncio.create_task(self.checkpoint(sb, req, abandoned))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), req.timeout_s)
        except TimeoutError:
            abandoned.set()
            raise ServiceError("timeout", f"checkpoint of {req.sandbox} exceeded {req.timeout_s}s") from None

    async def checkpoint(
        self, sb: Sandbox, req: SandboxCheckpoint, abandoned: asyncio.Event
    ) -> CheckpointResult:
        """Called with the sandbox's FIFO held; releases it once the record says what happened,
        before the event, the upload and garbage collection, which need not hold up the next action."""
        try:
            try:
                result = await checkpoint.full_checkpoint(self.host, sb.record, req, abandoned)
            except EnvironmentFailure as failure:
                raise await self.env_failure(sb, failure) from None
            self.save(sb)
        finally:
            sb.fifo.release()
        self.metrics.checkpoints.inc()
        self.metrics.checkpoint_bytes.inc(result.bytes_written)
        self.metrics.freeze.observe(result.freeze_s)
        self.metrics.checkpoint_duration.observe(result.total_s)
        await self.publish(
            self.subjects.event("checkpoint_ready", req.trajectory),
            CheckpointReady(
                trajectory=result.trajectory, sandbox=result.sandbox, host_id=self.config.host_id,
                checkpoint_id=result.checkpoint_id, incarnation=result.incarnation, k=result.k,
                context_digest=result.context_digest, bytes_written=result.bytes_written,
                freeze_s=result.freeze_s, total_s=result.total_s,
            ),
        )  # fmt: skip
        if self.objects is not None:
            folder = self.store.trajectory_dir(req.trajectory) / result.checkpoint_id
            self.spawn(f"upload {result.checkpoint_id}", objects.upload(self.objects, folder, req.trajectory))
        try:
            await asyncio.to_thread(self.collect_garbage)
        except Exception:  # the checkpoint is ready; a GC failure must not say otherwise
            log.exception("garbage collection after %s failed", result.checkpoint_id)
        return result

    def collect_garbage(self) -> None:
        """Past the disk budget, the oldest checkpoints go, never a trajectory's latest."""
        budget = int(self.config.disk_budget_gb * (1 << 30))
        keep = {s[0].path for t in self.store.trajectories() if (s := self.store.ready(t))}
        for path in self.store.enforce_budget(budget, keep):
            log.info("disk budget: removed checkpoint %s", path.name)

    # ------------------------------------------------------------ full_restore

    async def on_restore(self, req: SandboxRestore, owner: str = "") -> RestoreResult:
        current, _ = await pointer.read(self.kv, req.trajectory)
        if current is None:  # lost by the broker? this host's checkpoints may still name it
            current = await self.rebuild_pointer(req.trajectory, None)
        if current is None:
            raise ServiceError("no-checkpoint", f"trajectory {req.trajectory} has no prefix pointer")
        here = self.store.trajectory_dir(req.trajectory) / current.checkpoint_id
        store = "local"
        if current.host_id != self.config.host_id and not here.is_dir():
            why = f"trajectory {req.trajectory} is checkpointed on host {current.host_id}"
            if self.objects is None:
                raise ServiceError(
                    "wrong-host", f"{why}; start this checkpointer with --object-store, or copy the"
                    f" folder checkpoints/{req.trajectory} of that host's store into this one's",
                )  # fmt: skip
            try:
                await objects.download(
                    self.objects, self.store, req.trajectory, current.checkpoint_id,
                    max_bytes=int(self.config.max_download_gb * (1 << 30)),
                )  # fmt: skip
            except (nats.js.errors.Error, CorruptCheckpoint, layer.HostileLayer, OSError) as exc:
                raise ServiceError("wrong-host", f"{why}, and fetching it failed: {exc}") from None
            store = "object-store"
        sb = self.sandboxes.get(current.sandbox)
        if sb is not None:
            check_owner(sb, req.trajectory)  # at once; again under its lock (a checkpoint may bind it)
            if sb.record.state != "destroyed" and sb.record.owner not in ("", owner):
                raise ServiceError("not-allowed", f"sandbox {current.sandbox} is another client's")
        if sb is None or sb.record.state == "destroyed":
            self.check_room()
            sb = Sandbox(self.base_record(req.trajectory, current))
            # A record from another host's manifest names no owner: the client restoring it here.
            sb.record.owner = sb.record.owner or owner
            self.sandboxes[current.sandbox] = sb
        task = asyncio.create_task(self.restore(sb, current, store))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            return await asyncio.wait_for(asyncio.shield(task), req.timeout_s)
        except TimeoutError:
            raise ServiceError("timeout", f"restore of {req.trajectory} exceeded {req.timeout_s}s") from None

    async def restore(self, sb: Sandbox, current: PrefixPointer, store: str) -> RestoreResult:
        """`store`: where the pointed checkpoint came from, "local" or "object-store" (fetched)."""
        started = time.monotonic()
        async with sb.fifo:
            check_owner(sb, current.trajectory)
            result = await restore.full_restore(self.host, sb.record, current, started)
            self.save(sb)
        self.metrics.restores.labels(result.source, store).inc()
        self.metrics.restore_duration.observe(result.restore_s)
        await self.publish(
            self.subjects.event("sandbox_restored", current.trajectory),
            SandboxRestored(
                trajectory=result.trajectory, sandbox=result.sandbox, host_id=self.config.host_id,
                source=result.source, checkpoint_id=result.checkpoint_id, incarnation=result.incarnation,
                k=result.k, rejected=result.rejected, restore_s=result.restore_s,
            ),
        )  # fmt: skip
        return result

    def base_record(self, trajectory: str, current: PrefixPointer) -> SandboxRecord:
        """The sandbox's settings for a restore here: from the trajectory's signed record, else from
        the pointed checkpoint's authenticated manifest (a folder that came from another host)."""
        path = self.store.trajectory_dir(trajectory) / TRAJECTORY
        try:
            base = msgspec.json.decode(self.store.read_signed(path), type=SandboxRecord)
        except (CorruptCheckpoint, msgspec.DecodeError):
            try:
                manifest = self.store.load(self.store.trajectory_dir(trajectory) / current.checkpoint_id)
            except CorruptCheckpoint as exc:
                raise ServiceError(
                    "no-checkpoint", f"trajectory {trajectory}: no sandbox settings: {exc}"
                ) from None
            base = SandboxRecord(
                sandbox=current.sandbox, spec=manifest.spec, container_id="", image_id=manifest.image_id,
                owner=manifest.owner,
            )  # fmt: skip
        base.sandbox = current.sandbox
        return base

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(BaseException):
                await task


def check_owner(sb: Sandbox, trajectory: str) -> None:
    """Raise ServiceError("wrong-trajectory") when a restore of `trajectory` would replace the live
    sandbox `sb` of another trajectory (one its name was reused for)."""
    if sb.record.state != "destroyed" and sb.record.trajectory not in ("", trajectory):
        raise ServiceError(
            "wrong-trajectory",
            f"sandbox {sb.record.sandbox} runs trajectory {sb.record.trajectory}: restoring"
            f" {trajectory} there would replace it",
        )
