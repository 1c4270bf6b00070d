"""The token log and the router's budget against misbehaving writers: a short tail chunk and a later
whole chunk of the same index do not dedupe each other into a shorter log, and no worker can make
the router accept a token past a request's max_tokens."""

from __future__ import annotations

import asyncio

from belayer_rl.services.router import token_log
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import LogChunk, LogEnd, LogStart, SamplingParams
from tests.support import NAMES, running_cluster


async def test_a_tail_chunk_and_the_whole_chunk_of_its_index_are_both_kept(nats_server) -> None:
    """Chunk 1 (k=4) is first logged as a 2-token tail when the request ends; the request is resumed
    after all (its end was lost) and chunk 1 is logged again, whole. Mutation check: with the dedupe
    id `<request>:<index>` the whole chunk is dropped as a duplicate and the log reads 6 tokens."""
    nc = await bus.connect(nats_server.url, "test-log")
    try:
        js = nc.jetstream()
        await bus.declare_jetstream(js, NAMES)
        start = LogStart(request_id="tail", prompt_tokens=[1], max_tokens=8, sampling=SamplingParams(),
                         chunk_tokens=4)  # fmt: skip
        records = [
            start,
            LogChunk(request_id="tail", index=0, position=0, tokens=[10, 11, 12, 13], attempt=1),
            LogChunk(
                request_id="tail", index=1, position=4, tokens=[14, 15], attempt=1
            ),  # the tail, at an end
            LogChunk(
                request_id="tail", index=1, position=4, tokens=[14, 15, 16, 17], attempt=2
            ),  # resumed: whole
            LogChunk(request_id="tail", index=1, position=4, tokens=[14, 15, 16, 17], attempt=2),  # a retry
            LogEnd(request_id="tail", finish_reason="length", num_tokens=8, resumes=1),
        ]
        after = 0
        for record in records:
            after = await token_log.append(js, NAMES, record, after, incarnation=0)
        info = await js.stream_info(NAMES.token_log_stream)
        logged, skipped = await token_log.read_all(js, NAMES)
    finally:
        await nc.close()
    assert skipped == [] and info.state.messages == 5  # the retried append was deduplicated
    assert logged["tail"].tokens == [10, 11, 12, 13, 14, 15, 16, 17]


async def test_no_token_is_accepted_past_max_tokens(nats_server, tmp_path) -> None:
    """The engine's current attempt, answered by an impostor on the engine's stream subject (the
    open test bus lets it) with 40 tokens more than the request may have. Mutation check: without
    the router's cap the client receives 64 tokens."""
    async with running_cluster(nats_server, tmp_path, engines=1) as cluster:
        nc = cluster.client.nc
        overran = asyncio.Event()

        async def overrun(msg) -> None:  # type: ignore[no-untyped-def]
            dispatch = protocol.decode(protocol.decoder_for(protocol.Dispatch), msg.data)
            if dispatch.request_id != "overrun":
                return
            n = dispatch.max_tokens + 40
            chunk = protocol.WorkerFrame(epoch=dispatch.epoch, engine_id=dispatch.engine_id, seqs=[
                protocol.FrameSeq(dispatch.request_id, dispatch.attempt, 0, [65] * n, [-0.5] * n)
            ])  # fmt: skip
            await bus.publish(nc, NAMES.worker_stream(dispatch.engine_id), chunk)
            overran.set()

        sub = await nc.subscribe(NAMES.worker_dispatch("e0"), cb=overrun)
        try:
            result = await cluster.client.generate_all("x", max_tokens=24, seed=3, request_id="overrun")
        finally:
            await sub.unsubscribe()
        assert overran.is_set()
        assert len(result.tokens) == 24 and result.finish_reason == "length"
        after = await cluster.client.generate_all("x", max_tokens=8, seed=3)  # the router serves on
        assert len(after.tokens) == 8
