"""Stored records that do not decode: a service skips them, reports each once (a record_skipped
event and belayer_records_skipped_total{store}) and starts.

The records are real: written into the cluster's own token-log stream (each under an entry of the
request index that says it runs, which is what a takeover reads) and engine registry on a real
nats-server before the cluster starts, as a buggy or hostile writer would leave them. Before
the fix an engine-registry entry that did not decode made every worker of the engine fail its
install, so the engine never served; token-log records were skipped with a log line only. The
mutation check is the same cluster started on clean stores, which reports nothing.
"""

from __future__ import annotations

import random
from pathlib import Path

from belayer_rl.shared import bus, registry
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import LogOpen, RecordSkipped, encode
from belayer_rl.shared.subjects import Subjects
from tests.metrics.scrape import metrics_port, scrape
from tests.rollout.test_worker_faults import make_job, run
from tests.support import Cluster, EventLog, NatsServer, kill, poll, reference_tokens, running_cluster

NAMES = Subjects()
DEEP = b'{"type":"log_start","request_id":"deep","prompt":' + b"[" * 1000 + b"]" * 1000 + b"}"
TRUNCATED = b'{"type":"log_chunk","request_id":"cut","position":0,"tok'
DEEP_ENTRY = b'{"type":"engine","engine_id":"e0","epoch":' + b"[" * 1000 + b"]" * 1000 + b"}"


async def poison(nats: NatsServer) -> int:
    """Write the bad records; the revision of e0's bad entry (after three good installs)."""
    nc = await bus.connect(nats.url, "test-poisoner")
    try:
        js = nc.jetstream()
        kv = await bus.declare_jetstream(js, NAMES)
        for request_id, record in (("deep", DEEP), ("cut", TRUNCATED)):  # indexed as running
            await js.publish(
                NAMES.request_open(request_id), encode(LogOpen(request_id=request_id, owner="cli"))
            )
            await js.publish(NAMES.token_log(request_id), record)
        for _ in range(3):  # epochs 1, 2 and 3: the bad entry hides them
            await registry.install_worker(kv, "e0", 1)
        return await kv.put("e0", DEEP_ENTRY)
    finally:
        await nc.close()


async def run_cluster(nats: NatsServer, tmp_path: Path) -> tuple[list[RecordSkipped], float, int, bool]:
    """Start a cluster, generate once; the record_skipped events, the router's count of skipped
    token-log records, e0's epoch, and whether the generation was exact."""
    watcher = Client(await bus.connect(nats.url, "test-watcher"))
    try:
        skipped = await EventLog.start(watcher, "record_skipped")
        async with running_cluster(nats, tmp_path, engines=1, shadows=True) as cluster:
            job = make_job(random.Random(4), "after-poison", max_tokens=32)
            result = await run(cluster.client, job)
            status = await cluster.client.status()
            counted = (await scrape(await metrics_port(cluster.client.nc, "router"))).get(
                "belayer_records_skipped_total", store="token-log"
            )
        exact = result.tokens == reference_tokens([job])[job.request_id]
        return (
            [e for e in skipped.events if isinstance(e, RecordSkipped)],
            counted,
            status.engines[0].epoch,
            exact,
        )
    finally:
        await watcher.nc.close()


async def test_undecodable_records_are_skipped_reported_and_the_cluster_starts(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    bad_revision = await poison(nats_server)
    events, counted, epoch, exact = await run_cluster(nats_server, tmp_path)

    assert exact  # the router started, the worker serves
    by_store = {(e.store, e.key) for e in events}
    assert ("token-log", NAMES.token_log("deep")) in by_store
    assert ("token-log", NAMES.token_log("cut")) in by_store
    assert ("engine-registry", "e0") in by_store  # the worker's install replaced it
    deep = next(e for e in events if e.key == NAMES.token_log("deep"))
    assert deep.service == "router" and "nested too deeply" in deep.reason
    assert counted == 2  # each record once, however often it was read
    assert epoch > bad_revision > 3  # the epoch the bad entry hid cannot come back


async def test_clean_stores_report_nothing(nats_server: NatsServer, tmp_path: Path) -> None:
    """The mutation check: the same cluster on clean stores reports no skipped record."""
    events, counted, _, exact = await run_cluster(nats_server, tmp_path)
    assert exact and events == [] and counted == 0


async def test_a_restarted_router_meets_the_bad_records_again_and_starts(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The records stay where they are: a router killed and started again skips them again."""
    await poison(nats_server)
    async with running_cluster(nats_server, tmp_path, engines=1, shadows=True) as cluster:
        router = cluster.pid_of("router")
        skipped = await EventLog.start(cluster.client, "record_skipped")
        kill(router)
        await poll(lambda: restarted(cluster, router), timeout_s=60)
        await skipped.wait_for(lambda e: isinstance(e, RecordSkipped) and e.key == NAMES.token_log("deep"))
        job = make_job(random.Random(5), "after-restart", max_tokens=16)
        result = await run(cluster.client, job)
    assert result.tokens == reference_tokens([job])[job.request_id]


async def restarted(cluster: Cluster, old_pid: int) -> bool | None:
    child = cluster.supervisor.children["router"]
    return True if child.pid != old_pid and child.state == "running" else None
