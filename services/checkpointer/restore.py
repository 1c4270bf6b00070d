"""The restore procedure, on a sandbox record whose FIFO the caller holds (checkpointer.py queues
it and saves the record).

The pointed-at checkpoint, else older ready ones, newest first, else the base image. Each
candidate is verified against its manifest and its layer checked before anything is created; a
rejected one is named in the result and deleted, unless its only fault is a MAC this host cannot
match (another key). One whose restores keep failing for no proven reason is quarantined, not
deleted (Store.quarantine): a fault of the host looks the same. Falling back starts a new
incarnation. It raises EnvironmentFailure for a sandbox whose environment failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import aiodocker
import msgspec

from belayer_rl.services.checkpointer import layer, pointer
from belayer_rl.services.checkpointer.host import CRIU_NAME, Host, fresh_container
from belayer_rl.services.checkpointer.records import SandboxRecord
from belayer_rl.services.checkpointer.sandbox import (
    EnvironmentFailure,
    host_trouble,
)
from belayer_rl.services.checkpointer.store import (
    CRIU,
    LAYER,
    Context,
    CorruptCheckpoint,
    Manifest,
    Store,
    Unauthenticated,
)
from belayer_rl.services.checkpointer.store import digest_context as digest
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    PrefixPointer,
    RestoreResult,
    RestoreSource,
)

log = logging.getLogger("belayer.checkpointer")

# A checkpoint whose restores fail for no proven reason is rejected once they failed this many
# times in a row over at least this long: a burst of failures within seconds (the host busy
# with something else) condemns nothing.
RESTORE_TRIES, RESTORE_REJECT_AFTER_S = 3, 30.0


async def full_restore(host: Host, r: SandboxRecord, current: PrefixPointer, started: float) -> RestoreResult:
    """Called with the sandbox's FIFO held (`started`: when the restore was asked for). On success
    the record runs the restored container at the result's step, incarnation and trajectory."""
    rejected: list[str] = []
    chosen: tuple[Manifest, Context] | None = None
    ordered = candidates(host.store, current)
    for index, stored in enumerate(ordered):
        try:
            chosen = await restore_from(host, r, stored)
            if host.debug_older_environment:
                await older_environment(host, r, ordered[index + 1 :])
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


async def older_environment(host: Host, r: SandboxRecord, older: list[Path]) -> None:
    """The mutation a debug flag makes (never in use): the sandbox just restored from checkpoint k
    runs the environment of the one before it (or the base image's) instead, while the restore
    still answers with checkpoint k's step and context (a new container replaces the restored one)."""
    if older:
        await restore_from(host, r, older[0])
        return
    await fresh_container(host, r, await host.engine.inspect_image(r.image_id))
    await host.engine.start(r.container_id)


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
