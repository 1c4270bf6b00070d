"""The checkpointer, declared (shared/declaration.py): one per Docker host, answering as
checkpointer.<host>; every host's shares one credential. It owns the host's sandbox containers,
their checkpoints, the prefix pointers and the checkpoint objects. Root-equivalent on its host: it
drives the Docker socket and CRIU."""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import CheckpointerConfig
from belayer_rl.shared.declaration import (
    STREAM_NAMES,
    Compose,
    Deployment,
    Listen,
    Planned,
    Scope,
    Service,
    Variable,
    event,
    kv_put,
    kv_stream,
    object_put,
    object_stream,
    on_event,
)
from belayer_rl.shared.roles import CHECKPOINT_KEY_FILE

# Its store under Compose: the volume `checkpoints`, at its path inside the Docker engine's data root.
STORE = "$BELAYER_DOCKER_ROOT/volumes/${COMPOSE_PROJECT_NAME}_checkpoints/_data"


def up(cluster: Deployment) -> list[Planned]:
    """This host's checkpointer, when sandboxes are wanted and a Docker engine answers. It signs with
    the cluster's shared key where its credentials have one (an older `belayer creds` made none),
    else with a key of its own, made in its state folder."""
    if not cluster.sandboxes:
        return []
    shared = cluster.creds_dir / CHECKPOINT_KEY_FILE if cluster.creds_dir is not None else None
    mine = {
        "state_dir": cluster.state_dir / "checkpointer",
        "checkpoint_key": shared if shared is not None and shared.exists() else None,
    }
    settings = cluster.settings(CheckpointerConfig, "checkpointer") | mine
    return [Planned("checkpointer", CheckpointerConfig(**settings))]


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
    compose=Compose(
        uid=0,
        note="""Runs sandbox containers on this host's Docker engine and checkpoints them. ROOT-EQUIVALENT ON
THE HOST: whoever controls it controls the Docker socket. It gets what it reads and writes and
nothing else: the socket; the engine's data root at the same path (writable layers, and the
containers/<id>/checkpoints folders restores fill); the host's pid namespace (/proc of the
sandboxes' processes, read-only) and cgroups (their OOM counters and freezers; on a cgroup v2
host it sees them from a private cgroup namespace, which it resolves). CRIU runs on the host:
the engine (dockerd, runc) dumps and restores, into folders the checkpointer names by their
host paths. So its store is the volume `checkpoints`, which lives inside the data root and is
therefore at the same path for the engine and for the checkpointer.""",
        args=("--host-id", "$BELAYER_HOST_ID", "--state-dir", f"{STORE}"),
        variables={
            "BELAYER_HOST_ID": Variable("compose", "the checkpointer's host id"),
            "BELAYER_ALLOW_ROOT_USER": Variable(
                "false",
                "let a sandbox ask to run its actions as root (see the checkpointer's README: a workload"
                " that leaves processes running)",
            ),
            "BELAYER_DOCKER_ROOT": Variable("/var/lib/docker", "the Docker engine's data root"),
        },
        environment={
            "BELAYER_CHECKPOINT_KEY": "/run/secrets/checkpoint.key",  # signs manifests; every host shares it
            "BELAYER_ALLOW_ROOT_USER": "$BELAYER_ALLOW_ROOT_USER",
        },
        secrets={CHECKPOINT_KEY_FILE: CHECKPOINT_KEY_FILE},
        stop_grace="40s",  # its drain lets running actions and checkpoints finish (30 s)
        keys={
            "cap_drop": [],  # root with Docker's default capabilities: it reads and thaws the sandboxes' cgroups
            "pid": "host",
            "volumes": [
                {"type": "bind", "source": "/var/run/docker.sock", "target": "/var/run/docker.sock"},
                {"type": "bind", "source": "$BELAYER_DOCKER_ROOT", "target": "$BELAYER_DOCKER_ROOT"},
                {"type": "volume", "source": "checkpoints", "target": STORE},
                # writable: thawing a sandbox frozen behind Docker's back writes there
                {"type": "bind", "source": "/sys/fs/cgroup", "target": "/sys/fs/cgroup"},
            ],
        },
    ),
    up=up,
    up_settings=("docker_url", "debug_older_environment"),
)
