"""The checkpoint procedure, on a sandbox record whose FIFO the caller holds (checkpointer.py queues
it, bounds it by its timeout, saves the record and announces the result).

The checks first: the sandbox runs, its last action ended, the step and trajectory are the ones
asked for and the pointer is behind. Then the phases: freeze (docker pause) -> archive the
writable layer -> CRIU dump, leaving the processes running -> unfreeze -> seal (checksums, signed
manifest, fsync) -> publish (rename) -> advance (pointer compare-and-set). A failure or crash
before "publish" leaves the previous pointer in effect; a folder published whose pointer update was
lost is whole, and the checkpointer adopts it when it starts (checkpointer.py, rebuild_pointer).
It raises EnvironmentFailure for a sandbox whose environment failed."""

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

import aiodocker
import msgspec

from belayer_rl.services.checkpointer import layer, pointer
from belayer_rl.services.checkpointer.host import CRIU_NAME, Host
from belayer_rl.services.checkpointer.records import SandboxRecord
from belayer_rl.services.checkpointer.sandbox import (
    EnvironmentFailure,
)
from belayer_rl.services.checkpointer.store import (
    CONTEXT,
    CRIU,
    LAYER,
    TRAJECTORY,
    Context,
    Manifest,
    Store,
)
from belayer_rl.services.checkpointer.store import digest_context as digest
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    CheckpointResult,
    PrefixPointer,
    SandboxCheckpoint,
)

log = logging.getLogger("belayer.checkpointer")


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
