"""Instant rollout-worker restart: the shadow takes over a failed main, reusing weights and arena.

Real processes throughout: nats-server, router, weight server, KV server, shadow supervisor, main
and shadow workers; failures are real SIGKILL and SIGSTOP at seeded random points.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
from pathlib import Path

import pytest

from belayer_rl.services.worker.shadow import INJECT_DEVICE_FAULT_ENV
from belayer_rl.shared import bus
from belayer_rl.shared.protocol import (
    EngineQuarantined,
    EngineRestart,
    EngineRestarted,
    EngineUnquarantine,
    EngineUnstable,
    Handover,
    RequestResumed,
)
from tests.rollout.test_worker_faults import Traffic, make_job, run
from tests.support import Cluster, EventLog, busy_requests, kill, poll, reference_tokens, running_cluster


def engines(cluster: Cluster) -> dict[str, dict[str, int]]:
    path = cluster.supervisor.config.state_dir / "workers" / "engines.json"
    return json.loads(path.read_text()) if path.exists() else {}


async def shadow_ready(cluster: Cluster, engine_id: str, not_pids: set[int]) -> dict[str, int] | None:
    """The engine's pids once a shadow other than `not_pids` stands by."""
    entry = engines(cluster).get(engine_id)
    if entry and entry["shadow"] and entry["shadow"] not in not_pids and entry["main"] not in not_pids:
        return entry
    return None


def shadowed(nats, tmp_path: Path, **options: object):  # type: ignore[no-untyped-def]
    options.setdefault("engines", 1)
    options.setdefault("hang_timeout_s", 3.0)  # a loaded test machine must not look like a hang
    return running_cluster(nats, tmp_path, shadows=True, **options)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.mark.slow
async def test_sigkill_main_at_30_points_shadow_takes_over(nats_server, tmp_path, seed) -> None:
    kills_wanted = 30
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path, failure_window_s=0.01, hang_timeout_s=10.0) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        traffic = Traffic(cluster.client, seed * 10, "h", max_tokens=400).start(4)
        killed: set[int] = set()
        while len(killed) < kills_wanted:
            before = await poll(lambda: shadow_ready(cluster, "e0", killed), timeout_s=120)
            await poll(lambda: busy_requests(cluster.client, 0, 300))
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            if (await cluster.engine_pid("e0")) != before["main"]:
                continue  # replaced meanwhile (a starved main can look hung): draw again
            kill(before["main"])
            killed.add(before["main"])
            event = await handovers.wait_for(
                lambda e, p=before["main"]: isinstance(e, Handover) and e.old_pid == p
            )
            assert isinstance(event, Handover)
            assert event.path == "shadow", event.cold_reason
            assert event.new_pid == before["shadow"]  # the shadow recorded before the kill serves now
            await poll(lambda p=before["shadow"]: router_sees(cluster, "e0", p), timeout_s=30)
        await traffic.stop()
        after = await poll(lambda: shadow_ready(cluster, "e0", killed), timeout_s=120)

    assert after["shadow"] and after["shadow"] not in killed  # protected again
    wrong = traffic.wrong()
    assert not wrong, wrong[:5]
    assert sum(r.resumes for r in traffic.results.values()) >= 1


async def router_sees(cluster: Cluster, engine_id: str, pid: int) -> bool | None:
    status = await cluster.client.status()
    return (
        True if any(e.engine_id == engine_id and e.pid == pid and e.alive for e in status.engines) else None
    )


def shm_mappings(pid: int) -> dict[str, dict[str, int | str]]:
    """/dev/shm mappings of a process: path -> perms and sizes (kB) from /proc/PID/smaps."""
    found: dict[str, dict[str, int | str]] = {}
    current = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if "-" in parts[0] and len(parts) >= 6 and parts[5].startswith("/dev/shm/"):
            current = found.setdefault(
                parts[5], {"perms": parts[1], "Size": 0, "Private_Dirty": 0, "Shared": 0}
            )
        elif "-" in parts[0] and len(parts) >= 5:
            current = None
        elif current is not None and parts[0] in (
            "Size:",
            "Private_Dirty:",
            "Shared_Clean:",
            "Shared_Dirty:",
        ):
            key = "Shared" if parts[0].startswith("Shared") else parts[0][:-1]
            current[key] = int(current[key]) + int(parts[1])
    return found


