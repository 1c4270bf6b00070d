"""full_checkpoint and full_restore: the phases, on a sandbox record whose FIFO the caller holds.

Checkpoint: freeze (docker pause) -> archive the writable layer -> CRIU dump, leaving the processes
running -> unfreeze -> seal (checksums, signed manifest, fsync) -> publish (rename) -> advance
(pointer compare-and-set). A failure or crash before "publish" leaves the previous pointer in
effect; a folder published whose pointer update was lost is whole, and the checkpointer adopts it
when it starts (checkpointer.py, rebuild_pointer).

Restore: the pointed-at checkpoint, else older ready ones, newest first, else the base image. Each
candidate is verified against its manifest and its layer checked before anything is created; a
rejected one is named in the result and deleted, unless its only fault is a MAC this host cannot
match (another key). One whose restores keep failing for no proven reason is quarantined, not
deleted (Store.quarantine): a fault of the host looks the same. Falling back starts a new
incarnation.

The phases get the host's parts they use (a Host) and the sandbox's record, which they update as
they go; they raise EnvironmentFailure for a sandbox whose environment failed. Saving the record,
events, uploads and garbage collection are the caller's, once a phase has returned.
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

import aiodocker
import msgspec
from nats.js.kv import KeyValue

from belayer_rl.services.checkpointer import layer, pointer
from belayer_rl.services.checkpointer.records import SandboxRecord
from belayer_rl.services.checkpointer.sandbox import (
    DockerEngine,
    EnvironmentFailure,
    ImageInspect,
    SandboxPolicy,
    host_trouble,
    is_root,
    numeric_user,
    with_user,
)
from belayer_rl.services.checkpointer.store import (
    CONTEXT,
    CRIU,
    LAYER,
    TRAJECTORY,
    Context,
    CorruptCheckpoint,
    Manifest,
    Store,
    Unauthenticated,
)
from belayer_rl.services.checkpointer.store import digest_context as digest
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    CheckpointResult,
    PrefixPointer,
    RestoreResult,
    RestoreSource,
    SandboxCheckpoint,
)

log = logging.getLogger("belayer.checkpointer")

CRIU_NAME = "criu"  # the checkpoint name under which the engine restores


@dataclass(frozen=True, kw_only=True)
class Host:
    """What the phases use of the Docker host they run on; built once by the checkpointer."""

    host_id: str
    engine: DockerEngine
    store: Store
    kv: KeyValue  # the prefix pointers
    max_layer_bytes: int  # a layer archive holding more is refused at restore
    policy: SandboxPolicy  # what a sandbox may ask for here
    crash_at: str = ""  # chaos testing: SIGKILL this process when a checkpoint reaches this phase
    # Checkpoint id -> restores of it that failed in a row for no proven reason (see full_restore).
    failed_restores: dict[str, tuple[int, float]] = field(default_factory=dict)  # (failures, first at)


# A checkpoint whose restores fail for no proven reason is rejected once they failed this many
# times in a row over at least this long: a burst of failures within seconds (the host busy
# with something else) condemns nothing.
RESTORE_TRIES, RESTORE_REJECT_AFTER_S = 3, 30.0


async def fresh_container(host: Host, record: SandboxRecord, image: ImageInspect) -> str:
    """Replace the sandbox's container, if any, with a new one from `image` with the record's
    settings, unless this host's policy refuses them (ServiceError "not-allowed").

    A spec that names no user gets the image's unprivileged USER, written into the record: every
    later checkpoint names it, and a checkpoint made before specs did (its spec names none) still
    runs its actions as the image's author chose, not as the root init. The user is then pinned to
    its numbers in the image's own /etc/passwd, so that a name mapped to uid 0 there is refused as
    root is, and no action can change whom later actions run as."""
    if not record.spec.user and image.user and not is_root(image.user):
        try:
            record.spec = with_user(record.spec, image.user)
        except msgspec.ValidationError:
            raise ServiceError(
                "not-allowed",
                f"sandbox {record.sandbox}: the image's USER {image.user!r} is no user a spec may name;"
                " name one in the spec's `user`",
            ) from None
    if why := host.policy.refusal(record.spec) or host.policy.user_refusal(record.spec.user):
        raise ServiceError("not-allowed", f"sandbox {record.sandbox}: {why}")
    spec = msgspec.structs.replace(record.spec, image=image.id)
    record.container_id = await host.engine.recreate(record.container_id, spec, host.host_id, record.sandbox)
    record.oom_seen = 0
    try:
        user = await pinned_user(host, record)
        why = host.policy.user_refusal(user)
    except ValueError as exc:
        why = str(exc)
    if why:
        with contextlib.suppress(aiodocker.DockerError):
            await host.engine.remove(record.container_id)
        record.container_id = ""
        raise ServiceError("not-allowed", f"sandbox {record.sandbox}: {why}")
    record.spec = with_user(record.spec, user)
    return record.container_id


async def pinned_user(host: Host, record: SandboxRecord) -> str:
    """The record's user as numbers, read from its new container's /etc/passwd and /etc/group."""
    name, _, group = record.spec.user.partition(":")
    if not name:  # the container's default: root, which the policy has allowed
        return ""
    if name.isdigit() and group.isdigit():
        return numeric_user(record.spec.user, None, None)
    passwd = await host.engine.small_file(record.container_id, "/etc/passwd")
    groups = await host.engine.small_file(record.container_id, "/etc/group") if group else None
    return numeric_user(record.spec.user, passwd, groups)


# ---------------------------------------------------------------- full_checkpoint


async def phase(host: Host, name: str) -> None:
    if host.crash_at == name:
        log.warning("chaos: killing the checkpointer at phase %s", name)
        os.kill(os.getpid(), signal.SIGKILL)
        await asyncio.sleep(10)


async def full_checkpoint(
    host: Host, r: SandboxRecord, req: SandboxCheckpoint, abandoned: asyncio.Event
) -> CheckpointResult:
    """Called with the sandbox's FIFO held. Raises ServiceError, or EnvironmentFailure for the caller
    to record and announce. On success the record is bound to the trajectory, for the caller to save."""
    if r.state != "running":
        raise ServiceError(
            "env-failure", f"sandbox {r.sandbox} is {r.state}" + (f" ({r.failure})" if r.failure else "")
        )
    if r.acting:  # an action without an outcome: the file system may hold step k + 1's effects
        raise EnvironmentFailure.interrupted(r.step)
    if req.k != r.step:
        raise ServiceError(
            "wrong-step", f"checkpoint k={req.k} refused: the last completed action is {r.step}"
        )
    if r.trajectory and r.trajectory != req.trajectory:
        raise ServiceError("wrong-trajectory", f"sandbox {r.sandbox} belongs to trajectory {r.trajectory}")
    current, _ = await pointer.read(host.kv, req.trajectory)
    if current is not None and current.owner not in ("", r.owner):  # the caller owns r (check_client)
        raise ServiceError("not-allowed", f"trajectory {req.trajectory} is another client's")
    if (
        not r.trajectory
        and current is not None
        and (current.host_id, current.sandbox) != (host.host_id, r.sandbox)
    ):
        # Only the trajectory's own sandbox may carry it on (re-created under its name after a
        # restart from the base image): another would start a new incarnation past its progress.
        raise ServiceError(
            "wrong-trajectory",
            f"trajectory {req.trajectory} belongs to sandbox {current.sandbox} on host {current.host_id}",
        )
    incarnation = r.incarnation if r.trajectory else (current.incarnation + 1 if current else 0)
    if current is not None and (incarnation, req.k) <= pointer.order(current):
        raise ServiceError(
            "stale", f"pointer is at {pointer.order(current)}, not behind ({incarnation}, {req.k})"
        )
    started = time.monotonic()
    checkpoint_id = f"i{incarnation}-k{req.k}-{secrets.token_hex(4)}"
    staging = host.store.staging(req.trajectory, checkpoint_id)
    try:
        result = await _checkpoint_phases(
            host, r, req, incarnation, checkpoint_id, staging, abandoned, started
        )
    except BaseException as exc:
        await asyncio.to_thread(shutil.rmtree, staging, True)
        if isinstance(exc, OSError):  # a full disk, say, while writing the checkpoint
            raise ServiceError("checkpoint-failed", f"{type(exc).__name__}: {exc}") from None
        raise
    r.trajectory, r.incarnation = req.trajectory, incarnation
    return result


def unrestorable(strays: list[str]) -> str:
    return (
        f"processes {', '.join(strays)} were started by an action after the sandbox was restored: "
        "they live outside its time namespace, and CRIU could not restore them; end them before "
        "checkpointing (the previous checkpoint stays the latest)"
    )


async def _checkpoint_phases(
    host: Host, r: SandboxRecord, req: SandboxCheckpoint, incarnation: int, checkpoint_id: str,
    staging: Path, abandoned: asyncio.Event, started: float,
) -> CheckpointResult:  # fmt: skip
    context = Context(tokens=list(req.context_tokens), ref=req.context_ref)
    (staging / CONTEXT).write_bytes(msgspec.json.encode(context))
    write_trajectory_spec(host.store, req.trajectory, r)
    try:
        upper = await host.engine.upper_dir(r.container_id)
        init_pid = (await host.engine.state(r.container_id)).pid
    except (aiodocker.DockerError, msgspec.ValidationError) as exc:
        raise EnvironmentFailure("daemon-error", f"inspect failed: {exc}") from None
    if strays := await host.engine.strays(init_pid):
        raise ServiceError("checkpoint-failed", unrestorable(strays))
    await phase(host, "freeze")
    frozen_at = time.monotonic()
    try:
        await host.engine.pause(r.container_id)
    except aiodocker.DockerError as exc:
        failure, _ = await host.engine.health(r.container_id, r.oom_seen)
        if failure is not None:
            raise failure from None
        raise ServiceError("checkpoint-failed", f"freeze: {exc.message}") from None
    dump_s = 0.0
    dump_failure: EnvironmentFailure | None = None  # the dump's own, which says more than the unfreeze's
    try:
        # Again, frozen: an exec that began since the first look (a health check) is in the dump.
        if strays := await host.engine.strays(init_pid, grace_s=0.0):
            raise ServiceError("checkpoint-failed", unrestorable(strays))
        await phase(host, "archive")
        await asyncio.to_thread(layer.archive, upper, staging / LAYER)
        await phase(host, "dump")
        dump_started = time.monotonic()
        await host.engine.checkpoint(r.container_id, staging / CRIU)
        dump_s = time.monotonic() - dump_started
    except (OSError, aiodocker.DockerError) as exc:
        raise ServiceError("checkpoint-failed", f"{type(exc).__name__}: {exc}") from None
    except EnvironmentFailure as exc:  # a stuck dump, killed: Docker may then refuse the unfreeze
        dump_failure = exc
        raise
    finally:
        await phase(host, "unfreeze")
        try:
            await host.engine.unpause(r.container_id)
        except aiodocker.DockerError as exc:
            failure, _ = await host.engine.health(r.container_id, r.oom_seen)
            raise (dump_failure or failure or EnvironmentFailure("daemon-error", exc.message)) from None
    freeze_s = time.monotonic() - frozen_at
    await phase(host, "seal")
    draft = Manifest(
        checkpoint_id=checkpoint_id, trajectory=req.trajectory, sandbox=r.sandbox, host_id=host.host_id,
        incarnation=incarnation, k=req.k, spec=r.spec, image_id=r.image_id, criu_name=CRIU_NAME,
        context_digest=digest(context), context_len=len(context.tokens), freeze_s=freeze_s, dump_s=dump_s,
        created_at=0.0, files=[], owner=r.owner,  # files: filled in by seal
    )  # fmt: skip
    try:
        manifest = await asyncio.to_thread(host.store.seal, staging, draft)
    except OSError as exc:
        raise ServiceError("checkpoint-failed", f"seal: {exc}") from None
    if abandoned.is_set():
        raise ServiceError("timeout", "the caller gave up on this checkpoint; discarded")
    await phase(host, "publish")
    path = await asyncio.to_thread(host.store.publish, staging, manifest)
    await phase(host, "advance")
    new = PrefixPointer(
        trajectory=req.trajectory, host_id=host.host_id, sandbox=r.sandbox, checkpoint_id=checkpoint_id,
        incarnation=incarnation, k=req.k, context_digest=manifest.context_digest,
        context_len=manifest.context_len, owner=r.owner,
    )  # fmt: skip
    try:
        moved, now = await pointer.advance(host.kv, new)
    except Exception as exc:  # the update may have landed even though its answer was lost: look
        now = None
        with contextlib.suppress(Exception):
            now, _ = await pointer.read(host.kv, req.trajectory)
        if now is None or now.checkpoint_id != checkpoint_id:
            await asyncio.to_thread(host.store.remove, path)
            raise ServiceError("checkpoint-failed", f"pointer not advanced: {exc}") from None
        moved = True
    if not moved and now is not None and now.checkpoint_id == checkpoint_id:
        moved = True  # a restart's or a restore's rebuild adopted this very checkpoint meanwhile
    if not moved:
        await asyncio.to_thread(host.store.remove, path)
        if pointer.conflict(new, now):
            assert now is not None
            raise ServiceError(
                "conflict", f"checkpoint {pointer.order(new)} of {req.trajectory} was taken first by host"
                f" {now.host_id} ({now.checkpoint_id}); this one is discarded",
            )  # fmt: skip
        raise ServiceError("stale", f"pointer moved to {now and pointer.order(now)} meanwhile")
    return CheckpointResult(
        trajectory=req.trajectory, sandbox=r.sandbox, checkpoint_id=checkpoint_id, incarnation=incarnation,
        k=req.k, context_digest=manifest.context_digest, bytes_written=manifest.bytes, freeze_s=freeze_s,
        total_s=time.monotonic() - started,
    )  # fmt: skip


def write_trajectory_spec(store: Store, trajectory: str, record: SandboxRecord) -> None:
    """What a restore from the base image needs even when every checkpoint is unusable; signed,
    since it names the image and settings of a container this host would create."""
    folder = store.trajectory_dir(trajectory)
    folder.mkdir(parents=True, exist_ok=True)
    base = msgspec.structs.replace(
        record,
        container_id="",
        step=0,
        state="running",
        trajectory="",
        incarnation=-1,
        oom_seen=0,
        acting=False,
        failure="",
    )
    store.write_signed(folder / TRAJECTORY, msgspec.json.encode(base))


# ---------------------------------------------------------------- full_restore


async def full_restore(host: Host, r: SandboxRecord, current: PrefixPointer, started: float) -> RestoreResult:
    """Called with the sandbox's FIFO held (`started`: when the restore was asked for). On success
    the record runs the restored container at the result's step, incarnation and trajectory."""
    rejected: list[str] = []
    chosen: tuple[Manifest, Context] | None = None
    for stored in candidates(host.store, current):
        try:
            chosen = await restore_from(host, r, stored)
            break
        except (CorruptCheckpoint, layer.HostileLayer) as exc:  # its content is proven bad: garbage
            reason = f"{stored.name}: {type(exc).__name__}: {exc}"
            log.warning("restore of %s: rejected %s", current.trajectory, reason)
            rejected.append(reason)
            if not isinstance(exc, Unauthenticated):  # another host's key, perhaps: not garbage
                await asyncio.to_thread(host.store.remove, stored)
        except (EnvironmentFailure, aiodocker.DockerError, OSError) as exc:
            # Nothing proves the checkpoint bad (a daemon shutting down answers errors like these):
            # keep it, and fail this restore rather than fall back past acknowledged work. Only
            # when it fails every time, for a while, is it taken as bad, and an older one tried.
            if (trouble := host_trouble(exc)) is not None:
                raise trouble from None
            failures, first_at = host.failed_restores.get(stored.name, (0, time.monotonic()))
            failures += 1
            reason = f"{stored.name}: {type(exc).__name__}: {exc}"
            if failures < RESTORE_TRIES or time.monotonic() - first_at < RESTORE_REJECT_AFTER_S:
                host.failed_restores[stored.name] = (failures, first_at)
                raise ServiceError(
                    "restore-failed", f"{reason} (failure {failures}; the checkpoint is kept)"
                ) from None
            host.failed_restores.pop(stored.name, None)
            aside = await asyncio.to_thread(host.store.quarantine, stored)
            log.warning(
                "restore of %s: %s failed %d times; quarantined as %s",
                current.trajectory,
                reason,
                failures,
                aside,
            )
            rejected.append(f"{reason} ({failures} times; quarantined, not deleted)")
    if chosen is not None:
        host.failed_restores.pop(chosen[0].checkpoint_id, None)
    if chosen is None:  # the base image, from the start
        try:
            await fresh_container(host, r, await host.engine.inspect_image(r.image_id))
            await host.engine.start(r.container_id)
        except aiodocker.DockerError as exc:
            raise host_trouble(exc) or ServiceError("create-failed", f"base image: {exc.message}") from None
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
    # Falling back, or moving the trajectory to this host, starts a new incarnation: whatever the
    # old one does next (a host that comes back, a dead branch) orders below what this one does.
    stays = source == "latest" and current.host_id == host.host_id
    incarnation = current.incarnation if stays else current.incarnation + 1
    k = manifest.k if manifest is not None else 0
    checkpoint_id = manifest.checkpoint_id if manifest is not None else ""
    if not stays:
        new = msgspec.structs.replace(
            current, incarnation=incarnation, k=k, checkpoint_id=checkpoint_id, host_id=host.host_id,
            context_digest=digest(context), context_len=len(context.tokens),
        )  # fmt: skip
        moved, now = await pointer.advance(host.kv, new)
        if not moved:
            raise ServiceError("stale", f"pointer moved to {now and pointer.order(now)} during the restore")
    r.state, r.step, r.trajectory, r.incarnation = "running", k, current.trajectory, incarnation
    r.acting, r.failure = False, ""
    return RestoreResult(
        trajectory=current.trajectory, sandbox=r.sandbox, container_id=r.container_id, source=source,
        checkpoint_id=checkpoint_id, incarnation=incarnation, k=k, context_tokens=context.tokens,
        context_ref=context.ref, context_digest=digest(context), rejected=rejected,
        restore_s=time.monotonic() - started,
    )  # fmt: skip


