"""The fault campaign (`belayer chaos`) and its oracle.

The campaign test runs 200 seeded faults of every kind against a cluster like `belayer up`'s
while generations and sandbox trajectories run, and requires no violation and no leak, but for the
one finding still open (OPEN_FINDING), which it reports as an expected failure. The mutation test
shows the oracle can fail: with the router's debug flag that accepts stale attempts, a late chunk
of a superseded attempt gets into the log, and the oracle must say so; without the flag, the same
chunk is dropped and it has nothing to report.
"""

from __future__ import annotations

import asyncio
import random
import signal
from pathlib import Path

import pytest

from belayer_rl.cli.chaos.campaign import render, run_campaign
from belayer_rl.cli.chaos.config import FAULT_KINDS, ChaosConfig
from belayer_rl.cli.chaos.oracle import check_token_log
from belayer_rl.cli.chaos.workload import TRAJECTORY_DEADLINE_S, Output, reference_outputs
from belayer_rl.services.router import token_log
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import (
    FrameSeq,
    LogChunk,
    LogEnd,
    LogStart,
    RequestResumed,
    SamplingParams,
    WorkerFrame,
)
from tests.rollout.test_worker_faults import make_job, run
from tests.support import NAMES, EventLog, busy_requests, kill, poll, running_cluster

MIN_HITS = 3  # in-flight requests or trajectories each fault kind must strike over the campaign
# Acknowledged checkpoints that CRIU would not restore were the campaign's most frequent finding:
# a quick action's timeout watcher outlived it, outside the restored sandbox's time namespace
# (tests/checkpointer/test_restore_twice.py), fixed. Once, a checkpoint whose restored init died at
# once was seen as well, and not explained. A run that shows a restore giving an older checkpoint
# than the one acknowledged is reported as an expected failure naming it; any other violation, or
# any leak, fails the test.
OPEN_FINDING = "was acknowledged, the restore gave"
# The bound is 15 minutes for 200 faults. The test's own bound adds what comes after the
# faults, each step bounded on its own: the work in flight ending (a trajectory's deadline, 240 s)
# and the checks. On CI's 2 cores the faults alone once took 732 s, and a bound of 900 s for it
# all ended that run with a timeout rather than with the summary that says what was slow.
TIME_BOUND_S = 900 + TRAJECTORY_DEADLINE_S + 120


async def print_tasks_after(seconds: float) -> None:
    """Shortly before the time bound, print where every task waits, a line per frame of this
    project's code (pytest-timeout's dump shows threads, and an event loop's thread shows only its
    select; the frames of pytest and the libraries would push the campaign's own report of what is
    still in flight out of CI's excerpt)."""
    await asyncio.sleep(seconds)
    print(f"--- still running after {seconds:.0f}s; every task's frames in this project:")
    for task in asyncio.all_tasks():
        frames = [
            f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
            for f in task.get_stack()
            if "site-packages" not in f.f_code.co_filename and "asyncio" not in f.f_code.co_filename
        ]
        if frames:
            print(f"{task.get_name()}: {' < '.join(reversed(frames))}")


@pytest.mark.slow
@pytest.mark.timeout(TIME_BOUND_S)
async def test_two_hundred_faults_leave_no_violation_and_nothing_leaked(docker_env, tmp_path, seed) -> None:
    config = ChaosConfig(state_dir=tmp_path / "campaign", faults=200, seed=seed, kinds=FAULT_KINDS)
    watchdog = asyncio.create_task(print_tasks_after(TIME_BOUND_S - 120))  # fixtures count too
    try:
        summary = await run_campaign(config)
    finally:
        watchdog.cancel()
    print(render(summary))
    if not summary.passed:  # what a failed CI run needs to be understood: the services' complaints
        for log in sorted((config.state_dir / "logs").glob("*.log")):
            complaints = [
                line
                for line in log.read_text(errors="replace").splitlines()
                if " WARNING " in line or " ERROR " in line
            ]
            print(f"--- {log.name}: last warnings and errors", *complaints[-15:], sep="\n")
        for criu_log in sorted((config.state_dir / "logs" / "criu").glob("*.log"))[:3]:
            print(
                f"--- {criu_log.name}: its errors",
                *[line for line in criu_log.read_text(errors="replace").splitlines() if "Error" in line],
                sep="\n",
            )
    open_finding = [v for v in summary.violations if OPEN_FINDING in v]
    assert [v for v in summary.violations if v not in open_finding] == []
    assert summary.leaks == []
    assert sum(summary.faults.values()) == 200
    assert summary.faults.get("nats-restart", 0) <= config.nats_restarts
    for kind in FAULT_KINDS:
        assert summary.hits.get(kind, 0) >= MIN_HITS, f"{kind} struck {summary.hits.get(kind, 0)} in flight"
    assert summary.recoveries["sandbox-restore"] >= 1
    assert summary.generations_completed >= 0.95 * summary.generations
    if open_finding:
        pytest.xfail(f"the open finding, {len(open_finding)} times: {open_finding[:2]}")