async def test_weights_and_arena_are_shared_mappings_not_copies(nats_server, tmp_path) -> None:
    async with shadowed(nats_server, tmp_path, preset="small") as cluster:
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        await run(cluster.client, make_job(random.Random(1), "warm", max_tokens=32))
        main, shadow = shm_mappings(pids["main"]), shm_mappings(pids["shadow"])

    for who, maps in (("main", main), ("shadow", shadow)):
        weights = [m for path, m in maps.items() if ".w." in path]
        arenas = [m for path, m in maps.items() if ".kv." in path]
        assert weights and arenas, f"{who}: no shared weight/arena mapping: {list(maps)}"
        size_kb = sum(int(m["Size"]) for m in weights)
        assert size_kb > 20_000  # the small preset's weights, about 26 MB
        assert all(str(m["perms"]).endswith("s") for m in weights + arenas), maps  # MAP_SHARED
        assert all(str(m["perms"]).startswith("r-") for m in weights), "weights must be read-only"
        assert sum(int(m["Private_Dirty"]) for m in weights) < size_kb // 100
    assert set(p for p in main if ".w." in p) == set(p for p in shadow if ".w." in p)  # the same segment


async def test_sigstop_main_is_a_hang_killed_before_the_arena_is_reused(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path, hang_timeout_s=1.0, failure_window_s=0.01) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        jobs = [make_job(rng, f"stop-{i}", max_tokens=400) for i in range(4)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: busy_requests(cluster.client, 0, 300))
        kill(pids["main"], signal.SIGSTOP)
        event = await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == pids["main"])
        main_gone = not alive(pids["main"])
        results = await asyncio.gather(*running)

    assert isinstance(event, Handover)
    assert event.reason == "hang" and event.path == "shadow"
    assert main_gone  # SIGKILLed and reaped, not merely resumed
    assert list(event.phases_ms)[:3] == ["kill_confirmed", "servers_checked", "arena_flushed"]
    expected = reference_tokens(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert result.tokens == expected[job.request_id]


@pytest.mark.slow
async def test_a_stopped_main_outliving_its_supervisor_never_shares_its_arena(
    nats_server, tmp_path, seed
) -> None:
    """SIGSTOP the main mid-generation, SIGKILL the supervisor, let the cluster start it again, then
    SIGCONT the old main. The main dies with its supervisor (SIGKILL, which a stopped process does
    not ignore, unlike the SIGTERM it got before), the new supervisor's workers get the arena only
    once it is dead, and every request ends token-exact. Mutation check: with SIGTERM as the death
    signal and no holder check in the KV server, the woken main and the new one share the arena."""
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path) as cluster:
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        jobs = [make_job(rng, f"orphan-{i}", max_tokens=300) for i in range(3)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: busy_requests(cluster.client, 0, 200))
        kill(pids["main"], signal.SIGSTOP)
        old_supervisor = cluster.pid_of("shadow-supervisor")
        kill(old_supervisor)
        await poll(lambda: restarted_server(cluster, "shadow-supervisor", old_supervisor), timeout_s=60)
        with contextlib.suppress(ProcessLookupError):
            kill(pids["main"], signal.SIGCONT)
        fresh = await poll(lambda: shadow_ready(cluster, "e0", {pids["main"], pids["shadow"]}), timeout_s=120)
        main_gone = not alive(pids["main"]) and not alive(pids["shadow"])
        results = await asyncio.gather(*running)

    assert main_gone
    assert fresh["main"] not in (pids["main"], pids["shadow"])
    expected = reference_tokens(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert result.tokens == expected[job.request_id]


@pytest.mark.parametrize("server", ["weight-server", "kv-server"])
async def test_owner_server_killed_takes_the_cold_path(nats_server, tmp_path, seed, server) -> None:
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path, failure_window_s=0.01) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        jobs = [make_job(rng, f"cold-{i}", max_tokens=300) for i in range(4)]  # one may end early
        running = asyncio.gather(*(run(cluster.client, job) for job in jobs))
        await poll(lambda: busy_requests(cluster.client, 0, 250))
        server_pid = cluster.pid_of(server)
        kill(server_pid)
        kill(pids["main"])
        event = await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == pids["main"])
        results = await running
        await poll(lambda: restarted_server(cluster, server, server_pid), timeout_s=60)
        prefix = cluster.supervisor.shm_prefix
    leftovers = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]

    assert isinstance(event, Handover)
    assert event.path == "cold"
    assert ("weight server" if server == "weight-server" else "KV server") in event.cold_reason
    assert event.new_pid != pids["shadow"]  # not reused
    expected = reference_tokens(jobs)
    assert [r.tokens for r in results] == [expected[j.request_id] for j in jobs]
    assert leftovers == []


