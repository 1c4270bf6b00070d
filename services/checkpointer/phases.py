"""full_checkpoint and full_restore: the phases, on behalf of the Checkpointer that owns the sandbox.

Checkpoint: freeze (docker pause) -> archive the writable layer -> CRIU dump, leaving the processes
running -> unfreeze -> seal (checksums, manifest, fsync) -> publish (rename) -> advance (pointer
compare-and-set) -> checkpoint-ready event. A failure or crash before "advance" leaves the previous
pointer in effect; a folder published but never pointed at is deleted when the checkpointer starts.

Restore: the pointed-at checkpoint, else older ready ones, newest first, else the base image. Each
candidate is verified against its manifest and its layer checked before anything is created; a
rejected one is deleted and named in the result. Falling back starts a new incarnation.
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
from pathlib import Path
from typing import TYPE_CHECKING

import aiodocker
import msgspec

from belayer_rl.services.checkpointer import layer, objects, pointer
from belayer_rl.services.checkpointer.sandbox import EnvironmentFailure
from belayer_rl.services.checkpointer.store import CONTEXT, CRIU, LAYER, Context, CorruptCheckpoint, Manifest
from belayer_rl.services.checkpointer.store import digest_context as digest
from belayer_rl.shared import subjects
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    CheckpointReady,
    CheckpointResult,
    PrefixPointer,
    RestoreResult,
    RestoreSource,
    SandboxCheckpoint,
    SandboxRestored,
)

if TYPE_CHECKING:
    from belayer_rl.services.checkpointer.checkpointer import Checkpointer, Sandbox, SandboxRecord

log = logging.getLogger("belayer.checkpointer")

PHASES = ("freeze", "archive", "dump", "unfreeze", "seal", "publish", "advance")
CRIU_NAME = "criu"  # the checkpoint name under which the engine restores


# ---------------------------------------------------------------- full_checkpoint


async def phase(cp: Checkpointer, name: str) -> None:
    if cp.config.crash_at == name:
        log.warning("chaos: killing the checkpointer at phase %s", name)
        os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(10)


async def full_checkpoint(
    cp: Checkpointer, sb: Sandbox, req: SandboxCheckpoint, abandoned: asyncio.Event
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
        current, _ = await pointer.read(cp.kv, req.trajectory)
        incarnation = r.incarnation if r.trajectory else (current.incarnation + 1 if current else 0)
        if current is not None and (incarnation, req.k) <= pointer.order(current):
            raise ServiceError(
                "stale", f"pointer is at {pointer.order(current)}, not behind ({incarnation}, {req.k})"
            )
        started = time.monotonic()
        checkpoint_id = f"i{incarnation}-k{req.k}-{secrets.token_hex(4)}"
        staging = cp.store.staging(req.trajectory, checkpoint_id)
        try:
            result = await _checkpoint_phases(
                cp, sb, req, incarnation, checkpoint_id, staging, abandoned, started
            )
        except BaseException as exc:
            await asyncio.to_thread(shutil.rmtree, staging, True)
            if isinstance(exc, OSError):  # a full disk, say, while writing the checkpoint
                raise ServiceError("checkpoint-failed", f"{type(exc).__name__}: {exc}") from None
            raise
        r.trajectory, r.incarnation = req.trajectory, incarnation
        cp.save(sb)
    finally:
        sb.fifo.release()
    await cp.publish(
        subjects.event("checkpoint_ready", req.trajectory),
        CheckpointReady(
            trajectory=req.trajectory, sandbox=r.sandbox, host_id=cp.config.host_id, checkpoint_id=checkpoint_id,
            incarnation=incarnation, k=req.k, context_digest=result.context_digest,
            bytes_written=result.bytes_written, freeze_s=result.freeze_s, total_s=result.total_s,
        ),
    )  # fmt: skip
    if cp.objects is not None:
        folder = cp.store.trajectory_dir(req.trajectory) / checkpoint_id
        cp.spawn(f"upload {checkpoint_id}", objects.upload(cp.objects, folder, req.trajectory))
    try:
        await asyncio.to_thread(collect_garbage, cp)
    except Exception:  # the checkpoint is ready; a GC failure must not say otherwise
        log.exception("garbage collection after %s failed", result.checkpoint_id)
    return result


async def _checkpoint_phases(
    cp: Checkpointer, sb: Sandbox, req: SandboxCheckpoint, incarnation: int, checkpoint_id: str,
    staging: Path, abandoned: asyncio.Event, started: float,
) -> CheckpointResult:  # fmt: skip
    r = sb.record
    context = Context(tokens=list(req.context_tokens), ref=req.context_ref)
    (staging / CONTEXT).write_bytes(msgspec.json.encode(context))
    write_trajectory_spec(cp, req.trajectory, r)
    try:
        upper = Path((await cp.engine.inspect(r.container_id))["GraphDriver"]["Data"]["UpperDir"])
    except (aiodocker.DockerError, KeyError) as exc:
        raise await cp.env_failure(sb, EnvironmentFailure("daemon-error", f"inspect failed: {exc}")) from None
    await phase(cp, "freeze")
    frozen_at = time.monotonic()
    try:
        await cp.engine.pause(r.container_id)
    except aiodocker.DockerError as exc:
        failure, _ = await cp.engine.health(r.container_id, r.oom_seen)
        if failure is not None:
            raise await cp.env_failure(sb, failure) from None
        raise ServiceError("checkpoint-failed", f"freeze: {exc.message}") from None
    dump_s = 0.0
    try:
        await phase(cp, "archive")
        await asyncio.to_thread(layer.archive, upper, staging / LAYER)
        await phase(cp, "dump")
        dump_started = time.monotonic()
        await cp.engine.checkpoint(r.container_id, staging / CRIU)
        dump_s = time.monotonic() - dump_started
    except (OSError, aiodocker.DockerError) as exc:
        raise ServiceError("checkpoint-failed", f"{type(exc).__name__}: {exc}") from None
    finally:
        await phase(cp, "unfreeze")
        try:
            await cp.engine.unpause(r.container_id)
        except aiodocker.DockerError as exc:
            failure, _ = await cp.engine.health(r.container_id, r.oom_seen)
            raise await cp.env_failure(
                sb, failure or EnvironmentFailure("daemon-error", exc.message)
            ) from None
    freeze_s = time.monotonic() - frozen_at
    await phase(cp, "seal")
    fields = dict(
        checkpoint_id=checkpoint_id, trajectory=req.trajectory, sandbox=r.sandbox, host_id=cp.config.host_id,
        incarnation=incarnation, k=req.k, spec=r.spec, image_id=r.image_id, criu_name=CRIU_NAME,
        context_digest=digest(context), context_len=len(context.tokens), freeze_s=freeze_s, dump_s=dump_s,
    )  # fmt: skip
    try:
        manifest: Manifest = await asyncio.to_thread(cp.store.seal, staging, fields)
    except OSError as exc:
        raise ServiceError("checkpoint-failed", f"seal: {exc}") from None
    if abandoned.is_set():
        raise ServiceError("timeout", "the caller gave up on this checkpoint; discarded")
    await phase(cp, "publish")
    path = await asyncio.to_thread(cp.store.publish, staging, manifest)
    await phase(cp, "advance")
    new = PrefixPointer(
        trajectory=req.trajectory, host_id=cp.config.host_id, sandbox=r.sandbox, checkpoint_id=checkpoint_id,
        incarnation=incarnation, k=req.k, context_digest=manifest.context_digest, context_len=manifest.context_len,
    )  # fmt: skip
    try:
        moved, now = await pointer.advance(cp.kv, new)
    except Exception as exc:  # the update may have landed even though its answer was lost: look
        now = None
        with contextlib.suppress(Exception):
            now, _ = await pointer.read(cp.kv, req.trajectory)
        if now is None or now.checkpoint_id != checkpoint_id:
            await asyncio.to_thread(cp.store.remove, path)
            raise ServiceError("checkpoint-failed", f"pointer not advanced: {exc}") from None
        moved = True
    if not moved:
        await asyncio.to_thread(cp.store.remove, path)
        raise ServiceError("stale", f"pointer moved to {now and pointer.order(now)} meanwhile")
    return CheckpointResult(
        trajectory=req.trajectory, sandbox=r.sandbox, checkpoint_id=checkpoint_id, incarnation=incarnation,
        k=req.k, context_digest=manifest.context_digest, bytes_written=manifest.bytes, freeze_s=freeze_s,
        total_s=time.monotonic() - started,
    )  # fmt: skip


def write_trajectory_spec(cp: Checkpointer, trajectory: str, record: SandboxRecord) -> None:
    """What a restore from the base image needs even when every checkpoint is unusable."""
    folder = cp.store.trajectory_dir(trajectory)
    folder.mkdir(parents=True, exist_ok=True)
    base = msgspec.structs.replace(
        record, container_id="", step=0, state="running", trajectory="", incarnation=-1, oom_seen=0
    )
    tmp = folder / "trajectory.json.part"
    tmp.write_bytes(msgspec.json.encode(base))
    tmp.replace(folder / "trajectory.json")


def collect_garbage(cp: Checkpointer) -> None:
    budget = int(cp.config.disk_budget_gb * (1 << 30))
    keep = {s[0].path for t in cp.store.trajectories() if (s := cp.store.ready(t))}
    for path in cp.store.enforce_budget(budget, keep):
        log.info("disk budget: removed checkpoint %s", path.name)


# ---------------------------------------------------------------- full_restore


async def full_restore(cp: Checkpointer, sb: Sandbox, current: PrefixPointer) -> RestoreResult:
    started = time.monotonic()
    async with sb.fifo:
        rejected: list[str] = []
        chosen: tuple[Manifest, Context] | None = None
        for stored in candidates(cp, current):
            try:
                chosen = await restore_from(cp, sb, stored)
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
                await asyncio.to_thread(cp.store.remove, stored)
        if chosen is None:  # the base image, from the start
            sb.record.container_id = await cp.fresh_container(sb, sb.record.image_id)
            await cp.engine.start(sb.record.container_id)
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
        if source != "latest" or current.host_id != cp.config.host_id:  # fell back, or moved here
            new = msgspec.structs.replace(
                current, incarnation=incarnation, k=k, checkpoint_id=checkpoint_id, host_id=cp.config.host_id,
                context_digest=digest(context), context_len=len(context.tokens),
            )  # fmt: skip
            moved, now = await pointer.advance(cp.kv, new)
            if not moved:
                raise ServiceError(
                    "stale", f"pointer moved to {now and pointer.order(now)} during the restore"
                )
        r = sb.record
        r.state, r.step, r.trajectory, r.incarnation = "running", k, current.trajectory, incarnation
        cp.save(sb)
    elapsed = time.monotonic() - started
    await cp.publish(
        subjects.event("sandbox_restored", current.trajectory),
        SandboxRestored(
            trajectory=current.trajectory, sandbox=r.sandbox, host_id=cp.config.host_id, source=source,
            checkpoint_id=checkpoint_id, incarnation=incarnation, k=k, rejected=rejected, restore_s=elapsed,
        ),
    )  # fmt: skip
    return RestoreResult(
        trajectory=current.trajectory, sandbox=r.sandbox, container_id=r.container_id, source=source,
        checkpoint_id=checkpoint_id, incarnation=incarnation, k=k, context_tokens=context.tokens,
        context_ref=context.ref, context_digest=digest(context), rejected=rejected, restore_s=elapsed,
    )  # fmt: skip


def candidates(cp: Checkpointer, current: PrefixPointer) -> list[Path]:
    """The pointed-at checkpoint first, then older ready ones, newest first."""
    ready = cp.store.ready(current.trajectory)
    head = [s.path for s in ready if s.path.name == current.checkpoint_id]
    older = [
        s.path
        for s in ready
        if s.path.name != current.checkpoint_id and s.manifest.order < pointer.order(current)
    ]
    return head + older


async def restore_from(cp: Checkpointer, sb: Sandbox, path: Path) -> tuple[Manifest, Context]:
    """Verify, recreate, install the layer and the CRIU images, start from the checkpoint."""
    manifest = await asyncio.to_thread(cp.store.verify, path)
    context = cp.store.context(path)
    entries = await asyncio.to_thread(layer.check, path / LAYER, int(cp.config.max_layer_gb * (1 << 30)))
    try:
        await cp.engine.docker.images.inspect(manifest.image_id)
    except aiodocker.DockerError as exc:  # not the artifact's fault: stop, keep it, say what is missing
        raise ServiceError(
            "no-image",
            f"image {manifest.spec.image} ({manifest.image_id[:19]}) is not on this host: {exc.message}",
        ) from None
    sb.record.spec = manifest.spec
    container_id = await cp.fresh_container(sb, manifest.image_id)
    try:
        upper = Path((await cp.engine.inspect(container_id))["GraphDriver"]["Data"]["UpperDir"])
        await asyncio.to_thread(layer.install, path / LAYER, entries, upper)
        target = cp.engine.container_dir(container_id) / "checkpoints" / CRIU_NAME
        await asyncio.to_thread(shutil.copytree, path / CRIU, target, copy_function=link_or_copy)
        await cp.engine.start(container_id, checkpoint=CRIU_NAME)
        state = (await cp.engine.inspect(container_id))["State"]
        if state.get("Paused"):
            await cp.engine.unpause(container_id)
        failure, sb.record.oom_seen = await cp.engine.health(container_id, 0)
        if failure is not None:
            raise failure
    except BaseException:
        with contextlib.suppress(Exception):
            await cp.engine.remove(container_id)
        sb.record.container_id = ""
        raise
    return manifest, context


def link_or_copy(src: str, dst: str) -> None:
    """CRIU images are only read by the engine: a hardlink saves copying them (same filesystem)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
