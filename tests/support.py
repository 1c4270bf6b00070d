"""Helpers for the service tests: a real nats-server handle, a real local cluster, references."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from belayer_rl.cli.chaos.workload import Job, Output, reference_outputs, reference_tokens  # noqa: F401 - the tests take them from here
from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings, local_cluster
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.client import Client
from belayer_rl.shared.processes import start_nats_server
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects()  # the default cluster's names

T = TypeVar("T")


@dataclass
class NatsServer:
    url: str
    port: int
    store: Path
    log: Path
    process: asyncio.subprocess.Process

    async def restart(self, down_s: float = 0.5) -> None:
        """Kill the server (SIGKILL) and start it again on the same port and store."""
        self.process.kill()
        await self.process.wait()
        await asyncio.sleep(down_s)
        self.process = await start_nats_server(self.store, self.port, self.log)


@dataclass
class Cluster:
    supervisor: Supervisor
    client: Client
    nats: NatsServer

    def pid_of(self, name: str) -> int:
        return self.supervisor.children[name].pid

    async def engine_pid(self, engine_id: str) -> int:
        status = await self.client.status()
        return next(e.pid for e in status.engines if e.engine_id == engine_id)


def cluster_config(state_dir: Path, **options: object) -> ClusterConfig:
    """A ClusterConfig from keywords as `belayer up`'s flags are written: those it passes on to its
    services go under `services`, the rest are the cluster's own."""
    passed = {f.name: options.pop(f.name) for f in dataclasses.fields(UpSettings) if f.name in options}
    return ClusterConfig(state_dir=state_dir, services=UpSettings(**passed), **options)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_cluster(nats: NatsServer, state_dir: Path, **options: object) -> AsyncIterator[Cluster]:
    options.setdefault("engines", 2)
    options.setdefault("shadows", False)  # workers started directly: the router's recovery alone
    options.setdefault("sandboxes", False)
    config = cluster_config(state_dir, nats_url=nats.url, **options)
    async with local_cluster(config) as supervisor:
        client = Client(await bus.connect(nats.url, "test-client"))
        try:
            if config.engines:
                await client.wait_for_engines(config.engines, 120)
            else:
                await client.wait_for_engines(0, 120)
            yield Cluster(supervisor, client, nats)
        finally:
            await client.nc.close()


class EventLog:
    """Every event of a kind seen on the bus since it started listening."""

    def __init__(self) -> None:
        self.events: list[protocol.Message] = []
        self.times: list[float] = []  # time.monotonic() at each event's arrival
        self.arrived = asyncio.Event()

    async def wait_for(
        self, predicate: Callable[[protocol.Message], bool], timeout_s: float = 60
    ) -> protocol.Message:
        """The first event matching `predicate`, waiting for it if need be."""
        async with asyncio.timeout(timeout_s):
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                self.arrived.clear()
                await self.arrived.wait()

    @classmethod
    async def start(cls, client: Client, kind: str) -> EventLog:
        log = cls()
        decoder = protocol.decoder_for(protocol.EVENT_TYPES[kind])

        async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
            log.events.append(protocol.decode(decoder, msg.data))
            log.times.append(time.monotonic())
            log.arrived.set()

        await client.nc.subscribe(NAMES.event(kind, "*"), cb=on_message)
        return log


def kill(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    os.kill(pid, sig)


async def poll(check: Callable[[], Awaitable[T | None]], timeout_s: float = 60, every_s: float = 0.01) -> T:
    """Call `check` until it returns something other than None (for state only reachable by asking)."""
    async with asyncio.timeout(timeout_s):
        while (found := await check()) is None:  # noqa: ASYNC110 - the state lives in another process
            await asyncio.sleep(every_s)
    return found


async def busy_requests(client: Client, low: int, high: int) -> list[protocol.RequestStatus] | None:
    """The requests in flight with low < tokens < high, or None while there are none such."""
    status = await client.status()
    found = [r for r in status.requests if r.engine_id and low < r.num_tokens < high]
    return found or None


def load_example(name: str, path: Path) -> ModuleType:
    """An example module (examples/) by its file: a folder named verl/ or slime/ on sys.path would
    shadow the frameworks themselves, which is also why the examples are not a package."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
