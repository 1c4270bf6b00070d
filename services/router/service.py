"""The router as a service: what it starts and when it serves what its declaration lists
(declaration.py); `setup` is what the runtime runs (shared/runtime.py).

Owns request routing and the token log (services/router/router.py), and the log's retention: the
request index and each client's share (retention.py). A drain stops intake and flushes the token
log, so a successor resumes every request from it.

A router that starts while another one holds the lease waits for it (a warm standby: connected,
listening to the workers, not yet serving clients), then claims the log and serves.
"""

from __future__ import annotations

from belayer_rl.services.router.declaration import ROUTER
from belayer_rl.services.router.lease import Lease, lease_bucket
from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.metrics import RouterMetrics
from belayer_rl.shared.runtime import Runtime


async def setup(rt: Runtime, config: RouterConfig) -> None:
    nc = await rt.connect()
    js = nc.jetstream()
    kv = await bus.with_retries(
        "declare jetstream",
        lambda: bus.declare_jetstream(
            js,
            rt.subjects,
            replicas=config.replicas,
            max_bytes=config.log_max_mb << 20,
            ended_keep_s=config.ended_keep_s,
        ),
    )
    lease = Lease(
        await bus.with_retries(
            "declare the lease bucket", lambda: lease_bucket(js, rt.subjects, config.replicas)
        ),
        config.lease_ttl_s,
        config.instance,
    )
    router = Router(config, nc, js, kv, lease, rt.spawn, rt.record_skipped, RouterMetrics(rt.metrics))
    rt.on_reconnect(router.on_reconnect)

    # Listen to workers before rebuilding, so no heartbeat of a serving engine is missed.
    await rt.serve(
        *ROUTER.endpoints(
            rt.subjects,
            config,
            worker_stream=router.on_worker_stream,
            heartbeat=router.on_heartbeat,
            registration=router.on_registration,
            worker_failed=router.on_worker_failed,
            quarantined=router.on_quarantined,
            process=lease.on_process,
        )
    )
    rt.standing_by("the router lease")  # a warm standby until the lease is free
    await lease.acquire()
    rt.standing_by("")  # taking over: starting, until the rebuild is done
    rt.spawn(lease.renew(), "lease", essential=True)  # lost to another router: this one stops
    started = await router.rebuild()
    await rt.serve(
        *ROUTER.endpoints(
            rt.subjects,
            config,
            generate=router.on_generate,
            attach=router.on_attach,
            cancel=router.on_cancel,
            status=router.on_status,
            keepalive=router.on_keepalive,
        )
    )
    rt.spawn(router.watchdog(), "watchdog", essential=True)
    rt.spawn(router.writer.run(), "log-writer", essential=True)
    rt.spawn(router.retention.run(), "log-retention", essential=True)
    rt.on_drain(router.writer.drain)  # intake stopped: let the token log catch up
    rt.on_drain(lease.release)  # then a standby takes over at once
    await rt.publish(rt.subjects.event("router_started", str(started.router_pid)), started)
    rt.ready(f"{started.rebuilt_requests} requests rebuilt, {started.resumed_requests} resumed")