async def restarted_server(cluster: Cluster, name: str, old_pid: int) -> bool | None:
    child = cluster.supervisor.children[name]
    return True if child.pid != old_pid and child.state == "running" else None


async def test_failing_device_check_takes_the_cold_path(nats_server, tmp_path, monkeypatch) -> None:
    fault = tmp_path / "device-fault"
    monkeypatch.setenv(INJECT_DEVICE_FAULT_ENV, str(fault))
    async with shadowed(nats_server, tmp_path, failure_window_s=0.01) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        fault.touch()
        kill(pids["main"])
        event = await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == pids["main"])
        job = make_job(random.Random(3), "after-cold", max_tokens=64)
        result = await run(cluster.client, job)

    assert isinstance(event, Handover)
    assert event.path == "cold" and "injected device fault" in event.cold_reason
    assert event.new_pid != pids["shadow"]
    assert result.tokens == reference_tokens([job])[job.request_id]


async def test_two_failures_in_window_quarantine_and_spread(nats_server, tmp_path, seed) -> None:
    """Two failures in a row, each right after the worker took over, quarantine e0 (with
    `quarantine_after` 2) and its requests are spread over e1 and e2. A restart request does not
    lift the quarantine; a restarted supervisor keeps it and starts no workers for e0; the
    operator's unquarantine brings e0 back, serving."""
    rng = random.Random(seed)
    options = {"engines": 3, "failure_window_s": 120, "quarantine_after": 2}
    async with shadowed(nats_server, tmp_path, **options) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        alerts = await EventLog.start(cluster.client, "engine_quarantined")
        resumed = await EventLog.start(cluster.client, "request_resumed")
        first = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        kill(first["main"])
        await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == first["main"])
        jobs = [make_job(rng, f"q-{i}", max_tokens=400) for i in range(9)]
        running = [asyncio.create_task(run(cluster.client, job)) for job in jobs]
        await poll(lambda: requests_on(cluster, "e0", 2))
        second = engines(cluster)["e0"]
        status = await cluster.client.status()
        on_e0 = {r.request_id for r in status.requests if r.engine_id == "e0"}  # all of them move
        kill(second["main"])
        await alerts.wait_for(lambda e: isinstance(e, EngineQuarantined) and e.engine_id == "e0")
        results = await asyncio.gather(*running)
        state = engines(cluster)["e0"]
        with pytest.raises(bus.ServiceError) as refused:  # a restart is no way out of a quarantine
            await restart(cluster, "e0")
        old_supervisor = cluster.pid_of("shadow-supervisor")
        old_mains = {entry["main"] for entry in engines(cluster).values()}
        kill(old_supervisor)  # its workers die with it; the cluster starts it again
        await poll(lambda: restarted_server(cluster, "shadow-supervisor", old_supervisor), timeout_s=60)
        await cluster.client.wait_for_engines(2, 120)
        kept = await poll(lambda: serving_engines(cluster, {"e1", "e2"}, old_mains), timeout_s=120)
        back = await poll(lambda: unquarantine(cluster, "e0"), timeout_s=60, every_s=0.2)
        await cluster.client.wait_for_engines(3, 120)
        job = make_job(rng, "after-unquarantine", max_tokens=32)
        after = await run(cluster.client, job)

    moved = [
        e
        for e in resumed.events
        if isinstance(e, RequestResumed) and e.request_id in on_e0 and e.engine_id != "e0"
    ]
    targets = [e.engine_id for e in moved]
    assert set(on_e0) <= {e.request_id for e in moved}
    assert abs(targets.count("e1") - targets.count("e2")) <= 1  # spread evenly
    assert state["quarantined"]
    assert refused.value.code == "engine-quarantined"
    e0 = kept["e0"]  # the quarantine read back from the registry: no workers
    assert (e0["main"], e0["shadow"], e0["quarantined"]) == (0, 0, True)
    assert back.engine_id == "e0" and back.new_pid > 0
    assert after.tokens == reference_tokens([job])[job.request_id]
    expected = reference_tokens(jobs)
    for job, result in zip(jobs, results, strict=True):
        assert result.tokens == expected[job.request_id]


