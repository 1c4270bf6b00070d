"""Fixtures for the agent-loop tests: a real local cluster (router, one tiny-4k worker, the
checkpointer on the real dockerd with CRIU, the policy service) on a real nats-server. Without
Docker and CRIU these tests skip, except under CI=true, where they fail."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiodocker
import pytest

from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.services.rollout.agent import Services
from belayer_rl.shared.config import hostname_id
from tests.checkpointer.conftest import IN_CI, _missing
from tests.support import Cluster, NatsServer, running_cluster


@dataclass
class AgentCluster:
    cluster: Cluster
    services: Services
    host_id: str


async def sandbox_image(who: str) -> None:
    """Docker with CRIU and the sandbox image ready; else a skip, or under CI=true a failure
    naming `who` could not run."""
    reason = await asyncio.to_thread(_missing)  # it runs a loop of its own
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI=true and {who} cannot run: {reason}")
        pytest.skip(reason)
    docker = aiodocker.Docker()
    try:
        await ensure_image(docker, DEFAULT_IMAGE)
    finally:
        await docker.close()


@pytest.fixture
async def agent_cluster(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[AgentCluster]:
    await sandbox_image("the agent tests")
    options = {"engines": 1, "shadows": False, "sandboxes": True, "preset": "tiny-4k"}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        assert {"checkpointer", "policy"} <= set(cluster.supervisor.children), cluster.supervisor.children
        host_id = hostname_id()
        yield AgentCluster(cluster, Services.on(cluster.client, host_id), host_id)
