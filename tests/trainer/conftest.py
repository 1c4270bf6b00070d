"""A real cluster for the trainer: router, weight server, KV server and the shadow supervisor with
one tiny worker, on a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support import Cluster, NatsServer, running_cluster


@pytest.fixture
async def train_cluster(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Cluster]:
    async with running_cluster(nats_server, tmp_path, engines=1, shadows=True, preset="tiny") as cluster:
        yield cluster
