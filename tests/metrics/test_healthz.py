"""`/healthz`: 503 "starting" until the service is ready, 200 "ok" while it serves, 503
"draining" once a drain began; then the endpoint closes with the process. `--metrics-port -1`
serves nothing, and a port already taken stops the service with a line that names the flag.

The first test runs the router as a real process against a nats-server that only starts later,
so "starting" is what a health check sees while the bus is unreachable.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import urllib.error
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client as NATS

from belayer_rl.shared import bus, runtime
from belayer_rl.shared.config import ConfigError, ServiceConfig
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from belayer_rl.shared.protocol import ServiceStats
from belayer_rl.shared.runtime import Runtime
from tests.metrics.scrape import http_get, scrape, stats_of
from tests.support import poll


async def healthz(port: int, status: int | None = None) -> tuple[int, str] | None:
    """/healthz's answer, or None while nothing listens (or, with `status`, while it differs)."""
    try:
        answer = await http_get(port, "/healthz")
    except (urllib.error.URLError, ConnectionError):
        return None
    return answer if status is None or answer[0] == status else None


async def refused(port: int) -> bool:
    try:
        await http_get(port, "/healthz")
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


async def test_a_real_router_is_starting_until_nats_comes_up_then_ok(tmp_path: Path) -> None:
    nats_port, port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "belayer_rl.services.router",
        "--nats", f"nats://127.0.0.1:{nats_port}", "--metrics-port", str(port),
    ]  # fmt: skip
    with (tmp_path / "router.log").open("ab") as log:
        router = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log)
    nats = None
    try:
        starting = await poll(lambda: healthz(port), timeout_s=60, every_s=0.1)
        not_ready = await scrape(port)  # /metrics answers before the service is ready, too
        nats = await start_nats_server(tmp_path / "jetstream", nats_port, tmp_path / "nats.log")
        ok = await poll(lambda: ok_now(port), timeout_s=60, every_s=0.1)  # past a moment's standby
        ready = await scrape(port)
        missing = await http_get(port, "/nope")
        nc = await bus.connect(f"nats://127.0.0.1:{nats_port}", "test-client")
        try:
            stats = await stats_of(nc, "router")
        finally:
            await nc.close()
        router.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(router.wait(), 30)
        gone = await refused(port)
    finally:
        await stop_process(router)
        if nats is not None:
            await stop_process(nats)

    assert starting == (503, "starting\n")
    assert not_ready.get("belayer_service_ready") == 0
    assert ok == (200, "ok\n")
    assert ready.get("belayer_service_ready") == 1
    assert "process_cpu_seconds_total" in ready.names()
    assert missing[0] == 404
    assert stats.metrics_port == port
    assert code == 0 and gone


async def test_a_standby_router_is_healthy_not_ready_until_it_takes_over(nats_server, tmp_path: Path) -> None:
    """A warm standby does its job by waiting: a container orchestrator must see it healthy (200,
    "standby: ...") or it would restart it, yet its readiness gauge stays 0 until it holds the lease.
    Mutation check, run by hand: without `standing_by`, the standby answers 503 "starting"."""
    ports = free_port(), free_port()
    routers = []
    try:
        for i, port in enumerate(ports):
            argv = [
                sys.executable, "-m", "belayer_rl.services.router", "--nats", nats_server.url,
                "--metrics-port", str(port), "--lease-ttl", "3",
            ]  # fmt: skip
            with (tmp_path / f"router-{i}.log").open("ab") as log:
                routers.append(await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=log))
            await poll(
                lambda port=port: ok_now(port) if port == ports[0] else healthz(port, 200), timeout_s=60
            )
        standby = await healthz(ports[1])
        standby_ready = (await scrape(ports[1])).get("belayer_service_ready")
        routers[0].send_signal(signal.SIGKILL)
        taken_over = await poll(lambda: ok_now(ports[1]), timeout_s=30, every_s=0.1)
        ready = (await scrape(ports[1])).get("belayer_service_ready")
    finally:
        for router in routers:
            await stop_process(router)
    assert standby == (200, "standby: the router lease\n")
    assert standby_ready == 0
    assert taken_over == (200, "ok\n") and ready == 1


async def ok_now(port: int) -> tuple[int, str] | None:
    answer = await healthz(port, 200)
    return answer if answer is not None and answer[1] == "ok\n" else None


async def test_healthz_is_503_while_draining(nats_server) -> None:
    draining, release = asyncio.Event(), asyncio.Event()
    runtimes: list[Runtime] = []

    async def slow_drain() -> None:
        draining.set()
        await release.wait()

    async def setup(rt: Runtime, config: ServiceConfig) -> None:
        runtimes.append(rt)
        await rt.connect()
        rt.on_drain(slow_drain)
        rt.ready("test")

    port = free_port()
    config = ServiceConfig(nats_url=nats_server.url, metrics_port=port, drain_timeout_s=20.0)
    service = asyncio.create_task(runtime.serve("test-health", config, setup))
    ok = await poll(lambda: healthz(port, 200), timeout_s=30)
    runtimes[0].stopping.set()  # what a first SIGTERM does
    await asyncio.wait_for(draining.wait(), 10)
    during = await http_get(port, "/healthz")
    during_metrics = await scrape(port)
    release.set()
    failure = await asyncio.wait_for(service, 20)
    gone = await refused(port)

    assert ok == (200, "ok\n")
    assert during == (503, "draining\n")
    assert during_metrics.get("belayer_service_ready") == 0
    assert failure == "" and gone


async def test_metrics_port_minus_one_serves_nothing(nats_server) -> None:
    seen: list[Runtime] = []

    async def setup(rt: Runtime, config: ServiceConfig) -> None:
        seen.append(rt)
        await rt.connect()
        rt.ready("test")

    config = ServiceConfig(nats_url=nats_server.url, metrics_port=-1)
    service = asyncio.create_task(runtime.serve("test-no-metrics", config, setup))
    nc = await bus.connect(nats_server.url, "test-client")
    try:
        stats = await poll(lambda: _stats_when_ready(nc, "test-no-metrics"), timeout_s=30)
    finally:
        await nc.close()
        seen[0].stopping.set()
        await asyncio.wait_for(service, 10)

    assert stats.metrics_port == 0
    assert seen[0].metrics.registry is None


async def _stats_when_ready(nc: NATS, name: str) -> ServiceStats | None:
    try:
        stats = await stats_of(nc, name)
    except nats.errors.Error:  # not subscribed yet
        return None
    return stats if stats.ready else None


async def test_a_taken_metrics_port_stops_the_service_naming_the_flag(nats_server) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def setup(rt: Runtime, config: ServiceConfig) -> None:
            raise AssertionError("the setup must not run")

        config = ServiceConfig(nats_url=nats_server.url, metrics_port=port)
        with pytest.raises(ConfigError) as refusal:
            await runtime.serve("test-taken", config, setup)
    assert "--metrics-port" in str(refusal.value)
