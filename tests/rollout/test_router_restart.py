"""SIGKILL (or a SIGTERM drain) of the router mid-stream: the supervisor restarts it, it rebuilds
the in-flight requests from the JetStream token log, and adopts from the workers the sequences they
still run, so no token is generated again; clients re-attach and see one exact stream. A drained router stops intake and flushes its log, and leaves its requests to the
successor the same way."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from belayer_rl.shared.protocol import RequestResumed, RouterStarted
from tests.rollout.test_worker_faults import make_job, run
from tests.support import EventLog, Job, Output, kill, reference_outputs, running_cluster

K = 16


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm-drain"])
async def test_router_stopped_midstream_resumes_token_exact(nats_server, tmp_path, seed, sig) -> None:
    rng = random.Random(seed)
    async with running_cluster(nats_server, tmp_path, engines=2, chunk_tokens=K) as cluster:
        resumed = await EventLog.start(cluster.client, "request_resumed")
        started = await EventLog.start(cluster.client, "router_started")
        # No request may end early (an end-of-sequence token): with every one still 100 tokens or
        # more from its end at the stop, the stop is mid-stream however fast the engines are.
        jobs: list[Job] = [make_job(rng, f"rr-{i}", max_tokens=400, min_tokens=400) for i in range(6)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        async with asyncio.timeout(60):
            while True:
                status = await cluster.client.status()
                if len(status.requests) == len(jobs) and all(K < r.num_tokens < 300 for r in status.requests):
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(random.Random(seed).uniform(0, 0.1))
        router_pid = cluster.pid_of("router")
        status = await cluster.client.status()  # the last view before the kill
        kill(router_pid, sig)
        seen_at_kill = {r.request_id: r.num_tokens for r in status.requests}
        results = await asyncio.gather(*running)
        restart = await started.wait_for(lambda e: isinstance(e, RouterStarted))

    assert cluster.pid_of("router") != router_pid
    assert isinstance(restart, RouterStarted)
    assert restart.resumed_requests >= 1
    expected = reference_outputs(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert Output(result.tokens, result.logprobs) == expected[job.request_id], job.request_id
    for request_id, had in seen_at_kill.items():
        resumes = [e for e in resumed.events if isinstance(e, RequestResumed) and e.request_id == request_id]
        if not resumes:
            continue  # it finished before the router died
        # The workers lived: the new router adopted what they held, and nothing was generated again.
        assert resumes[0].reason == "adopt", resumes[0]
        assert resumes[0].from_position >= had, (
            f"{request_id}: adopted at {resumes[0].from_position}, had {had}"
        )
