"""The router's view of engines against a real nats-server and registry, driven in-process."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from belayer_rl.services.router.lease import Lease, lease_bucket
from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus, registry
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.protocol import CancelRequest, GenerateRequest
from belayer_rl.shared.runtime import Runtime


@contextlib.asynccontextmanager
async def in_process_router(nats_server, **settings: object) -> AsyncIterator[Router]:  # type: ignore[no-untyped-def]
    """A router on the test's nats-server, in this process; its lease not yet taken."""
    nc = await bus.connect(nats_server.url, "test-router")
    try:
        js = nc.jetstream()
        config = RouterConfig(nats_url=nats_server.url, **settings)  # type: ignore[arg-type]
        kv = await bus.declare_jetstream(
            js, config.subjects, max_bytes=config.log_max_mb << 20, ended_keep_s=config.ended_keep_s
        )
        runtime = Runtime("test-router", config)
        lease = Lease(await lease_bucket(js, config.subjects, 1), config.lease_ttl_s)
        yield Router(config, nc, js, kv, lease, runtime.spawn, runtime.record_skipped)
    finally:
        await nc.close()


async def test_heartbeat_and_registration_together_install_the_engine_once(nats_server) -> None:
    """A new worker's heartbeat and registration arrive together; both look the engine up, both
    wait for the registry. The second must not replace the engine the first installed: requests
    already placed on it would be forgotten and never resumed when it fails."""
    async with in_process_router(nats_server) as router:
        epoch, _ = await registry.install_worker(router.kv, "e0", os.getpid())
        installed = []
        router.dispatch_waiting = lambda: installed.append(router.engines["e0"])  # type: ignore[method-assign]

        await asyncio.gather(*(router.see_worker("e0", epoch, os.getpid()) for _ in range(3)))

        assert len(installed) == 1
        assert router.engines["e0"] is installed[0]
        assert router.engines["e0"].epoch == epoch and router.engines["e0"].alive


async def test_ended_requests_are_forgotten_oldest_first_after_their_ttl(nats_server) -> None:
    """A training run ends hundreds of requests a second. The router keeps each ended one for
    --ended-keep (a client may still attach), then forgets it, oldest first, while the running
    ones stay known and watched. Mutations caught: forgetting every ended request at once, never
    forgetting, and an ended request left among the running ones (which the watchdog walks)."""
    async with in_process_router(nats_server, ended_keep_s=1.5) as router:
        await router.lease.acquire()
        tasks = [
            asyncio.create_task(t) for t in (router.lease.renew(), router.writer.run(), router.watchdog())
        ]
        try:
            inbox, cli = router.nc.new_inbox(), router.subjects.router_generate("cli")
            for name in ("early-1", "early-2", "late", "running"):
                await router.on_generate(
                    GenerateRequest(
                        request_id=name, prompt="ab", max_tokens=4, weight_version="w", reply_to=inbox
                    ),
                    cli,
                )

            def running_are_the_unended() -> bool:
                return router.running.keys() == {r for r, req in router.requests.items() if req.end is None}

            for name in ("early-1", "early-2"):
                await router.on_cancel(CancelRequest(request_id=name), cli)
            await asyncio.sleep(0.8)
            await router.on_cancel(CancelRequest(request_id="late"), cli)
            assert running_are_the_unended() and set(router.running) == {"running"}

            await asyncio.sleep(1.2)  # past the TTL of the early ones, not of the late one
            assert set(router.requests) == {"late", "running"}
            await asyncio.sleep(0.8)
            assert set(router.requests) == {"running"}
            assert running_are_the_unended()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
