"""Every service, SIGTERMed while NATS is unreachable, exits cleanly within its drain timeout.

A whole local cluster runs (router, weight and KV servers, the shadow supervisor with a main and a
shadow, the checkpointer); then nats-server is killed, so every service is cut off mid-connection
and nats-py would retry forever, and each process gets one SIGTERM. The local cluster's
supervisor is told not to restart what exits (this test stops the processes itself)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from belayer_rl.shared.config import CheckpointerConfig, ServiceConfig
from belayer_rl.shared.processes import stop_process
from tests.checkpointer.conftest import IN_CI
from tests.support import kill, running_cluster

SLACK_S = 5.0  # process exit and interpreter teardown on a loaded 2-core machine


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def exit_time(pid: int, limit_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if not alive(pid):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    return None


async def test_every_service_exits_within_its_drain_timeout_while_nats_is_down(nats_server, tmp_path) -> None:
    drain = ServiceConfig().drain_timeout_s
    async with running_cluster(nats_server, tmp_path, engines=1, shadows=True, sandboxes=True) as cluster:
        supervisor = cluster.supervisor
        if IN_CI or "checkpointer" in supervisor.children:  # without Docker it is left out, off CI
            assert "checkpointer" in supervisor.children, "no checkpointer: is Docker up?"
        main_pid = await cluster.engine_pid("e0")
        supervisor.stopping = True  # from now on nothing that exits is restarted
        await stop_process(nats_server.process)

        exits: dict[str, float | None] = {}
        codes: dict[str, int | None] = {}
        kill(main_pid, signal.SIGTERM)  # the worker first: its supervisor would stop it otherwise
        exits["worker-e0"] = await exit_time(main_pid, drain + SLACK_S)
        for name, child in supervisor.children.items():
            assert child.process is not None
            limit = (CheckpointerConfig().drain_timeout_s if name == "checkpointer" else drain) + SLACK_S
            child.process.send_signal(signal.SIGTERM)
            try:
                codes[name] = await asyncio.wait_for(child.process.wait(), limit)
                exits[name] = limit
            except TimeoutError:
                exits[name], codes[name] = None, None
                child.process.kill()

    assert all(seconds is not None for seconds in exits.values()), exits
    assert all(code == 0 for code in codes.values()), codes
    assert {"router", "weight-server", "kv-server", "shadow-supervisor"} <= set(codes), codes
