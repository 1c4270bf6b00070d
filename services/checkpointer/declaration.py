"""The checkpointer, declared (shared/declaration.py): one per Docker host, answering as
checkpointer.<host>; every host's shares one credential. It owns the host's sandbox containers,
their checkpoints, the prefix pointers and the checkpoint objects. Root-equivalent on its host: it
drives the Docker socket and CRIU."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import CheckpointerConfig
from belayer_rl.shared.declaration import (
    STREAM_NAMES,
    Listen,
    Scope,
    Service,
    event,
    kv_put,
    kv_stream,
    object_put,
    object_stream,
    on_event,
)

SANDBOX_REPLY = p.SandboxInfo | p.ExecResult | p.CheckpointResult | p.RestoreResult | p.SandboxListing | p.Ack

CHECKPOINTER = Service(
    name="checkpointer",
    summary="Run the checkpointer of one Docker host.",
    runs="host",
    config=CheckpointerConfig,
    setup="belayer_rl.services.checkpointer.service:setup",
    listens={
        # `sandbox.<host>.<verb>.<client>` through one subscription, so requests are seen in the
        # order they were sent; each runs as its own task and takes its place in its sandbox's FIFO.
        "sandbox": Listen(
            lambda s, x: s.sandbox_rpc_all(x.host),
            p.SandboxRequest,
            SANDBOX_REPLY,
            concurrent=True,
            with_subject=True,
        ),
        "trajectory_ended": on_event("trajectory_ended"),
    },
    publishes=(
        event("env_failure"),
        event("checkpoint_ready"),
        event("sandbox_restored"),
        event("record_skipped"),
        event("trajectory_ended"),
        lambda s, x: kv_put(s.prefix_pointer_bucket),
        lambda s, x: object_put(s.checkpoint_object_bucket),
        # nats-py's object store looks its stream up by subject when it reads a checkpoint back
        # (get, list): the stream names, nothing more.
        lambda s, x: STREAM_NAMES,
    ),
    owns=(lambda s: kv_stream(s.prefix_pointer_bucket), lambda s: object_stream(s.checkpoint_object_bucket)),
    scopes=lambda config: (Scope(host=config.host_id),),
    process=lambda x: f"checkpointer-{x.host}",
    stats=lambda x: f"checkpointer.{x.host}",
)
