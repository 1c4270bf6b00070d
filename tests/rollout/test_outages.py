"""Outages: every worker gone past the deadline, and nats-server killed and restarted under load."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from belayer_rl.shared import protocol
from belayer_rl.shared.client import Client, GenerationError
from belayer_rl.shared.protocol import LogEnd, WorkerFailed
from belayer_rl.shared.subjects import Subjects
from tests.rollout.test_worker_faults import make_job, run
from tests.support import EventLog, busy_requests, kill, poll, reference_tokens, running_cluster

NAMES = Subjects()  # the default cluster's names


async def log_end(client: Client, request_id: str) -> LogEnd | None:
    """The end record of a request's token log, read straight from JetStream; None before it."""
    js = client.nc.jetstream()
    msg = await js.get_last_msg(NAMES.token_log_stream, NAMES.token_log(request_id))
    record = protocol.decode(protocol.decoder_for(protocol.LogRecord), msg.data)
    return record if isinstance(record, LogEnd) else None


async def test_all_workers_dead_typed_error_after_deadline(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    deadline_s = 2.0
    async with running_cluster(
        nats_server, tmp_path, engines=1, heartbeat_timeout_s=0.5, no_worker_deadline_s=deadline_s
    ) as cluster:
        failures = await EventLog.start(cluster.client, "worker_failed")
        jobs = [make_job(rng, f"orphan-{i}", max_tokens=400) for i in range(6)]  # some may end early
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: busy_requests(cluster.client, 0, 300))
        pid = await cluster.engine_pid("e0")
        kill(pid, signal.SIGSTOP)  # hung, so the supervisor does not restart it: no engine at all
        try:
            await failures.wait_for(lambda e: isinstance(e, WorkerFailed) and e.pid == pid)
            loop = asyncio.get_running_loop()
            failed_at = loop.time()
            # Which were stranded mid-decode is known only now: one may have ended just before.
            stranded = [r.request_id for r in (await cluster.client.status()).requests if r.num_tokens]
            assert stranded, "every request ended before the only worker hung"
            with pytest.raises(GenerationError) as raised:
                await running[[j.request_id for j in jobs].index(stranded[0])]
            waited = loop.time() - failed_at
            end = await poll(lambda: log_end(cluster.client, stranded[0]), timeout_s=10)
        finally:
            kill(pid, signal.SIGCONT)
        await asyncio.gather(*running, return_exceptions=True)

    assert raised.value.error.code == "no-workers"
    assert waited >= deadline_s * 0.9
    assert end.finish_reason == "error" and end.error_code == "no-workers"
    assert end.num_tokens == raised.value.error.num_tokens > 0


async def test_nats_server_restart_under_load_token_exact(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    async with running_cluster(nats_server, tmp_path, engines=2, chunk_tokens=32) as cluster:
        jobs = [make_job(rng, f"nr-{i}", max_tokens=400) for i in range(6)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: busy_requests(cluster.client, 40, 300))
        await nats_server.restart(down_s=rng.uniform(0.2, 1.0))
        results = await asyncio.gather(*running)
        await cluster.client.wait_for_engines(2, 30)  # the services reconnected

    expected = reference_tokens(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert result.tokens == expected[job.request_id], job.request_id
