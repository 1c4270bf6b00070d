"""The rollout worker, declared (shared/declaration.py): an engine's main worker, or its idle
shadow, under the engine's own credential (`engine-<id>`), which publishes only that engine's
chunks, heartbeats, pins and registry entry."""

from __future__ import annotations

import os

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import WorkerConfig
from belayer_rl.shared.declaration import (
    Deployment,
    Kind,
    Listen,
    Planned,
    Scope,
    Service,
    event,
    kv_put,
    kv_stream,
    on_event,
)


def up(cluster: Deployment) -> list[Planned]:
    """A bare worker per engine, where no shadow supervisor runs them."""
    if cluster.shadows:
        return []
    planned = []
    for e in cluster.engines:
        config = WorkerConfig(**cluster.settings(WorkerConfig, f"engine-{e}") | {"engine_id": e})
        planned.append(Planned(f"worker-{e}", config, e, python=config.engine_python))
    return planned


WORKER = Service(
    name="worker",
    summary="Run one rollout worker.",
    runs="engine",
    role="engine",
    config=WorkerConfig,
    setup="belayer_rl.services.worker.service:setup",
    listens={
        "dispatch": Listen(lambda s, x: s.worker_dispatch(x.engine), p.Dispatch, p.Ack),
        "cancel": Listen(lambda s, x: s.worker_cancel(x.engine), p.CancelDispatch, p.Ack),
        "adopt": Listen(lambda s, x: s.worker_adopt(x.engine), p.AdoptRequest, p.AdoptReply),
        "router_started": on_event("router_started"),  # a new router incarnation: fence the older ones
        "weights_published": on_event("weights_published"),  # follow the newest version
        "model_published": on_event("model_published"),  # vllm: new weights, replaced in place
    },
    publishes=(
        lambda s, x: s.worker_stream(x.engine),
        event("heartbeat", lambda x: x.engine),
        event("worker_registered", lambda x: x.engine),
        event("record_skipped"),
        lambda s, x: s.weights_pin(x.engine),
        lambda s, x: s.weights_unpin(x.engine),
        lambda s, x: s.weights_list,
        lambda s, x: s.weights_handles,
        lambda s, x: s.kv_arena(x.engine),
        lambda s, x: kv_put(s.engine_registry_bucket, x.engine),  # its own registry entry, nobody else's
    ),
    reads=(lambda s: kv_stream(s.engine_registry_bucket),),
    # Named by engine and pid: an engine's main and its shadow run side by side. The stats key
    # carries the engine as a token of its own: the engine's credential answers only its own.
    scopes=lambda config: (Scope(engine=config.engine_id, pid=str(os.getpid())),),
    process=lambda x: f"worker-{x.engine}-{x.pid}",
    stats=lambda x: f"worker.{x.engine}.{x.pid}",
    # Until the engine is built SIGTERM keeps its default action: there is nothing to drain, and a
    # worker stuck waiting for a server must still go when its supervisor goes.
    signals_during_setup=False,
    up=up,
    up_settings=(
        "kind",
        "preset",
        "model_path",
        "engine_python",
        "max_model_len",
        "vllm_kv_cache_gib",
        "weights_seed",
        "num_blocks",
        "hang_timeout_s",
    ),
    up_flags={"kind": "--engine", "preset": "--model"},
    kinds=(
        Kind(
            "builtin",
            "belayer_rl.services.worker.service:setup",
            "Belayer's own torch engine (paged KV cache)",
        ),
        Kind(
            "vllm",
            "belayer_rl.services.worker.vllm_service:setup",
            "vLLM's engine, sampled by Belayer (a model folder, vLLM in its own virtualenv)",
        ),
    ),
)
