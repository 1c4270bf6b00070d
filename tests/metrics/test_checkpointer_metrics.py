"""The checkpointer's metrics on a real Docker host with CRIU: two checkpoints, a sandbox killed
from outside (an environment failure), a restore. Each counter moves by exactly what the replies
and events report: checkpoint count, bytes, freeze and total seconds; failures by reason;
restores by source and store.

Needs Docker with experimental checkpoints and CRIU (the `docker_env` fixture skips without them,
and fails under CI=true).
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared import bus
from belayer_rl.shared.processes import free_port
from belayer_rl.shared.protocol import EnvFailure, SandboxSpec
from tests.checkpointer.conftest import Service, remove_host_containers
from tests.checkpointer.helpers import events, kill_container
from tests.metrics.scrape import Moved, assert_moved_exactly, scrape, wrong

pytestmark = pytest.mark.docker


async def test_checkpoints_failures_and_restores_are_counted_exactly(
    docker_env: str, nats_url: str, tmp_path: Path
) -> None:
    port = free_port()
    host_id = f"t{secrets.token_hex(4)}"
    service = Service(
        nats_url,
        host_id,
        tmp_path / "state",
        tmp_path / "checkpointer.log",
        extra=["--metrics-port", str(port)],
    )
    service.start()
    nc = await bus.connect(nats_url, "test-client")
    client = SandboxClient(nc, host_id)
    try:
        await service.ready(client)
        before = await scrape(port)
        info = await client.create(SandboxSpec(image=docker_env), sandbox="m")
        await client.exec("m", "echo one > /one")
        first = await client.checkpoint("m", "traj-m", k=1, context_tokens=[1])
        await client.exec("m", "echo two > /two")
        second = await client.checkpoint("m", "traj-m", k=2, context_tokens=[1, 2])
        checkpointed = await scrape(port)
        async with events(nats_url) as seen:
            await kill_container(info.container_id)
            for _ in range(100):  # the engine's event stream reports the death of an idle sandbox
                if any(isinstance(e, EnvFailure) for e in seen):
                    break
                await asyncio.sleep(0.1)
        restored = await client.restore("traj-m")
        after = await scrape(port)
    finally:
        await nc.close()
        service.stop()
        await remove_host_containers(host_id)

    failures = [e for e in seen if isinstance(e, EnvFailure)]
    assert len(failures) == 1, failures
    checkpoints = [
        Moved.of("belayer_checkpoints_total", 2),
        Moved.of("belayer_checkpoint_written_bytes_total", first.bytes_written + second.bytes_written),
        Moved.of("belayer_checkpoint_freeze_seconds_count", 2),
        Moved.of("belayer_checkpoint_duration_seconds_count", 2),
    ]
    fault = [
        Moved.of("belayer_environment_failures_total", 1, reason=failures[0].reason),
        Moved.of("belayer_environment_failures_total", 1),
        Moved.of("belayer_restores_total", 1, source=restored.source, store="local"),
        Moved.of("belayer_restores_total", 1),
        Moved.of("belayer_restore_duration_seconds_count", 1),
    ]
    assert_moved_exactly(before, after, checkpoints + fault)
    assert wrong(before, checkpointed, checkpoints) == []
    # The mutation check: before the kill, neither the failure nor the restore had been counted.
    assert all(wrong(before, checkpointed, [e]) for e in fault)

    def moved(name: str) -> float:
        return after.get(name) - before.get(name)

    assert moved("belayer_checkpoint_freeze_seconds_sum") == pytest.approx(first.freeze_s + second.freeze_s)
    assert moved("belayer_checkpoint_duration_seconds_sum") == pytest.approx(first.total_s + second.total_s)
    assert restored.source == "latest" and failures[0].reason == "dead"
