"""Fixtures for the server tests: a unique /dev/shm prefix per test and a connected client."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client as NATS

from belayer_rl.shared import bus
from belayer_rl.shared.segments import SHM_DIR
from tests.servers.helpers import shm_names


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A prefix no other test uses; whatever a failed test left under it is removed afterwards."""
    prefix = f"bt{secrets.token_hex(5)}"
    yield prefix
    for name in shm_names(prefix):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()


@pytest.fixture
async def nc(nats_server) -> AsyncIterator[NATS]:
    client = await bus.connect(nats_server.url, "test-servers")
    yield client
    await client.close()