def candidates(store: Store, current: PrefixPointer) -> list[Path]:
    """The pointed-at checkpoint first, then older ready ones, newest first."""
    ready = store.ready(current.trajectory)
    head = [s.path for s in ready if s.path.name == current.checkpoint_id]
    older = [
        s.path
        for s in ready
        if s.path.name != current.checkpoint_id and s.manifest.order < pointer.order(current)
    ]
    return head + older


async def restore_from(host: Host, r: SandboxRecord, path: Path) -> tuple[Manifest, Context]:
    """Verify, recreate, install the layer and the CRIU images, start from the checkpoint."""
    manifest = await asyncio.to_thread(host.store.verify, path)
    context = host.store.context(path)
    entries = await asyncio.to_thread(layer.check, path / LAYER, host.max_layer_bytes)
    try:
        image = await host.engine.inspect_image(manifest.image_id)
    except aiodocker.DockerError as exc:  # not the artifact's fault: stop, keep it, say what is missing
        if (trouble := host_trouble(exc)) is not None:
            raise trouble from None
        raise ServiceError(
            "no-image",
            f"image {manifest.spec.image} ({manifest.image_id[:19]}) is not on this host: {exc.message}",
        ) from None
    r.spec = manifest.spec
    container_id = await fresh_container(host, r, image)
    try:
        upper = await host.engine.upper_dir(container_id)
        await asyncio.to_thread(layer.install, path / LAYER, entries, upper)
        target = host.engine.container_dir(container_id) / "checkpoints" / CRIU_NAME
        await asyncio.to_thread(shutil.copytree, path / CRIU, target, copy_function=link_or_copy)
        await host.engine.start(container_id, checkpoint=CRIU_NAME)
        if (await host.engine.state(container_id)).paused:
            await host.engine.unpause(container_id)
        failure, r.oom_seen = await host.engine.health(container_id, 0)
        if failure is not None:
            raise failure
    except BaseException:
        with contextlib.suppress(Exception):
            await host.engine.remove(container_id)
        r.container_id = ""
        raise
    return manifest, context


def link_or_copy(src: str, dst: str) -> None:
    """CRIU images are only read by the engine: a hardlink saves copying them (same filesystem)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
