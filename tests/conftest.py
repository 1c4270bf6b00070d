"""Fixtures: a real nats-server per test and the seed of a fault test's random choices."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from tests.support import NatsServer


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    port = free_port()
    store, log = tmp_path / "jetstream", tmp_path / "nats.log"
    server = NatsServer(
        f"nats://127.0.0.1:{port}", port, store, log, await start_nats_server(store, port, log)
    )
    yield server
    await stop_process(server.process)


@pytest.fixture
def seed() -> Iterator[int]:
    """The seed of a fault test's random choices; printed so a failure can be replayed."""
    value = int(os.environ.get("BELAYER_TEST_SEED", random.randrange(1 << 30)))
    print(f"fault seed: {value} (replay with BELAYER_TEST_SEED={value})")
    yield value
