"""The router's view of engines against a real nats-server and registry, driven in-process."""

from __future__ import annotations

import asyncio
import os

from belayer_rl.services.router.lease import Lease, lease_bucket
from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus, registry
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.runtime import Runtime
from belayer_rl.shared.subjects import Subjects


async def test_heartbeat_and_registration_together_install_the_engine_once(nats_server) -> None:
    """A new worker's heartbeat and registration arrive together; both look the engine up, both
    wait for the registry. The second must not replace the engine the first installed: requests
    already placed on it would be forgotten and never resumed when it fails."""
    nc = await bus.connect(nats_server.url, "test-router")
    try:
        js = nc.jetstream()
        kv = await bus.declare_jetstream(js, Subjects())
        config = RouterConfig(nats_url=nats_server.url)
        runtime = Runtime("test-router", config)
        lease = Lease(await lease_bucket(js, Subjects(), 1), config.lease_ttl_s)
        router = Router(config, nc, js, kv, lease, runtime.spawn, runtime.record_skipped)
        epoch, _ = await registry.install_worker(kv, "e0", os.getpid())
        installed = []
        router.dispatch_waiting = lambda: installed.append(router.engines["e0"])  # type: ignore[method-assign]

        await asyncio.gather(*(router.see_worker("e0", epoch, os.getpid()) for _ in range(3)))

        assert len(installed) == 1
        assert router.engines["e0"] is installed[0]
        assert router.engines["e0"].epoch == epoch and router.engines["e0"].alive
    finally:
        await nc.close()
