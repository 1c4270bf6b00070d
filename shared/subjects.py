"""Subject names, stream and bucket names: data, not scattered literals.

Every subject starts with `belayer.<domain>`; events live under `belayer.evt.` so that
`nats sub 'belayer.evt.>'` shows all of them. The schema version travels in the message.
"""

from belayer_rl.shared.protocol import EVENT_TYPES

PREFIX = "belayer"

# Router RPC (one active router; it owns the in-flight state, so no queue group).
ROUTER_GENERATE = f"{PREFIX}.router.generate"
ROUTER_ATTACH = f"{PREFIX}.router.attach"
ROUTER_CANCEL = f"{PREFIX}.router.cancel"
ROUTER_REGISTER = f"{PREFIX}.router.register"
ROUTER_STATUS = f"{PREFIX}.router.status"
ROUTER_KEEPALIVE = f"{PREFIX}.router.keepalive"  # ClientKeepAlive: a client still follows these
ROUTER_WORKER_STREAM = f"{PREFIX}.router.worker_stream"  # WorkerChunk / WorkerDone from workers

# Every service process answers StatsRequest here (the runtime's endpoint): readiness, messages
# handled, errors by code.
SERVICE_PREFIX = f"{PREFIX}.svc"


def service_stats(name: str) -> str:
    return f"{SERVICE_PREFIX}.{name}.stats"


EVENTS = f"{PREFIX}.evt"
EVENTS_ALL = f"{EVENTS}.>"

# Token log: one subject per request inside one stream.
TOKEN_LOG_STREAM = "BELAYER_TOKENS"
TOKEN_LOG_PREFIX = f"{PREFIX}.log.tokens"
TOKEN_LOG_ALL = f"{TOKEN_LOG_PREFIX}.*"

ENGINE_REGISTRY_BUCKET = "belayer_engines"


def worker_dispatch(engine_id: str) -> str:
    return f"{PREFIX}.worker.{engine_id}.dispatch"


def worker_cancel(engine_id: str) -> str:
    return f"{PREFIX}.worker.{engine_id}.cancel"


def event(kind: str, *ids: str) -> str:
    """`belayer.evt.<kind>[.<id>...]`, e.g. event("heartbeat", "e0"). The kind must be one of
    protocol.EVENT_TYPES: a subject whose kind is declared nowhere could not be decoded by listeners."""
    if kind not in EVENT_TYPES:
        raise ValueError(f"event kind {kind!r} is not declared in protocol.EVENT_TYPES")
    return ".".join((EVENTS, kind, *ids))


def event_kind(subject: str) -> str:
    """The kind of an event subject: the token after `belayer.evt.` ("" outside `belayer.evt.`)."""
    head, _, rest = subject.partition(".evt.")
    return rest.split(".", 1)[0] if head == PREFIX else ""


def token_log(request_id: str) -> str:
    return f"{TOKEN_LOG_PREFIX}.{request_id}"


# Sandboxes: one checkpointer per Docker host, addressed by its host id (it owns that host's
# containers, so no queue group). Events: belayer.evt.checkpoint_ready.<trajectory>,
# belayer.evt.env_failure.<sandbox>, belayer.evt.sandbox_restored.<trajectory>.
SANDBOX_PREFIX = f"{PREFIX}.sandbox"
SANDBOX_VERBS = ("create", "exec", "checkpoint", "restore", "destroy", "list", "end")
PREFIX_POINTER_BUCKET = "belayer_prefix"
CHECKPOINT_OBJECT_BUCKET = "belayer_checkpoints"  # checkpoint folders, for a restore on another host


def sandbox_rpc(host_id: str, verb: str) -> str:
    """`belayer.sandbox.<host>.<verb>`, verb one of SANDBOX_VERBS."""
    return f"{SANDBOX_PREFIX}.{host_id}.{verb}"


def sandbox_rpc_all(host_id: str) -> str:
    return f"{SANDBOX_PREFIX}.{host_id}.*"


# Weight and KV servers: one of each per host (they own that host's shared memory), so no queue
# group. Events: belayer.evt.weights_published.<version>.
WEIGHTS_PREFIX = f"{PREFIX}.weights"
WEIGHTS_LIST = f"{WEIGHTS_PREFIX}.list"
WEIGHTS_HANDLES = f"{WEIGHTS_PREFIX}.handles"
WEIGHTS_PIN = f"{WEIGHTS_PREFIX}.pin"
WEIGHTS_UNPIN = f"{WEIGHTS_PREFIX}.unpin"
WEIGHTS_PUBLISH = f"{WEIGHTS_PREFIX}.publish"
WEIGHTS_PING = f"{WEIGHTS_PREFIX}.ping"

KV_PREFIX = f"{PREFIX}.kv"
KV_ARENA = f"{KV_PREFIX}.arena"
KV_FLUSH = f"{KV_PREFIX}.flush"
KV_RELEASE = f"{KV_PREFIX}.release"
KV_PING = f"{KV_PREFIX}.ping"


def weights_published(version: str) -> str:
    return event("weights_published", version)
