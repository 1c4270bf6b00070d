"""The router as a service: what it listens to and what it starts; `setup` is what
the runtime runs (shared/runtime.py).

Owns request routing and the token log (services/router/router.py). Listens to the workers'
streams, heartbeats, registrations, failures and quarantines; serves generate, attach, cancel,
status and keepalives. A drain stops intake and flushes the token log, so a successor resumes every
request from it.
"""

from __future__ import annotations

from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus, subjects
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.protocol import (
    AttachRequest,
    CancelRequest,
    ClientKeepAlive,
    GenerateRequest,
    StatusRequest,
    WorkerStream,
)
from belayer_rl.shared.runtime import Endpoint, Runtime


async def setup(rt: Runtime, config: RouterConfig) -> None:
    nc = await rt.connect()
    js = nc.jetstream()
    kv = await bus.with_retries("declare jetstream", lambda: bus.declare_jetstream(js))
    router = Router(config, nc, js, kv, rt.spawn)
    rt.on_reconnect(router.on_reconnect)

    # Listen to workers before rebuilding, so no heartbeat of a serving engine is missed.
    await rt.serve(
        Endpoint(subjects.ROUTER_WORKER_STREAM, WorkerStream, router.on_worker_stream, reply=False),
        Endpoint.event("heartbeat", router.on_heartbeat, "*"),
        Endpoint.event("worker_registered", router.on_registration, "*"),
        Endpoint.event("worker_failed", router.on_worker_failed, "*"),
        Endpoint.event("engine_quarantined", router.on_quarantined, "*"),
    )
    started = await router.rebuild()
    await rt.serve(
        Endpoint(subjects.ROUTER_GENERATE, GenerateRequest, router.on_generate),
        Endpoint(subjects.ROUTER_ATTACH, AttachRequest, router.on_attach),
        Endpoint(subjects.ROUTER_CANCEL, CancelRequest, router.on_cancel),
        Endpoint(subjects.ROUTER_STATUS, StatusRequest, router.on_status),
        Endpoint(subjects.ROUTER_KEEPALIVE, ClientKeepAlive, router.on_keepalive, reply=False),
    )
    rt.spawn(router.watchdog(), "watchdog", essential=True)
    rt.spawn(router.writer.run(), "log-writer", essential=True)
    rt.on_drain(router.writer.drain)  # intake stopped: let the token log catch up
    await rt.publish(subjects.event("router_started", str(started.router_pid)), started)
    rt.ready(f"{started.rebuilt_requests} requests rebuilt, {started.resumed_requests} resumed")
