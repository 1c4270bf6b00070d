"""Subject names, stream and bucket names of one Belayer cluster: data, not scattered literals.

Every name carries the cluster id, so two Belayer clusters on one NATS never see each other's
messages: subjects start with `belayer.<cluster>.<domain>`, streams, buckets and object stores
end with `_<cluster>`. Events live under `belayer.<cluster>.evt.`, so that
`nats sub 'belayer.default.evt.>'` shows all of one cluster's. The schema version travels in the
message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from belayer_rl.shared.protocol import EVENT_TYPES

PREFIX = "belayer"
DEFAULT_CLUSTER = "default"
# A subject token and a stream/bucket name at once: no dots, wildcards or spaces.
CLUSTER_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"

# Sandboxes: one checkpointer per Docker host, addressed by its host id (it owns that host's
# containers, so no queue group).
SANDBOX_VERBS = ("create", "exec", "checkpoint", "restore", "destroy", "list", "end")


def cluster_id_ok(cluster_id: str) -> bool:
    return re.fullmatch(CLUSTER_ID_PATTERN, cluster_id) is not None


def sender(subject: str) -> str:
    """Who sent a message on a subject that ends in its sender's name (an engine, a client): the bus
    lets only that sender's credential publish there, whatever the payload says."""
    return subject.rsplit(".", 1)[1]


def caller(subject: str) -> str:
    """Who called the router on `belayer.<cluster>.router.<call>.<client>`: the tokens past the
    call. A client is one token (its credential's name), or, for the gateway, `gateway.<key>`: the
    bus lets the gateway's credential alone publish under `gateway.`, and each API key owns what
    it starts."""
    return subject.split(".", 4)[4]


def event_kind(subject: str) -> str:
    """The kind of an event subject, `belayer.<cluster>.evt.<kind>...` ("" for any other subject)."""
    tokens = subject.split(".")
    return tokens[3] if len(tokens) > 3 and tokens[0] == PREFIX and tokens[2] == "evt" else ""


