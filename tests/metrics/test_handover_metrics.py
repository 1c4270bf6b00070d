"""The shadow supervisor's metrics through real handovers: a main SIGKILLed mid-generation (the
shadow path), then a main SIGKILLed together with the KV server (the cold path), then a second
failure inside the window (a quarantine). Each must move its counters by exactly one, and the
phase histograms must hold exactly the phases the Handover event reports.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from belayer_rl.shared.protocol import EngineQuarantined, Handover
from tests.handover.test_handover import engines, shadow_ready, shadowed
from tests.metrics.scrape import Moved, Scrape, assert_moved_exactly, metrics_port, scrape, wrong
from tests.metrics.test_router_metrics import long_jobs
from tests.rollout.test_worker_faults import run
from tests.support import EventLog, busy_requests, kill, poll, reference_tokens

HANDOVERS = "belayer_handovers_total"
PHASE = "belayer_handover_phase_seconds"
COLD = "belayer_handover_cold_paths_total"
SHADOW_PHASES = ("kill_confirmed", "servers_checked", "arena_flushed", "promoted")


def phases_moved(event: Handover) -> list[Moved]:
    """One observation of each phase the event reports, none of the others."""
    return [
        Moved.of(f"{PHASE}_count", 1 if phase in event.phases_ms else 0, phase=phase)
        for phase in (*SHADOW_PHASES, "cold_started")
    ]


def phase_sums_match(before: Scrape, after: Scrape, event: Handover) -> None:
    for phase, ms in event.phases_ms.items():  # the event rounds to the microsecond
        moved = after.get(f"{PHASE}_sum", phase=phase) - before.get(f"{PHASE}_sum", phase=phase)
        assert moved == pytest.approx(ms / 1000, abs=1e-6), phase


async def test_shadow_and_cold_handovers_move_supervisor_counters_by_one(nats_server, tmp_path, seed) -> None:
    jobs = long_jobs(random.Random(seed), 3, max_tokens=400, at_least=150)
    async with shadowed(nats_server, tmp_path, failure_window_s=0.01) as cluster:
        nc = cluster.client.nc
        handovers = await EventLog.start(cluster.client, "handover")
        first = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        supervisor, router = await metrics_port(nc, "shadow-supervisor"), await metrics_port(nc, "router")
        before, router_before = await scrape(supervisor), await scrape(router)
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: busy_requests(cluster.client, 20, 100))
        pre_fault = await scrape(supervisor)
        kill(first["main"])
        shadow_path = await handovers.wait_for(
            lambda e: isinstance(e, Handover) and e.old_pid == first["main"]
        )
        results = await asyncio.gather(*running)
        after_shadow, router_after = await scrape(supervisor), await scrape(router)

        # The cold path: the KV server that owns the shadow's arena is gone at the handover.
        second = await poll(lambda: shadow_ready(cluster, "e0", {first["main"]}), timeout_s=120)
        kill(cluster.pid_of("kv-server"))
        kill(second["main"])
        cold_path = await handovers.wait_for(
            lambda e: isinstance(e, Handover) and e.old_pid == second["main"]
        )
        after_cold = await scrape(supervisor)

    assert isinstance(shadow_path, Handover) and shadow_path.path == "shadow", shadow_path.cold_reason
    assert isinstance(cold_path, Handover) and cold_path.path == "cold"
    shadow_expected = [
        Moved.of(HANDOVERS, 1, engine="e0", failure="exit", path="shadow"),
        Moved.of(HANDOVERS, 1),
        Moved.of("belayer_handover_duration_seconds_count", 1, path="shadow"),
        Moved.of(COLD, 0),
        Moved.of("belayer_engine_quarantines_total", 0),
        *phases_moved(shadow_path),
    ]
    assert_moved_exactly(before, after_shadow, shadow_expected)
    phase_sums_match(before, after_shadow, shadow_path)
    # The mutation check: before the kill, no handover counter had moved.
    assert all(wrong(before, pre_fault, [e]) for e in shadow_expected if e.by)
    # The router resumed each interrupted request once, whatever told it first (the new epoch).
    resumes = sum(r.resumes for r in results)
    assert resumes >= 1
    assert_moved_exactly(router_before, router_after, [Moved.of("belayer_router_resumes_total", resumes)])
    expected = reference_tokens(jobs)
    assert [r.tokens for r in results] == [expected[j.request_id] for j in jobs]

    cold_expected = [
        Moved.of(HANDOVERS, 1, engine="e0", failure="exit", path="cold"),
        Moved.of(HANDOVERS, 1),
        Moved.of("belayer_handover_duration_seconds_count", 1, path="cold"),
        Moved.of(COLD, 1),  # one reason: the KV server
        Moved.of(COLD, 0, reason="weight-server-down"),
        *phases_moved(cold_path),
    ]
    assert_moved_exactly(after_shadow, after_cold, cold_expected)
    phase_sums_match(after_shadow, after_cold, cold_path)
    kv_reasons = {r: after_cold.get(COLD, reason=r) for r in ("kv-server-down", "kv-server-restarted")}
    assert sum(kv_reasons.values()) == 1, kv_reasons


async def test_second_failure_in_window_counts_one_quarantine(nats_server, tmp_path) -> None:
    """With `quarantine_after` 2, the second failure in a row, right after the shadow took over,
    quarantines e0 (e1 serves, so e0 is not the last healthy engine)."""
    options = {"engines": 2, "failure_window_s": 120, "quarantine_after": 2}
    async with shadowed(nats_server, tmp_path, **options) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        alerts = await EventLog.start(cluster.client, "engine_quarantined")
        first = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        port = await metrics_port(cluster.client.nc, "shadow-supervisor")
        before = await scrape(port)
        kill(first["main"])
        await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == first["main"])
        kill(engines(cluster)["e0"]["main"])
        await alerts.wait_for(lambda e: isinstance(e, EngineQuarantined) and e.engine_id == "e0")
        after = await scrape(port)

    assert_moved_exactly(
        before,
        after,
        [
            Moved.of("belayer_engine_quarantines_total", 1, engine="e0"),
            Moved.of("belayer_engine_quarantines_total", 1),
            Moved.of(HANDOVERS, 1),  # the second failure quarantines instead of handing over
            Moved.of(f"{PHASE}_count", 2, phase="kill_confirmed"),  # both kills were confirmed
        ],
    )
