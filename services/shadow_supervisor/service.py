"""The shadow supervisor as a service: what it listens to and what it starts; `setup` is what
the runtime runs (shared/runtime.py).

It alone starts, replaces and kills the workers of its engines (services/shadow_supervisor/
supervisor.py); stopping it stops every worker it started, those still starting included. Each
engine's restart and unquarantine subjects are served once its workers run.
"""

from __future__ import annotations

from belayer_rl.services.shadow_supervisor.supervisor import ShadowSupervisor
from belayer_rl.shared import bus
from belayer_rl.shared.config import ShadowSupervisorConfig
from belayer_rl.shared.metrics import SupervisorMetrics
from belayer_rl.shared.protocol import EngineRestart, EngineUnquarantine
from belayer_rl.shared.runtime import Endpoint, Runtime


async def setup(rt: Runtime, config: ShadowSupervisorConfig) -> None:
    nc = await rt.connect()
    kv = await rt.unless_stopped(bus.engine_registry(nc.jetstream(), rt.subjects))
    supervisor = ShadowSupervisor(config, nc, kv, rt.record_skipped, SupervisorMetrics(rt.metrics))
    rt.on_close(supervisor.stop)
    await supervisor.start()
    names = rt.subjects
    await rt.serve(
        *(
            endpoint
            for engine in config.engines
            for endpoint in (
                Endpoint(
                    names.engine_restart(engine), EngineRestart, supervisor.on_restart, with_subject=True
                ),
                Endpoint(
                    names.engine_unquarantine(engine),
                    EngineUnquarantine,
                    supervisor.on_unquarantine,
                    with_subject=True,
                ),
            )
        )
    )
    rt.ready(f"engines {', '.join(config.engines)}, each with a main and a shadow")
