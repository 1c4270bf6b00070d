"""The shadow supervisor, declared (shared/declaration.py): runs each of its engines' main worker
and idle shadow, and hands over when the main fails.

One credential per engine (a Compose engine container holds only its own), and one for every
engine at once (`belayer up` runs a single supervisor): {engine} is then a wildcard.
"""

from __future__ import annotations

from belayer_rl.shared import protocol as p
from belayer_rl.shared.config import ShadowSupervisorConfig
from belayer_rl.shared.declaration import (
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
    on_event,
)


def up(cluster: Deployment) -> list[Planned]:
    """One supervisor of every engine, under the every-engine credential."""
    if not cluster.shadows or not cluster.engines:
        return []
    mine = {
        "engine_creds": cluster.creds_dir,
        "engines": cluster.engines,
        "state_dir": cluster.state_dir / "workers",
    }
    settings = cluster.settings(ShadowSupervisorConfig, "shadow-supervisor")
    return [Planned("shadow-supervisor", ShadowSupervisorConfig(**settings | mine))]


SHADOW_SUPERVISOR = Service(
    name="shadow-supervisor",
    summary="Run each engine's main worker and its idle shadow; hand over on a failure.",
    runs="engine",
    config=ShadowSupervisorConfig,
    setup="belayer_rl.services.shadow_supervisor.service:setup",
    listens={
        "restart": Listen(
            lambda s, x: s.engine_restart(x.engine), p.EngineRestart, p.EngineRestarted, with_subject=True
        ),
        "unquarantine": Listen(
            lambda s, x: s.engine_unquarantine(x.engine),
            p.EngineUnquarantine,
            p.EngineRestarted,
            with_subject=True,
        ),
        "model_published": on_event("model_published"),  # vllm: later workers start from it
    },
    publishes=(
        lambda s, x: s.kv_flush(x.engine),
        lambda s, x: s.kv_ping,
        lambda s, x: s.weights_ping,
        event("handover", lambda x: x.engine),
        event("engine_quarantined", lambda x: x.engine),
        event("engine_unstable", lambda x: x.engine),
        event("record_skipped"),
        event("model_published"),  # said again to a worker that started while it was published
        event("process", lambda x: f"worker-{x.engine}-main"),  # its workers' starts and exits
        event("process", lambda x: f"worker-{x.engine}-shadow"),
        lambda s, x: kv_put(s.engine_registry_bucket, x.engine),  # quarantines the engine it runs, no other
    ),
    reads=(lambda s: kv_stream(s.engine_registry_bucket),),
    # Is another engine serving? (before a quarantine)
    lists=(lambda s: kv_stream(s.engine_registry_bucket),),
    scopes=lambda config: tuple(Scope(engine=engine) for engine in config.engines),
    all_engines=True,
    up=up,
    up_settings=("failure_window_s", "quarantine_after"),
    compose=Compose(
        uid=2100,
        per_engine="engine",
        note="""One container per engine: the shadow supervisor of that engine alone, with that engine's
supervisor credential and its engine's credential (--engine-creds names the folder holding
engine-<id>.creds), which it hands to the engine's workers; neither reaches another engine. A
SIGKILLed main worker is replaced by its shadow inside this container.""",
        args=(
            "--engines",
            "{engine}",
            "--state-dir",
            "/var/lib/belayer/workers",
            "--engine-creds",
            "/run/secrets",
            "--kind",
            "$BELAYER_ENGINE",
            "--preset",
            "$BELAYER_MODEL",
            "--weights-seed",
            "$BELAYER_WEIGHTS_SEED",
            "--hang-timeout",
            "$BELAYER_HANG_TIMEOUT",
        ),
        variables={
            "BELAYER_ENGINE": Variable(
                "builtin", "the program behind each engine: a kind of the worker's declaration"
            ),
            "BELAYER_HANG_TIMEOUT": Variable(
                "2", "seconds of a main worker's silence before its shadow takes over"
            ),
        },
        groups=("weight-server",),  # it maps the weights read-only
        shares_namespaces="""the supervisor's pidfds and its workers' pids must mean the same processes
everywhere, and the workers map the servers' segments.""",
        secrets={"engine-{engine}.creds": "engine-{engine}.creds"},
        after=("router", "weight-server", "kv-server"),
        stop_grace="20s",  # its drain, then each worker's
    ),
)