async def serving_engines(
    cluster: Cluster, wanted: set[str], old_mains: set[int]
) -> dict[str, dict[str, int]] | None:
    """The state a new supervisor wrote (no main of `old_mains`), once exactly `wanted` have a main
    and a shadow."""
    state = engines(cluster)
    if any(entry["main"] in old_mains for entry in state.values()):
        return None  # the old supervisor's file
    running = {e for e, entry in state.items() if entry["main"] and entry["shadow"]}
    return state if running == wanted else None


async def serving_main(cluster: Cluster, engine_id: str) -> int | None:
    """The engine's serving main, alive as the router sees it and running; None while it has none
    (a handover or a cold start under way)."""
    for engine in (await cluster.client.status()).engines:
        if engine.engine_id == engine_id and engine.alive and alive(engine.pid):
            return engine.pid
    return None


async def unquarantine(cluster: Cluster, engine_id: str) -> EngineRestarted | None:
    """What `belayer engines unquarantine` asks; None while the supervisor does not serve it yet."""
    subject = cluster.client.subjects.engine_unquarantine(engine_id)
    try:
        return await bus.request_struct(
            cluster.client.nc, subject, EngineUnquarantine(), EngineRestarted, 180
        )
    except bus.ServiceError as exc:
        if exc.code != "no-responders":
            raise
        return None


async def test_eight_kills_in_a_minute_on_two_engines_never_take_the_cluster_down(
    nats_server, tmp_path, seed
) -> None:
    """8 SIGKILLs of serving workers at random times within a minute, with the default quarantine
    policy (3 failures in a row, each within 60 s of taking over): the first three on e0, which is
    quarantined while e1 serves; the other five on e1, the last healthy engine, which never is: it
    takes the cold path with a backoff and raises `engine_unstable`. Every request completes
    token-exact. Before, two failures of one engine within a minute quarantined it for good, and
    three random kills on 2 engines left none."""
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path, engines=2, hang_timeout_s=10.0) as cluster:
        quarantined = await EventLog.start(cluster.client, "engine_quarantined")
        unstable = await EventLog.start(cluster.client, "engine_unstable")
        traffic = Traffic(cluster.client, seed * 10, "k", max_tokens=200).start(4)
        times = sorted(rng.uniform(0.0, 60.0) for _ in range(8))
        started, kills = asyncio.get_running_loop().time(), []
        for n, at in enumerate(times):
            await asyncio.sleep(max(0.0, started + at - asyncio.get_running_loop().time()))
            engine = "e0" if n < 3 else "e1"
            pid = await poll(lambda e=engine: serving_main(cluster, e), timeout_s=30, every_s=0.05)
            kill(pid)
            kills.append((round(at, 1), engine, pid))
        print(f"seed {seed}: kills (s, engine, pid): {kills}")
        await traffic.stop()
        state = engines(cluster)

    assert [(e.engine_id, e.failures) for e in quarantined.events] == [("e0", 3)]
    assert state["e0"]["quarantined"] and not state["e1"]["quarantined"], state
    alerts = [e for e in unstable.events if isinstance(e, EngineUnstable)]
    assert alerts and {a.engine_id for a in alerts} == {"e1"}, alerts
    wrong = traffic.wrong()
    assert not wrong, wrong[:5]