@pytest.mark.parametrize("accept_stale", [False, True], ids=["router-as-built", "router-accepts-stale"])
async def test_the_oracle_catches_a_router_that_accepts_a_stale_attempt(
    nats_server, tmp_path, seed, accept_stale: bool
) -> None:
    """Stop worker A mid-decode; once its request is resumed on B, stop B too, and let A's attempt
    send its next tokens, ahead of B's. A real worker drops its attempt at the router's cancel, so
    the late chunk is published by the test under A's subject and attempt: it stands for a cancel
    that was lost, a fault that cannot be made on demand. Its tokens are the right ones; only the
    attempt that sent them is stale, which only the log's records show."""
    rng = random.Random(seed)
    options = {"chunk_tokens": 16, "heartbeat_timeout_s": 1.0, "debug_accept_stale": accept_stale}
    # EOS held back past where the late chunk goes: a request that ends first leaves it no room
    jobs = [make_job(rng, f"stale-{i}", max_tokens=400, min_tokens=300) for i in range(4)]
    expected = reference_outputs(jobs)
    async with running_cluster(nats_server, tmp_path, engines=2, **options) as cluster:
        resumed = await EventLog.start(cluster.client, "request_resumed")
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        busy = await poll(lambda: busy_requests(cluster.client, 20, 120))
        first = busy[0]
        engines = {e.engine_id: e for e in (await cluster.client.status()).engines}
        a = engines[first.engine_id or ""]
        kill(a.pid, signal.SIGSTOP)
        moved = await resumed.wait_for(
            lambda e: isinstance(e, RequestResumed) and e.request_id == first.request_id
        )
        assert isinstance(moved, RequestResumed)
        b = await cluster.engine_pid(moved.engine_id)
        kill(b, signal.SIGSTOP)
        have = await settled_count(cluster.client, first.request_id)
        want = expected[first.request_id]
        late = WorkerFrame(epoch=a.epoch, engine_id=a.engine_id, seqs=[FrameSeq(
            first.request_id, first.attempt, have, want.tokens[have : have + 40], want.logprobs[have : have + 40]
        )])  # fmt: skip
        assert len(late.seqs[0].tokens) >= 2 * options["chunk_tokens"], (
            "the late chunk must complete a whole chunk"
        )
        await bus.publish(cluster.client.nc, NAMES.worker_stream(a.engine_id), late)
        await asyncio.sleep(0.2)
        took = next(
            r.num_tokens for r in (await cluster.client.status()).requests if r.request_id == first.request_id
        )
        kill(a.pid, signal.SIGCONT)
        kill(b, signal.SIGCONT)
        results = await asyncio.gather(*running)
        finished = {
            job.request_id: Output(result.tokens, result.logprobs)
            for job, result in zip(jobs, results, strict=True)
        }
        violations = await check_token_log(cluster.client.nc.jetstream(), NAMES, finished)

    assert finished == expected  # the tokens and logprobs alone cannot tell
    if accept_stale:
        caught = [v for v in violations if f"{first.request_id} chunk" in v and "dispatched to" in v]
        assert caught, (f"late chunk at {have}, router then at {took}", violations)
    else:
        assert violations == []


async def settled_count(client: Client, request_id: str) -> int:
    """The router's token count for the request once it stops moving: chunks its stopped workers
    sent before they stopped may still be on their way, and they must land first."""
    counts: list[int] = []
    while len(counts) < 2 or counts[-1] != counts[-2]:
        if counts:
            await asyncio.sleep(0.15)
        status = await client.status()
        counts.append(next(r.num_tokens for r in status.requests if r.request_id == request_id))
    return counts[-1]


async def test_the_oracle_waits_for_an_end_told_before_it_was_durable_but_not_for_one_never_written(
    nats_server,
) -> None:
    """The router tells a client of an end as it queues its LogEnd: the client may finish first.
    The oracle reads the log again while only such an end is missing, and still reports an end
    that never comes (mutation check: with no wait it reports the late one too)."""
    nc = await bus.connect(nats_server.url, "test-oracle")
    try:
        js = nc.jetstream()
        await bus.declare_jetstream(js, NAMES)
        output = Output([3, 1, 4, 1, 5], [-0.5, -1.0, -2.0, -0.25, -3.0])
        after = {}
        for request_id in ("late-end", "no-end"):
            start = LogStart(request_id=request_id, prompt_tokens=[1], max_tokens=5, sampling=SamplingParams(),
                             chunk_tokens=8)  # fmt: skip
            chunk = LogChunk(request_id=request_id, index=0, position=0, tokens=output.tokens,
                             logprobs=output.logprobs, attempt=1)  # fmt: skip
            started = await token_log.append(js, NAMES, start, 0, incarnation=0)
            after[request_id] = await token_log.append(js, NAMES, chunk, started, incarnation=0)
        finished = {"late-end": output, "no-end": output}
        end = LogEnd(request_id="late-end", finish_reason="length", num_tokens=len(output.tokens))

        async def end_later() -> None:
            await asyncio.sleep(1.5)
            await token_log.append(js, NAMES, end, after["late-end"], incarnation=0)

        ending = asyncio.create_task(end_later())
        without_wait = await check_token_log(js, NAMES, finished, end_wait_s=0)
        assert sorted(without_wait) == ["late-end: finished, but its log has no end",
                                        "no-end: finished, but its log has no end"]  # fmt: skip
        with_wait = await check_token_log(js, NAMES, finished, end_wait_s=4)
        await ending
        assert with_wait == ["no-end: finished, but its log has no end"]
        # Mutation: a client that got one logprob other than the log holds.
        changed = Output(output.tokens, [*output.logprobs[:3], -0.2500001, output.logprobs[4]])
        assert await check_token_log(js, NAMES, {"late-end": changed}, end_wait_s=0) == [
            "late-end: the log's logprobs differ from the client's at position 3 (got 5 tokens, want 5)"
        ]
    finally:
        await nc.close()
