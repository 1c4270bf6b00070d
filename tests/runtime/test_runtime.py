"""The runtime in-process against a real nats-server: intake really stops at a drain, and an
essential task that ends stops the service with a failure."""

from __future__ import annotations

import asyncio

from belayer_rl.shared import bus, protocol, runtime
from belayer_rl.shared.config import ServiceConfig
from belayer_rl.shared.protocol import Ack, CancelRequest
from belayer_rl.shared.runtime import Endpoint, Runtime

SUBJECT = "belayer.test.ordered"


async def test_an_in_order_endpoint_takes_nothing_after_intake_stops(nats_server) -> None:
    handled: list[str] = []
    first_started = asyncio.Event()

    async def slow(message: CancelRequest) -> Ack:
        first_started.set()
        await asyncio.sleep(0.3)
        handled.append(message.request_id)
        return Ack()

    runtimes: list[Runtime] = []

    async def setup(rt: Runtime, config: ServiceConfig) -> None:
        runtimes.append(rt)
        await rt.connect()
        await rt.serve(Endpoint(SUBJECT, CancelRequest, slow, reply=False))

    config = ServiceConfig(nats_url=nats_server.url, drain_timeout_s=3.0)
    service = asyncio.create_task(runtime.serve("test-ordered", config, setup))
    sender = await bus.connect(nats_server.url, "test-sender")
    try:
        await asyncio.sleep(0.5)  # subscribed
        for i in range(10):
            await sender.publish(SUBJECT, protocol.encode(CancelRequest(request_id=f"r{i}")))
        await sender.flush()
        await first_started.wait()
        stop_asked = asyncio.get_running_loop().time()
        # The drain: the handler in flight finishes, the nine queued behind it are never taken.
        runtimes[0].stopping.set()
        failure = await asyncio.wait_for(service, 10)
        stopped_after = asyncio.get_running_loop().time() - stop_asked
        await asyncio.sleep(1.0)  # anything still delivered would land now
    finally:
        await sender.close()

    assert failure == ""
    assert handled == ["r0"], handled
    assert stopped_after < config.drain_timeout_s


async def test_an_essential_task_that_ends_stops_the_service_with_a_failure(nats_server) -> None:
    async def crashes() -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("the scheduling loop broke")

    async def setup(rt: Runtime, config: ServiceConfig) -> None:
        await rt.connect()
        rt.spawn(crashes(), "engine", essential=True)
        rt.spawn(asyncio.sleep(3600), "idle")  # an ordinary task: cancelled at the stop

    failure = await asyncio.wait_for(
        runtime.serve("test-essential", ServiceConfig(nats_url=nats_server.url), setup), 15
    )

    assert failure == "essential task engine ended"