async def restart(cluster: Cluster, engine_id: str) -> EngineRestarted:
    """What the trainer's rollout rebuild asks of the engine's supervisor."""
    subject = cluster.client.subjects.engine_restart(engine_id)
    return await bus.request_struct(
        cluster.client.nc, subject, EngineRestart(reason="test"), EngineRestarted, 180
    )


async def test_a_restart_request_takes_the_cold_path_with_main_and_shadow_stopped(
    nats_server, tmp_path, seed
) -> None:
    """The shadow and then the main SIGSTOPped mid-generation: nobody reports a failure and the
    requests stand still past the hang timeout. A restart request kills both (confirmed), starts a
    worker by the cold path and a new shadow, and the requests end token-exact. A restart is not a
    failure: a second one inside the failure window does not quarantine the engine. An engine no
    supervisor runs has no responder."""
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path, hang_timeout_s=1.0, failure_window_s=120) as cluster:
        handovers = await EventLog.start(cluster.client, "handover")
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        jobs = [make_job(rng, f"restart-{i}", max_tokens=300) for i in range(4)]
        running = asyncio.gather(*(run(cluster.client, job) for job in jobs))
        await poll(lambda: busy_requests(cluster.client, 0, 250))
        kill(pids["shadow"], signal.SIGSTOP)
        kill(pids["main"], signal.SIGSTOP)
        await asyncio.sleep(3.0)  # three hang timeouts: nobody noticed
        unnoticed = list(handovers.events)
        first = await restart(cluster, "e0")
        stopped_gone = not alive(pids["main"]) and not alive(pids["shadow"])
        results = await running
        await poll(lambda: shadow_ready(cluster, "e0", set(pids.values())), timeout_s=120)
        second = await restart(cluster, "e0")
        with pytest.raises(bus.ServiceError) as unknown:
            await restart(cluster, "e9")
        state = engines(cluster)["e0"]

    assert unnoticed == []
    assert (first.old_pid, second.old_pid) == (pids["main"], first.new_pid)
    assert stopped_gone  # SIGKILLed and reaped, not resumed
    assert second.epoch > first.epoch
    events = [e for e in handovers.events if isinstance(e, Handover)]
    assert [(e.reason, e.path) for e in events] == [("restart", "cold"), ("restart", "cold")]
    assert "restart requested" in events[0].cold_reason
    assert not state["quarantined"]
    assert unknown.value.code == "no-responders"
    expected = reference_tokens(jobs)
    assert [r.tokens for r in results] == [expected[j.request_id] for j in jobs]


async def requests_on(cluster: Cluster, engine_id: str, at_least: int) -> set[str] | None:
    status = await cluster.client.status()
    found = {r.request_id for r in status.requests if r.engine_id == engine_id and r.num_tokens > 0}
    return found if len(found) >= at_least else None


async def test_idle_shadow_killed_is_replaced_main_unaffected(nats_server, tmp_path) -> None:
    async with shadowed(nats_server, tmp_path) as cluster:
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        kill(pids["shadow"])
        after = await poll(lambda: shadow_ready(cluster, "e0", {pids["shadow"]}), timeout_s=120)
        job = make_job(random.Random(5), "still-serving", max_tokens=64)
        result = await run(cluster.client, job)
        serving = await cluster.engine_pid("e0")

    assert after["main"] == pids["main"] == serving
    assert after["shadow"] != pids["shadow"]
    assert result.tokens == reference_tokens([job])[job.request_id]
    assert os.getpid() not in (after["main"], after["shadow"])
