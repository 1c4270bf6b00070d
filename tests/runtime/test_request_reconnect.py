"""A request waiting on a connection that is lost and made again fails then, not at its timeout:
after a nats-server restart its reply can never come (a restarted server refuses the responder's
publish to an inbox it never saw). A real nats-server is SIGKILLed and started again under a
request whose responder holds it; the error names the lost connection, where waiting out the
timeout would name the timeout (the mutation check: the same request with no restart)."""

from __future__ import annotations

import asyncio

import pytest

from belayer_rl.shared import bus
from belayer_rl.shared.protocol import Ack
from tests.support import NatsServer

pytestmark = pytest.mark.timeout(60)


async def test_a_request_fails_when_its_connection_is_made_again(nats_server: NatsServer) -> None:
    responder = await bus.connect(nats_server.url, "responder")
    requester = await bus.connect(nats_server.url, "requester")
    received = asyncio.Event()

    async def hold(msg: object) -> None:  # receives, never answers
        received.set()

    await responder.subscribe("test.held", cb=hold)
    await responder.flush()
    try:
        request = asyncio.create_task(bus.request(requester, "test.held", Ack(), timeout_s=30.0))
        await asyncio.wait_for(received.wait(), 5)
        await nats_server.restart(down_s=0.2)
        with pytest.raises(bus.ServiceError) as lost:
            await request
        assert lost.value.code == "timeout" and "lost meanwhile" in str(lost.value), lost.value

        # Without a restart the same request waits for its timeout, and says so.
        with pytest.raises(bus.ServiceError) as waited:
            await bus.request(requester, "test.held", Ack(), timeout_s=1.0)
        assert "within 1.0s" in str(waited.value)
    finally:
        await requester.close()
        await responder.close()
