"""The router's metrics through real failures: a worker SIGKILLed mid-generation, and the router
itself SIGKILLed while a client follows a request.

Exactness is checked against what the client saw: tokens generated equal the tokens the clients
received, one resume per interruption (the `resumes` of each GenerateEnd), one time-to-next-token
observation per interrupted request that got a token again. The mutation check: a scrape taken
after tokens flowed but before the fault meets none of the fault's expectations.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from belayer_rl.shared import bus, protocol
from belayer_rl.shared.protocol import (
    AttachRequest,
    GenerateEnd,
    GenerateRequest,
    LogTakeover,
    RequestResumed,
    RouterStarted,
    SamplingParams,
    TokenChunk,
)
from tests.metrics.scrape import Moved, Scrape, assert_moved_exactly, metrics_port, scrape, wrong
from tests.rollout.test_router_fencing import subject_records
from tests.rollout.test_worker_faults import make_job, run
from tests.support import EventLog, Job, busy_requests, kill, poll, reference_tokens, running_cluster

NEXT_TOKEN = "belayer_router_resume_next_token_seconds_count"


def long_jobs(rng: random.Random, n: int, max_tokens: int, at_least: int) -> list[Job]:
    """Jobs whose fault-free runs do not end (EOS) before `at_least` tokens: random weights sample
    EOS now and then, and a fault must find its requests still running. Candidates are run as one
    batch (the engine's tokens do not depend on the batch)."""
    jobs: list[Job] = []
    while len(jobs) < n:
        candidates = [make_job(rng, f"c{i}", max_tokens) for i in range(20 * n)]
        reference = reference_tokens(candidates)
        jobs += [j for j in candidates if len(reference[j.request_id]) >= at_least]
    return [dataclasses.replace(job, request_id=f"m{i}") for i, job in enumerate(jobs[:n])]


async def test_worker_sigkill_moves_router_counters_by_exactly_the_fault(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    jobs = long_jobs(rng, 6, max_tokens=400, at_least=150)
    # The exit is reported at once; a heartbeat timeout on a loaded machine would add resumes of
    # another cause that this test did not inject.
    options = {"engines": 2, "chunk_tokens": 32, "heartbeat_timeout_s": 10.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        port = await metrics_port(cluster.client.nc, "router")
        resumed = await EventLog.start(cluster.client, "request_resumed")
        before = await scrape(port)
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        busy = await poll(lambda: busy_requests(cluster.client, 20, 100))
        pre_fault = await scrape(port)
        engine_id = busy[0].engine_id
        kill(await cluster.engine_pid(engine_id))
        results = await asyncio.gather(*running)
        after = await scrape(port)

    resumes = sum(r.resumes for r in results)
    assert resumes >= 1, "the kill interrupted nothing"
    last_resume = {e.request_id: e.from_position for e in resumed.events if isinstance(e, RequestResumed)}
    got_a_token_again = sum(
        1 for r in results if r.request_id in last_resume and len(r.tokens) > last_resume[r.request_id]
    )
    received = sum(len(r.tokens) for r in results)
    fault = [
        Moved.of("belayer_router_resumes_total", resumes, cause="worker-exit"),
        Moved.of("belayer_router_resumes_total", resumes),  # no other cause
        Moved.of(NEXT_TOKEN, got_a_token_again, cause="worker-exit"),
    ]
    flow = [
        Moved.of("belayer_router_requests_total", len(jobs)),
        Moved.of("belayer_router_request_ends_total", len(jobs)),
        Moved.of("belayer_router_tokens_generated_total", received),
        Moved.of("belayer_router_tokens_accepted_total", received),  # nothing came twice...
        Moved.of("belayer_router_tokens_regenerated_total", 0),  # ...as a resume sends every token
        Moved.of("belayer_errors_total", 0),
    ]
    assert_moved_exactly(before, after, fault + flow)
    # The mutation check: before the fault, none of its counters had moved.
    assert all(wrong(before, pre_fault, [e]) for e in fault if e.by), "fault counters moved before the fault"
    assert pre_fault.get("belayer_router_tokens_generated_total") > before.get(
        "belayer_router_tokens_generated_total"
    )
    assert after.get("belayer_router_resume_next_token_seconds_sum", cause="worker-exit") > 0
    expected = reference_tokens(jobs)
    assert all(r.tokens == expected[j.request_id] for j, r in zip(jobs, results, strict=True))


@pytest.mark.parametrize("worker_too", [False, True], ids=["router", "router-and-worker"])
async def test_router_sigkill_counts_what_the_client_gets_again(nats_server, tmp_path, worker_too) -> None:
    """A client that had N tokens re-attaches to the restarted router at N.

    With the worker alive the new router adopts what it holds, W >= N tokens: nothing is generated
    again, and the positions past the log's L are new to it. With the worker killed as well, the
    new router rebuilt L <= N from the token log, so it produces positions L..N-1 again:
    regenerated == N - L."""
    job = dataclasses.replace(long_jobs(random.Random(7), 1, 380, at_least=200)[0], request_id="restart-1")
    async with running_cluster(nats_server, tmp_path, engines=1, chunk_tokens=16) as cluster:
        nc = cluster.client.nc
        started = await EventLog.start(cluster.client, "router_started")
        resumed = await EventLog.start(cluster.client, "request_resumed")
        tokens: dict[int, int] = {}  # position -> token, from every chunk the inbox got
        ended = asyncio.Event()
        stream = protocol.decoder_for(protocol.ClientStream)

        async def on_chunk(msg) -> None:  # type: ignore[no-untyped-def]
            item = protocol.decode(stream, msg.data)
            if isinstance(item, TokenChunk):
                tokens.update(enumerate(item.tokens, start=item.position))
            elif isinstance(item, GenerateEnd):
                ended.set()

        async def received(at_least: int) -> bool | None:
            return True if len(tokens) >= at_least else None

        inbox = nc.new_inbox()
        await nc.subscribe(inbox, cb=on_chunk)
        request = GenerateRequest(
            request_id=job.request_id,
            prompt=job.prompt,
            max_tokens=job.max_tokens,
            sampling=SamplingParams(seed=job.seed, temperature=job.temperature),
            reply_to=inbox,
        )
        await bus.request(nc, cluster.client.subjects.router_generate(cluster.client.client), request, 5.0)
        await poll(lambda: received(40))
        old_router = cluster.pid_of("router")
        if worker_too:
            kill(cluster.pid_of("worker-e0"))
        kill(old_router)
        await asyncio.sleep(0.5)  # chunks already in flight land; the dead router sends no more
        had = len(tokens)
        assert sorted(tokens) == list(range(had))  # contiguous: what a client re-attaches with
        restart = await started.wait_for(
            lambda e: isinstance(e, RouterStarted) and e.router_pid != old_router
        )
        port = await metrics_port(nc, "router")
        attach = AttachRequest(request_id=job.request_id, from_position=had, reply_to=inbox)
        await bus.request(nc, cluster.client.subjects.router_attach(cluster.client.client), attach, 5.0)
        await asyncio.wait_for(ended.wait(), 60)
        after = await scrape(port)
        records = await subject_records(nc.jetstream(), cluster.client.subjects)

    logged = next(r for _, r in records[job.request_id] if isinstance(r, LogTakeover)).position
    carried = next(e for e in resumed.events if isinstance(e, RequestResumed))
    assert restart.resumed_requests == 1
    if worker_too:
        assert carried.reason == "resume" and carried.from_position == logged
        assert logged <= had and logged % 16 == 0, (logged, had)
    else:
        assert carried.reason == "adopt" and carried.from_position >= had, (carried, had)
    assert [tokens[i] for i in range(len(tokens))] == reference_tokens([job])[job.request_id]
    assert_moved_exactly(
        Scrape({}),  # a new process: its counters started at zero
        after,
        [
            Moved.of("belayer_router_resumes_total", 1, cause="router-restart"),
            Moved.of("belayer_router_resumes_total", 1),
            Moved.of("belayer_router_tokens_regenerated_total", had - logged if worker_too else 0),
            Moved.of("belayer_router_tokens_generated_total", len(tokens) - logged),
            Moved.of(NEXT_TOKEN, 1, cause="router-restart"),
        ],
    )
