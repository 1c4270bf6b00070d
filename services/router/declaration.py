"""The router, declared (shared/declaration.py): one active per cluster, warm standbys beside it.

It takes the clients' requests, dispatches them to the engines and streams the chunks back into the
clients' inboxes; it owns the token log, its request index, the engine registry and its own lease.
"""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.declaration import (
    ANY,
    Compose,
    Deployment,
    Listen,
    Planned,
    Service,
    event,
    kv_put,
    kv_stream,
    on_event,
)

HANDOVER_GRACE_S = 1.0  # with shadows, a failed engine's requests wait this long for its shadow


def up(cluster: Deployment) -> list[Planned]:
    """The router and its warm standbys, the same process: started first, the first takes the
    lease, and whichever holds it acts (services/router/lease.py)."""
    grace = HANDOVER_GRACE_S if cluster.shadows else 0.0
    config = RouterConfig(**cluster.settings(RouterConfig, "router") | {"handover_grace_s": grace})
    standbys = range(1, cluster.standby_routers + 1)
    return [Planned("router", config), *(Planned(f"router-standby-{i}", config) for i in standbys)]


ROUTER = Service(
    name="router",
    summary="Run the Belayer router.",
    runs="cluster",
    config=RouterConfig,
    setup="belayer_rl.services.router.service:setup",
    listens={
        # from the engines: their chunks, their liveness
        "worker_stream": Listen(lambda s, x: s.worker_stream_all, p.WorkerStream, with_subject=True),
        "heartbeat": on_event("heartbeat"),
        "registration": on_event("worker_registered"),
        "worker_failed": on_event("worker_failed"),
        "quarantined": on_event("engine_quarantined"),
        "process": on_event("process"),  # a standby takes a lease whose holder exited at once
        # from the clients, once it holds the lease: each call names its client last (one token, or
        # two for a key of the gateway: subjects.caller)
        "generate": Listen(lambda s, x: s.router_generate(">"), p.GenerateRequest, p.Ack, with_subject=True),
        "attach": Listen(lambda s, x: s.router_attach(">"), p.AttachRequest, p.Ack, with_subject=True),
        "cancel": Listen(lambda s, x: s.router_cancel(">"), p.CancelRequest, p.Ack, with_subject=True),
        "status": Listen(lambda s, x: s.router_status, p.StatusRequest, p.RouterStatus),
        "keepalive": Listen(lambda s, x: s.router_keepalive(">"), p.ClientKeepAlive, with_subject=True),
    },
    publishes=(
        lambda s, x: s.worker_dispatch(ANY),
        lambda s, x: s.worker_cancel(ANY),
        lambda s, x: s.worker_adopt(ANY),
        lambda s, x: s.weights_list,
        event("request_failed"),
        event("request_resumed"),
        event("worker_failed"),
        event("router_started"),
        event("record_skipped"),
        lambda s, x: s.token_log_all,
        lambda s, x: s.request_open_all,
        lambda s, x: s.request_closed_all,
        lambda s, x: s.request_index_complete,
        lambda s, x: kv_put(s.router_lease_bucket),  # its lease: taken, renewed, released
    ),
    owns=(
        lambda s: s.token_log_stream,
        lambda s: s.request_index_stream,
        lambda s: kv_stream(s.engine_registry_bucket),
        lambda s: kv_stream(s.router_lease_bucket),
    ),
    stats=lambda x: "router",
    to_clients=True,  # chunks stream to the clients' inboxes (the router checks reply_to is one)
    up=up,
    up_settings=(
        "chunk_tokens",
        "replicas",
        "log_max_mb",
        "log_client_share",
        "ended_keep_s",
        "lease_ttl_s",
        "progress_deadline_s",
        "debug_accept_stale",
        "heartbeat_timeout_s",
        "no_worker_deadline_s",
        "client_timeout_s",
    ),
    compose=Compose(
        uid=2001,
        args=("--handover-grace", "1"),  # a failed engine's requests wait this long for its shadow
        standby="router-standby",
        standby_note="""A warm standby: it waits for the router lease (healthy, "standby"), and takes over the
requests in flight, adopting what the engines still run, when the active router stops or dies.
Either container may be the active one: its /healthz says "ok", the other's "standby: ...".""",
    ),
)
