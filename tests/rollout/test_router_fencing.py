"""One active router, fenced: a router stopped (SIGSTOP) past its lease is replaced by the warm
standby, and when it wakes (SIGCONT) nothing it sends is accepted; every request completes
token-exact.

The old router's own discipline (it acts only inside its lease window) would keep it quiet on its
own. The test therefore also speaks *as* the old incarnation, straight to the store and the
workers, which must refuse it whatever the router does: an append after the successor's claim
(`fenced` from JetStream's expected-last-subject-sequence) and a dispatch (`fenced` from the
worker). Mutation checks, each run by hand: without the expected-sequence header the stale append
lands, and without `Worker.fence` the stale dispatch is queued; either fails the test.
"""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    Dispatch,
    GenerateRequest,
    LogChunk,
    LogEnd,
    LogTakeover,
    ProcessEvent,
    RouterStarted,
    SamplingParams,
)
from tests.rollout.test_worker_faults import make_job, run
from tests.support import EventLog, Job, Output, kill, poll, reference_outputs, running_cluster

K = 16
TTL_S = 1.0


async def test_a_router_stopped_past_its_lease_is_fenced_and_requests_stay_exact(
    nats_server, tmp_path, seed
) -> None:
    rng = random.Random(seed)
    options = {"engines": 2, "chunk_tokens": K, "standby_routers": 1, "lease_ttl_s": TTL_S}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        started = await EventLog.start(cluster.client, "router_started")
        js = cluster.client.nc.jetstream()
        holder = await lease_holder(js, cluster.client.subjects)
        assert holder is not None
        old, old_pid = holder.incarnation, holder.pid
        assert old >= 1 and (await cluster.client.status()).incarnation == old
        old_name = next(n for n, c in cluster.supervisor.children.items() if c.pid == old_pid)

        jobs: list[Job] = [make_job(rng, f"fence-{i}", max_tokens=400) for i in range(6)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: mid_stream(cluster.client), timeout_s=60)
        await asyncio.sleep(rng.uniform(0, 0.1))
        kill(old_pid, signal.SIGSTOP)
        stopped_at = asyncio.get_running_loop().time()
        try:
            successor = await started.wait_for(
                lambda e: isinstance(e, RouterStarted) and e.incarnation > old, timeout_s=30
            )
            assert isinstance(successor, RouterStarted) and successor.router_pid != old_pid
            # It took over only once the lease had run out: a TTL after the last renewal, which
            # came at most a third of a TTL (and a round trip) before the stop.
            assert asyncio.get_running_loop().time() - stopped_at >= TTL_S / 2
            await asyncio.sleep(rng.uniform(0, 0.5))  # wake it while requests still run
        finally:
            kill(old_pid, signal.SIGCONT)
        results = await asyncio.gather(*running)

        # Speaking as the old incarnation, straight to the workers and the store.
        status = await cluster.client.status()
        assert status.incarnation == successor.incarnation
        engine = status.engines[0]
        stale = Dispatch(
            request_id="from-the-old-router",
            attempt=(old << 32) + 1,
            epoch=engine.epoch,
            engine_id=engine.engine_id,
            prompt_tokens=[1, 2, 3],
            max_tokens=4,
            sampling=SamplingParams(seed=1),
            reply_to=cluster.client.subjects.worker_stream(engine.engine_id),
            incarnation=old,
        )
        with pytest.raises(ServiceError) as refused:
            await bus.request(
                cluster.client.nc, cluster.client.subjects.worker_dispatch(engine.engine_id), stale, 5
            )
        assert refused.value.code == "fenced", refused.value

        records = await subject_records(js, cluster.client.subjects)
        claimed = [
            (request_id, sequence)
            for request_id, entries in records.items()
            for sequence, record in entries
            if isinstance(record, LogTakeover) and record.incarnation == successor.incarnation
        ]
        assert claimed, "the successor claimed no request"
        request_id, claim_sequence = claimed[0]
        before_claim = max(s for s, _ in records[request_id] if s < claim_sequence)
        late = LogChunk(
            request_id=request_id, index=999, position=999 * K, tokens=[1], attempt=1, incarnation=old
        )
        with pytest.raises(ServiceError) as fenced:
            await token_log.append(js, cluster.client.subjects, late, before_claim, incarnation=old)
        assert fenced.value.code == "fenced", fenced.value

    # The old router found its lease taken and stopped; the supervisor restarted it.
    log_text = (tmp_path / "logs" / f"{old_name}.log").read_text()
    assert f"router incarnation {old} lost its lease" in log_text

    expected = reference_outputs(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert Output(result.tokens, result.logprobs) == expected[job.request_id], job.request_id

    # Nothing the old incarnation wrote follows a successor's claim on the same subject.
    for request_id, entries in records.items():
        claims = [s for s, r in entries if isinstance(r, LogTakeover) and r.incarnation > old]
        if not claims:
            continue
        after = [r for s, r in entries if s > claims[0] and isinstance(r, LogChunk | LogEnd)]
        assert all(r.incarnation > old for r in after), (request_id, after)


async def test_a_killed_router_whose_supervisor_reports_its_exit_is_replaced_at_once(
    nats_server, tmp_path, seed
) -> None:
    """With a lease TTL of 60 s, SIGKILL the lease holder mid-stream: its supervisor reaps it and
    reports the exit, the standby takes the lease at once instead of after the TTL, and every
    request completes token-exact. A report of another process's exit, or of an earlier start
    under the holder's pid, frees nothing. Mutation, run by hand: with the report ignored
    (`Lease.on_process` doing nothing), no successor starts within the 20 s waited."""
    rng = random.Random(seed)
    options = {"engines": 2, "chunk_tokens": K, "standby_routers": 1, "lease_ttl_s": 60.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        subjects = cluster.client.subjects
        started = await EventLog.start(cluster.client, "router_started")
        js = cluster.client.nc.jetstream()
        holder = await lease_holder(js, subjects)
        assert holder is not None and holder.instance  # the supervisor's token for this start
        bystander = next(c for c in cluster.supervisor.children.values() if c.pid != holder.pid)
        for report in (
            ProcessEvent(name=bystander.name, pid=bystander.pid, instance=bystander.instance, state="exited"),
            ProcessEvent(name="router", pid=holder.pid, instance="an-earlier-start", state="exited"),
        ):
            await bus.publish(cluster.client.nc, subjects.event("process", report.name), report)

        jobs: list[Job] = [make_job(rng, f"exit-{i}", max_tokens=400) for i in range(6)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: mid_stream(cluster.client), timeout_s=60)
        still = await lease_holder(js, subjects)
        assert still is not None and still.incarnation == holder.incarnation  # the bystander freed nothing
        await asyncio.sleep(rng.uniform(0, 0.1))
        kill(holder.pid, signal.SIGKILL)
        successor = await started.wait_for(
            lambda e: isinstance(e, RouterStarted) and e.incarnation > holder.incarnation, timeout_s=20
        )
        assert isinstance(successor, RouterStarted) and successor.router_pid != holder.pid
        results = await asyncio.gather(*running)

    expected = reference_outputs(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert Output(result.tokens, result.logprobs) == expected[job.request_id], job.request_id


async def mid_stream(client) -> bool | None:  # type: ignore[no-untyped-def]
    status = await client.status()
    return True if status.requests and all(K < r.num_tokens < 300 for r in status.requests) else None


async def subject_records(js, subjects) -> dict[str, list[tuple[int, protocol.LogRecord]]]:  # type: ignore[no-untyped-def]
    """Every record of the token log, by request, with its stream sequence."""
    decoder = protocol.decoder_for(protocol.LogRecord)
    info = await js.stream_info(subjects.token_log_stream)
    found: dict[str, list[tuple[int, protocol.LogRecord]]] = {}
    sub = await js.subscribe(subjects.token_log_all, stream=subjects.token_log_stream, ordered_consumer=True)
    try:
        for _ in range(info.state.messages):
            msg = await sub.next_msg(timeout=5)
            record = protocol.decode(decoder, msg.data)
            found.setdefault(record.request_id, []).append((msg.metadata.sequence.stream, record))
    finally:
        await sub.unsubscribe()
    return found


async def test_a_request_a_later_router_claimed_is_answered_not_leader(nats_server, tmp_path) -> None:
    """A router that wakes late and finds the request it is asked for claimed by a later
    incarnation answers `not-leader`, which the client retries towards that router; it used to
    answer `fenced`, which ended the client's call (the fault campaign's unfinished generations).
    Mutation check: without the mapping in `on_generate` the code is `fenced`."""
    async with running_cluster(nats_server, tmp_path, engines=1) as cluster:
        js = cluster.client.nc.jetstream()
        later = (await cluster.client.status()).incarnation + 1
        claim = LogTakeover(request_id="claimed-later", incarnation=later, position=0)
        await token_log.append(js, cluster.client.subjects, claim, 0, incarnation=later)
        request = GenerateRequest(
            request_id="claimed-later", prompt="hello", max_tokens=4,
            sampling=SamplingParams(seed=1), reply_to=cluster.client.nc.new_inbox(),
        )  # fmt: skip
        with pytest.raises(ServiceError) as refused:
            await bus.request(
                cluster.client.nc, cluster.client.subjects.router_generate(cluster.client.client), request, 5
            )
        assert refused.value.code == "not-leader", refused.value
        assert f"router incarnation {later} claimed claimed-later" in refused.value.message
        # The router serves on: another request completes.
        result = await cluster.client.generate_all("still serving", max_tokens=8, seed=2)
        assert len(result.tokens) == 8
