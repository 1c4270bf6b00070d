"""A lost end of an attempt does not leave a followed request hung: each attempt has a progress
deadline, past which the router resumes the request from the tokens it has.

A lost core-NATS message cannot be made on demand, so the engine here is a stand-in that speaks the
worker's protocol on the real bus, registered in the real registry, beside a real router: its
first attempt streams two tokens, keeps listing the attempt in its heartbeats for a while (as a
worker does for an attempt still queued or decoding), then drops it without telling its end: its end
was lost. The deadline counts only from then. This is the one fake, and it
stands for the fault alone. Mutation check: with the deadline's resume removed from the watchdog,
the generation never ends and the test fails at its timeout.
"""

from __future__ import annotations

import asyncio
import os

from belayer_rl.shared import bus, protocol, registry
from belayer_rl.shared.protocol import (
    Ack,
    Dispatch,
    FrameSeq,
    Heartbeat,
    RequestResumed,
    WorkerFrame,
    WorkerRegistration,
)
from tests.support import EventLog, running_cluster

ENGINE = "ghost"
TOKENS = [104, 105, 33]
DEADLINE_S = 1.0
HELD_S = 2.5  # the first attempt stays listed in the heartbeats this long


async def test_an_attempt_whose_end_was_lost_is_resumed_past_its_progress_deadline(
    nats_server, tmp_path
) -> None:
    async with running_cluster(nats_server, tmp_path, engines=0, progress_deadline_s=DEADLINE_S) as cluster:
        nc, subjects = cluster.client.nc, cluster.client.subjects
        js = nc.jetstream()
        kv = await js.key_value(subjects.engine_registry_bucket)
        pid = os.getpid()
        epoch, _ = await registry.install_worker(kv, ENGINE, pid)
        dispatches: list[Dispatch] = []
        loop = asyncio.get_running_loop()
        arrived: list[float] = []
        decoder = protocol.decoder_for(Dispatch)

        async def on_dispatch(msg) -> None:  # type: ignore[no-untyped-def]
            dispatch = protocol.decode(decoder, msg.data)
            dispatches.append(dispatch)
            arrived.append(loop.time())
            await msg.respond(protocol.encode(Ack(detail="queued")))
            stream = subjects.worker_stream(ENGINE)
            have = len(dispatch.prefix_tokens)
            upto = 2 if len(dispatches) == 1 else len(TOKENS)
            seq = FrameSeq(
                dispatch.request_id, dispatch.attempt, have, TOKENS[have:upto], [-1.0] * (upto - have)
            )
            await bus.publish(nc, stream, WorkerFrame(epoch=epoch, engine_id=ENGINE, seqs=[seq]))
            if len(dispatches) == 1:
                return  # its end is "lost"
            done = FrameSeq(dispatch.request_id, dispatch.attempt, upto, [], [], "length", len(TOKENS))
            await bus.publish(nc, stream, WorkerFrame(epoch=epoch, engine_id=ENGINE, seqs=[done]))

        await nc.subscribe(subjects.worker_dispatch(ENGINE), cb=on_dispatch)

        async def beat() -> None:
            while True:
                held = (
                    [dispatches[0].attempt]
                    if len(dispatches) == 1 and loop.time() < arrived[0] + HELD_S
                    else []
                )
                heartbeat = Heartbeat(engine_id=ENGINE, epoch=epoch, pid=pid, running=len(held), waiting=0,
                                      outstanding_tokens=0, weight_version="ghost-weights", attempts=held)  # fmt: skip
                await bus.publish(nc, subjects.event("heartbeat", ENGINE), heartbeat)
                await asyncio.sleep(0.1)

        beating = asyncio.create_task(beat())
        try:
            registration = WorkerRegistration(engine_id=ENGINE, epoch=epoch, pid=pid, preset="tiny",
                                              weight_version="ghost-weights")  # fmt: skip
            await bus.publish(nc, subjects.event("worker_registered", ENGINE), registration)
            await cluster.client.wait_for_engines(1, 30)
            resumed = await EventLog.start(cluster.client, "request_resumed")
            async with asyncio.timeout(30):
                result = await cluster.client.generate_all(
                    [7, 8, 9], max_tokens=len(TOKENS), weight_version="ghost-weights"
                )
        finally:
            beating.cancel()

    assert result.tokens == TOKENS and result.finish_reason == "length"
    assert len(dispatches) == 2
    # Not resumed while its worker still held it, and resumed about a deadline after it let go.
    assert HELD_S + DEADLINE_S * 0.9 <= arrived[1] - arrived[0] <= HELD_S + DEADLINE_S + 5.0
    assert dispatches[1].prefix_tokens == TOKENS[:2]  # resumed from what it had: nothing regenerated
    assert any(isinstance(e, RequestResumed) for e in resumed.events)
