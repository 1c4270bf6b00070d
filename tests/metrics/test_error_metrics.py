"""Every bad message moves `belayer_errors_total`, by exactly one, in every service it reaches.

Each service of a cluster (router, weight and KV servers, shadow supervisor, the engine's main
and shadow workers, and the checkpointer where Docker runs) says on its stats subject what it
serves. Every declared endpoint gets a fixed set of malformed payloads; a service's error counter
must then move by exactly the number of those messages its endpoints took (a message on a subject
two of its endpoints match counts twice), and by nothing before them: valid traffic first moves
no error counter. Afterwards every service is still the same process, healthy, and a generation
completes token-exact.
"""

from __future__ import annotations

import asyncio
import json
import random

from belayer_rl.shared import protocol
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.protocol import ErrorReply, ServiceStats
from tests.checkpointer.conftest import IN_CI
from tests.handover.test_handover import shadow_ready
from tests.metrics.scrape import Moved, Scrape, assert_moved_exactly, http_get, scrape, stats_of, wrong
from tests.rollout.test_worker_faults import make_job, run
from tests.runtime.test_fuzz_endpoints import DEEP, DEEP_OBJECT, concrete
from tests.support import poll, reference_tokens, running_cluster

ERRORS = "belayer_errors_total"


def bad_payloads(rng: random.Random, max_payload: int) -> list[bytes]:
    """Payloads no endpoint accepts: noise, wrong shapes, wrong types, nesting, the size limit."""
    return [
        rng.randbytes(rng.randint(1, 200)),
        b"",
        b"[1, 2, 3]",
        b'{"type": "no-such-type"}',
        json.dumps({"type": "generate", "v": "one", "unknown_field": [1]}).encode(),
        DEEP,
        DEEP_OBJECT,
        b'{"type":"generate","prompt":"' + b"x" * (max_payload - 40) + b'"}',
    ]


def matches(pattern: str, subject: str) -> bool:
    """Whether a NATS subscription `pattern` (with * and >) takes `subject`."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or token not in ("*", got[i]):
            return False
    return len(want) == len(got)


async def test_every_bad_message_moves_the_error_metric_by_one(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    async with running_cluster(nats_server, tmp_path, engines=1, shadows=True, sandboxes=True) as cluster:
        nc = cluster.client.nc
        workers = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        names = ["router", "weight-server", "kv-server", "shadow-supervisor"]
        shadow = f"worker.e0.{workers['shadow']}"
        names += [f"worker.e0.{workers['main']}", shadow]
        if IN_CI or "checkpointer" in cluster.supervisor.children:  # off CI, Docker may be missing
            names.append(f"checkpointer.{hostname_id()}")
        stats: dict[str, ServiceStats] = {name: await stats_of(nc, name) for name in names}
        ports = {name: s.metrics_port for name, s in stats.items()}
        assert all(port > 0 for port in ports.values()), ports

        async def scrape_all() -> dict[str, Scrape]:
            return {name: await scrape(port) for name, port in ports.items()}

        before = await scrape_all()
        # Valid traffic: a stats request to each service and a generation. No error may move.
        for name in names:
            await stats_of(nc, name)
        job = make_job(rng, "before-fuzz", max_tokens=32)
        first = await run(cluster.client, job)
        valid = await scrape_all()

        declared = {concrete(e.subject): e.reply for s in stats.values() for e in s.endpoints}
        payloads = bad_payloads(rng, nc.max_payload)
        for subject, replies in sorted(declared.items()):
            for payload in payloads:
                if not replies:
                    await nc.publish(subject, payload)  # one-way: dropped with a logged reason
                    continue
                reply = await nc.request(subject, payload, timeout=5)
                answer = protocol.decode(protocol.decoder_for(ErrorReply), reply.data)
                assert answer.code == "bad-request", (subject, payload[:60], answer)
        await nc.flush()
        expected = {
            name: len(payloads)
            * sum(matches(e.subject, subject) for e in stats[name].endpoints for subject in declared)
            for name in names
        }

        async def counted() -> dict[str, Scrape] | None:
            now = await scrape_all()
            done = all(now[n].get(ERRORS) - before[n].get(ERRORS) >= expected[n] for n in names)
            return now if done else None

        await poll(counted, timeout_s=30, every_s=0.2)
        await asyncio.sleep(0.5)  # a late extra count would land now
        after = await scrape_all()
        health = {name: await http_get(port, "/healthz") for name, port in ports.items()}
        pids = {name: (await stats_of(nc, name)).pid for name in names}
        job_after = make_job(rng, "after-fuzz", max_tokens=32)
        second = await run(cluster.client, job_after)

    for name in names:
        moved = [
            Moved.of(ERRORS, expected[name], code="bad-request"),
            Moved.of(ERRORS, expected[name]),  # and no other code
        ]
        assert_moved_exactly(before[name], after[name], moved)
        # The mutation check: the valid traffic moved none of them.
        assert wrong(before[name], valid[name], [Moved.of(ERRORS, 0)]) == [], name
        assert wrong(before[name], valid[name], moved), name
        assert (
            after[name].get("belayer_messages_handled_total")
            - before[name].get("belayer_messages_handled_total")
            >= expected[name]
        )
        # A shadow stands by and serves nothing until it is promoted: not ready, and says so.
        ready = (503, "starting\n") if name == shadow else (200, "ok\n")
        assert health[name] == ready, (name, health[name])
        assert pids[name] == stats[name].pid, name  # the same process: nothing died
    reference = reference_tokens([job, job_after])
    assert first.tokens == reference[job.request_id] and second.tokens == reference[job_after.request_id]
