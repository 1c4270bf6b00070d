"""Reading a service's metrics as Prometheus does: over HTTP, parsed by prometheus_client's parser.

A service's port comes from its stats reply (ServiceStats.metrics_port), which the runtime
answers on `belayer.<cluster>.svc.<name>.stats`.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from belayer_rl.shared import protocol
from belayer_rl.shared.protocol import ServiceStats, StatsRequest
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects()  # the default cluster's names
Labels = frozenset[tuple[str, str]]


async def stats_of(nc: NATS, name: str, subjects: Subjects = NAMES) -> ServiceStats:
    reply = await nc.request(subjects.service_stats(name), protocol.encode(StatsRequest()), timeout=5)
    return protocol.decode(protocol.decoder_for(ServiceStats), reply.data)


async def metrics_port(nc: NATS, name: str) -> int:
    port = (await stats_of(nc, name)).metrics_port
    assert port > 0, f"{name} serves no metrics"
    return port


def http_get_blocking(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:  # 503 and friends: an answer, not a failure here
        return error.code, error.read().decode()


async def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:<port><path>, off the event loop."""
    return await asyncio.to_thread(http_get_blocking, port, path)


@dataclass(frozen=True)
class Scrape:
    """Every sample of one scrape, keyed by sample name (`belayer_x_total`, `..._count`) and labels."""

    values: dict[tuple[str, Labels], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return cls(values)

    def get(self, name: str, **labels: str) -> float:
        """The sum over the samples named `name` that carry `labels` (0 when there are none)."""
        wanted = set(labels.items())
        return sum(v for (n, have), v in self.values.items() if n == name and wanted <= have)

    def names(self) -> set[str]:
        return {name for name, _ in self.values}


async def scrape(port: int) -> Scrape:
    status, text = await http_get(port, "/metrics")
    assert status == 200, (status, text[:200])
    return Scrape.parse(text)


@dataclass(frozen=True)
class Moved:
    """An expectation: the sample `name` (with `labels`) moved by exactly `by` between two scrapes."""

    name: str
    by: float
    labels: dict[str, str]

    @classmethod
    def of(cls, name: str, by: float, **labels: str) -> Moved:
        return cls(name, by, labels)


def wrong(before: Scrape, after: Scrape, expected: list[Moved]) -> list[str]:
    """Each expectation the scrapes do not meet, as a readable line; empty when all are met."""
    misses = []
    for e in expected:
        moved = after.get(e.name, **e.labels) - before.get(e.name, **e.labels)
        if moved != e.by:
            misses.append(f"{e.name}{e.labels or ''} moved by {moved}, expected {e.by}")
    return misses


def off_by_one(expected: list[Moved]) -> list[list[Moved]]:
    """The mutation check: every expectation, one at a time, wrong by one (up, and down if above
    zero). Each must be refused by `wrong`, or the test could not tell a wrong count from a right one."""
    mutants = []
    for i, e in enumerate(expected):
        for delta in (1, -1) if e.by > 0 else (1,):
            mutants.append([*expected[:i], Moved(e.name, e.by + delta, e.labels), *expected[i + 1 :]])
    return mutants


def assert_moved_exactly(before: Scrape, after: Scrape, expected: list[Moved]) -> None:
    """The expectations hold, and none of their off-by-one mutants does."""
    assert wrong(before, after, expected) == []
    for mutant in off_by_one(expected):
        assert wrong(before, after, mutant), f"an off-by-one expectation passed: {mutant}"