@dataclass(frozen=True)
class Subjects:
    """The names of cluster `cluster_id`. No queue groups anywhere: whoever serves a subject owns
    the state behind it (the active router, an engine's worker, a host's servers)."""

    cluster_id: str = DEFAULT_CLUSTER

    def __post_init__(self) -> None:
        if not cluster_id_ok(self.cluster_id):
            raise ValueError(f"cluster id {self.cluster_id!r} does not match {CLUSTER_ID_PATTERN}")

    @property
    def root(self) -> str:
        return f"{PREFIX}.{self.cluster_id}"

    # ------------------------------------------------------------ router RPC

    # A client's calls name the client last: its credential may publish on its own name only, so
    # the router knows whose request it is (the client's user, Access.client; "*": every client).

    def router_generate(self, client: str) -> str:
        return f"{self.root}.router.generate.{client}"

    def router_attach(self, client: str) -> str:
        return f"{self.root}.router.attach.{client}"

    def router_cancel(self, client: str) -> str:
        return f"{self.root}.router.cancel.{client}"

    @property
    def router_status(self) -> str:
        return f"{self.root}.router.status"

    def router_keepalive(self, client: str) -> str:
        """ClientKeepAlive: a client still follows these requests."""
        return f"{self.root}.router.keepalive.{client}"

    def worker_stream(self, engine_id: str) -> str:
        """WorkerFrames of one engine: the router reads the engine from the subject
        (which the bus lets only that engine publish), never from the payload."""
        return f"{self.root}.router.worker_stream.{engine_id}"

    @property
    def worker_stream_all(self) -> str:
        return f"{self.root}.router.worker_stream.*"

    # ------------------------------------------------------------ workers

    def worker_dispatch(self, engine_id: str) -> str:
        return f"{self.root}.worker.{engine_id}.dispatch"

    def worker_cancel(self, engine_id: str) -> str:
        return f"{self.root}.worker.{engine_id}.cancel"

    def worker_adopt(self, engine_id: str) -> str:
        return f"{self.root}.worker.{engine_id}.adopt"

    # ------------------------------------------------------------ checkpoint policy

    @property
    def policy_decide(self) -> str:
        """PolicyDecide -> PolicyDecision (services/policy)."""
        return f"{self.root}.policy.decide"

    # ------------------------------------------------------------ every service

    def trainer_group(self, run: str, group: str, rank: int | str, verb: str) -> str:
        """A trainer group worker's RPC (services/trainer_group): `verb` is update, ..."""
        return f"{self.root}.trainer.{run}.{group}.{rank}.{verb}"

    def service_stats(self, name: str) -> str:
        """Every service process answers StatsRequest here (the runtime's endpoint)."""
        return f"{self.root}.svc.{name}.stats"

    # ------------------------------------------------------------ events

    @property
    def events(self) -> str:
        return f"{self.root}.evt"

    @property
    def events_all(self) -> str:
        return f"{self.events}.>"

    def event(self, kind: str, *ids: str) -> str:
        """`belayer.<cluster>.evt.<kind>[.<id>...]`, e.g. event("heartbeat", "e0"). The kind must be
        one of protocol.EVENT_TYPES: a kind declared nowhere could not be decoded by listeners."""
        if kind not in EVENT_TYPES:
            raise ValueError(f"event kind {kind!r} is not declared in protocol.EVENT_TYPES")
        return ".".join((self.events, kind, *ids))

    def weights_published(self, version: str) -> str:
        return self.event("weights_published", version)

    # ------------------------------------------------------------ token log and engine registry

    @property
    def token_log_stream(self) -> str:
        return f"BELAYER_TOKENS_{self.cluster_id}"

    @property
    def token_log_all(self) -> str:
        return f"{self.root}.log.tokens.*"

    def token_log(self, request_id: str) -> str:
        return f"{self.root}.log.tokens.{request_id}"

    @property
    def request_index_stream(self) -> str:
        """Which requests the token log holds: LogOpen and LogClosed, one per request (retention.py)."""
        return f"BELAYER_REQUESTS_{self.cluster_id}"

    @property
    def request_open_all(self) -> str:
        return f"{self.root}.log.open.*"

    def request_open(self, request_id: str) -> str:
        return f"{self.root}.log.open.{request_id}"

    @property
    def request_closed_all(self) -> str:
        return f"{self.root}.log.closed.*"

    def request_closed(self, request_id: str) -> str:
        return f"{self.root}.log.closed.{request_id}"

    @property
    def request_index_complete(self) -> str:
        """One entry: the index covers the whole log (a log older than its index was read once)."""
        return f"{self.root}.log.indexed"

    @property
    def router_lease_bucket(self) -> str:
        """One key: the lease of the active router (services/router/lease.py)."""
        return f"belayer_router_{self.cluster_id}"

    @property
    def engine_registry_bucket(self) -> str:
        return f"belayer_engines_{self.cluster_id}"

    def engine_restart(self, engine_id: str) -> str:
        """Served by the shadow supervisor that runs the engine (one subject per engine, so each
        host's supervisor answers for its own)."""
        return f"{self.root}.engines.{engine_id}.restart"

    def engine_unquarantine(self, engine_id: str) -> str:
        return f"{self.root}.engines.{engine_id}.unquarantine"

    # ------------------------------------------------------------ sandboxes

    def sandbox_rpc(self, host_id: str, verb: str, client: str) -> str:
        """`belayer.<cluster>.sandbox.<host>.<verb>.<client>`, verb one of SANDBOX_VERBS. The client
        last, as on the router's subjects: a sandbox, and its trajectory, are the client's that
        made it."""
        return f"{self.root}.sandbox.{host_id}.{verb}.{client}"

    def sandbox_rpc_all(self, host_id: str) -> str:
        return f"{self.root}.sandbox.{host_id}.*.*"

    @property
    def prefix_pointer_bucket(self) -> str:
        return f"belayer_prefix_{self.cluster_id}"

    @property
    def checkpoint_object_bucket(self) -> str:
        """Checkpoint folders, for a restore on another host."""
        return f"belayer_checkpoints_{self.cluster_id}"

    @property
    def weights_object_bucket(self) -> str:
        """Weights files on their way from a trainer to the weight server (no shared disk needed)."""
        return f"belayer_weights_{self.cluster_id}"

    # ------------------------------------------------------------ weight and KV servers
    # One of each per host (they own that host's shared memory).

    @property
    def weights_list(self) -> str:
        return f"{self.root}.weights.list"

    @property
    def weights_handles(self) -> str:
        return f"{self.root}.weights.handles"

    def weights_pin(self, engine_id: str) -> str:
        """A pin for one of the engine's workers: the engine is the subject's, on which only its
        own credential publishes, so its pins count against its own quota and nobody else's."""
        return f"{self.root}.weights.pin.{engine_id}"

    def weights_unpin(self, engine_id: str) -> str:
        return f"{self.root}.weights.unpin.{engine_id}"

    @property
    def weights_pins(self) -> str:
        return f"{self.root}.weights.pin.*"

    @property
    def weights_unpins(self) -> str:
        return f"{self.root}.weights.unpin.*"

    @property
    def weights_publish(self) -> str:
        return f"{self.root}.weights.publish"

    @property
    def weights_ping(self) -> str:
        return f"{self.root}.weights.ping"

    def kv_arena(self, engine_id: str) -> str:
        """An engine's arena requests: the engine is the subject's, which only its credential
        may publish on, never the payload's."""
        return f"{self.root}.kv.arena.{engine_id}"

    @property
    def kv_arenas(self) -> str:
        return f"{self.root}.kv.arena.*"

    def kv_flush(self, engine_id: str) -> str:
        """A flush of the engine's arena: asked by that engine's shadow supervisor, whose
        credential may publish on its own engine's subject only."""
        return f"{self.root}.kv.flush.{engine_id}"

    @property
    def kv_flushes(self) -> str:
        return f"{self.root}.kv.flush.*"

    @property
    def kv_release(self) -> str:
        return f"{self.root}.kv.release"

    @property
    def kv_ping(self) -> str:
        return f"{self.root}.kv.ping"
