"""What a checkpoint and a restore use of the Docker host they run on (a Host, built once by the
checkpointer), and the container a sandbox runs in: made fresh from an image with the record's
settings, under the user the image names."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import aiodocker
import msgspec
from nats.js.kv import KeyValue

from belayer_rl.services.checkpointer.records import SandboxRecord
from belayer_rl.services.checkpointer.sandbox import (
    DockerEngine,
    ImageInspect,
    SandboxPolicy,
    is_root,
    numeric_user,
    with_user,
)
from belayer_rl.services.checkpointer.store import (
    Store,
)
from belayer_rl.shared.bus import ServiceError

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
    debug_older_environment: bool = False  # the training oracle's mutation: E_{k-1} restored with L_k
    # Checkpoint id -> restores of it that failed in a row for no proven reason (see full_restore).
    failed_restores: dict[str, tuple[int, float]] = field(default_factory=dict)  # (failures, first at)


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
