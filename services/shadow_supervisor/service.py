"""The shadow supervisor as a service: what it starts and when it serves what its declaration
lists (declaration.py); `setup` is what the runtime runs (shared/runtime.py).

It alone starts, replaces and kills the workers of its engines (services/shadow_supervisor/
supervisor.py); stopping it stops every worker it started, those still starting included. Each
engine's endpoints are served once its workers run.
"""

from __future__ import annotations

from belayer_rl.services.shadow_supervisor.declaration import SHADOW_SUPERVISOR
from belayer_rl.services.shadow_supervisor.supervisor import ShadowSupervisor
from belayer_rl.services.worker.declaration import WORKER
from belayer_rl.shared import bus
from belayer_rl.shared.config import ShadowSupervisorConfig
from belayer_rl.shared.metrics import SupervisorMetrics
from belayer_rl.shared.runtime import Runtime


async def setup(rt: Runtime, config: ShadowSupervisorConfig) -> None:
    # A kind no worker comes in would fail every start of every worker, each blamed on the arena.
    WORKER.setup_of(config)
    nc = await rt.connect()
    kv = await rt.unless_stopped(bus.engine_registry(nc.jetstream(), rt.subjects))
    supervisor = ShadowSupervisor(config, nc, kv, rt.record_skipped, SupervisorMetrics(rt.metrics))
    rt.on_close(supervisor.stop)
    await supervisor.start()
    await rt.serve(
        *SHADOW_SUPERVISOR.endpoints(
            rt.subjects,
            config,
            restart=supervisor.on_restart,
            unquarantine=supervisor.on_unquarantine,
            model_published=supervisor.on_model_published,
        )
    )
    rt.ready(f"engines {', '.join(config.engines)}, each with a main and a shadow")
