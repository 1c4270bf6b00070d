"""A request whose client is gone is cancelled; one whose client follows it is kept, however long
it waits. Real nats-server, router and worker; the worker is held with SIGSTOP so that both
requests outlive the router's client timeout."""

from __future__ import annotations

import asyncio
import random
import signal

from belayer_rl.shared import bus, protocol, tokenizer
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import GenerateEnd, GenerateRequest
from belayer_rl.shared.subjects import Subjects
from tests.rollout.test_worker_faults import make_job, run
from tests.support import kill, reference_tokens, running_cluster

NAMES = Subjects()  # the default cluster's names

CLIENT_TIMEOUT_S = 2.0


async def test_abandoned_request_is_cancelled_followed_one_completes(nats_server, tmp_path) -> None:
    rng = random.Random(3)
    options = {"engines": 1, "client_timeout_s": CLIENT_TIMEOUT_S, "no_worker_deadline_s": 120.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        worker = cluster.pid_of("worker-e0")
        kill(worker, signal.SIGSTOP)
        try:
            # Left by a client that died right after submitting: nobody follows it.
            abandoned = GenerateRequest(
                request_id="abandoned", prompt="hello", max_tokens=64, reply_to="_INBOX.gone"
            )
            await bus.request(cluster.client.nc, NAMES.router_generate("cli"), abandoned, 5.0)
            followed = make_job(rng, "followed", max_tokens=64)
            # Its client re-attaches only after a long silence, so keepalives alone show it is there.
            follower = await bus.connect(nats_server.url, "follower")
            async with Client(follower, stall_s=60.0, keepalive_s=0.3) as client:
                running = asyncio.create_task(run(client, followed))
                await asyncio.sleep(2.5 * CLIENT_TIMEOUT_S)  # both wait: the only worker is stopped
                kill(worker, signal.SIGCONT)
                result = await running
        finally:
            kill(worker, signal.SIGCONT)
        end = await first_end(cluster.client, "abandoned")

    assert isinstance(end, GenerateEnd) and end.finish_reason == "cancelled"
    assert end.num_tokens == 0
    assert result.tokens == reference_tokens([followed])["followed"]
    assert tokenizer.decode(result.tokens) == result.text


async def first_end(client: Client, request_id: str) -> protocol.Message:
    """Attach and return the request's end message."""
    async for item in client.attach(request_id):
        if isinstance(item, GenerateEnd):
            return item
    raise AssertionError(f"{request_id}: no end")
