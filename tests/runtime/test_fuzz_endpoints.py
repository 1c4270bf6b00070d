"""Hostile input on every endpoint that every service declares, through the one runtime.

The endpoints are not listed here: each service says what it serves on its stats subject
(`belayer.svc.<name>.stats`), and every one of them gets random bytes, random JSON, 1,000-deep
nesting, unknown fields, wrong types and a payload at the bus's size limit. Each message must get
an error reply (or, one-way, a logged drop), the service's error count must move by at least as
many, no service may die, and a valid request afterwards completes token-exact.
"""

from __future__ import annotations

import asyncio
import json
import random

import nats.errors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from belayer_rl.shared import protocol
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.protocol import ErrorReply, ServiceStats, StatsRequest
from belayer_rl.shared.subjects import Subjects
from tests.checkpointer.conftest import IN_CI
from tests.rollout.test_worker_faults import make_job, run
from tests.support import poll, reference_tokens, running_cluster

NAMES = Subjects()  # the default cluster's names

DEEP = b"[" * 1000 + b"]" * 1000
DEEP_OBJECT = b'{"a":' * 1000 + b"1" + b"}" * 1000

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
# Tags of real messages, so a payload can look like the right type with the wrong insides.
TAGS = sorted(
    kind.__struct_config__.tag
    for kind in vars(protocol).values()
    if isinstance(kind, type) and issubclass(kind, protocol.Message) and kind.__struct_config__.tag
)


@st.composite
def hostile(draw: st.DrawFn, max_payload: int) -> bytes:
    """Something no endpoint accepts."""
    return draw(
        st.one_of(
            st.binary(max_size=256).filter(lambda b: b.strip() != b"{}"),
            json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
            st.just(DEEP),
            st.just(DEEP_OBJECT),
            # a tagged object with an unknown field and a wrong-typed `v`
            st.builds(
                lambda tag, junk: json.dumps({"type": tag, "v": "one", "unknown_field": junk}).encode(),
                st.sampled_from(TAGS),
                json_values,
            ),
            # at the bus's size limit: the largest payload that reaches a service
            st.just(b'{"type":"generate","prompt":"' + b"x" * (max_payload - 40) + b'"}'),
        )
    )


def concrete(subject: str) -> str:
    return subject.replace(">", "fz").replace("*", "fz")


async def stats_of(nc: nats.NATS, name: str) -> ServiceStats:
    reply = await nc.request(NAMES.service_stats(name), protocol.encode(StatsRequest()), timeout=5)
    return protocol.decode(protocol.decoder_for(ServiceStats), reply.data)


async def test_every_declared_endpoint_survives_hostile_input(nats_server, tmp_path, seed) -> None:
    rng = random.Random(seed)
    async with running_cluster(nats_server, tmp_path, engines=1, shadows=True, sandboxes=True) as cluster:
        nc = cluster.client.nc
        main_pid = await cluster.engine_pid("e0")
        names = ["router", "weight-server", "kv-server", "shadow-supervisor", f"worker.e0.{main_pid}"]
        if IN_CI or "checkpointer" in cluster.supervisor.children:  # off CI, Docker may be missing
            assert "checkpointer" in cluster.supervisor.children, "no checkpointer: is Docker up?"
            names += [f"checkpointer.{hostname_id()}", "policy"]
        before = {name: await stats_of(nc, name) for name in names}
        pids_before = {name: child.pid for name, child in cluster.supervisor.children.items()}
        declared = {concrete(e.subject): e.reply for stats in before.values() for e in stats.endpoints}
        endpoints = sorted(declared)
        loop = asyncio.get_running_loop()
        sent: dict[str, int] = dict.fromkeys(endpoints, 0)
        replies = {"error": 0, "dropped": 0}

        async def send(subject: str, payload: bytes) -> None:
            sent[subject] += 1
            if not declared[subject]:
                await nc.publish(subject, payload)  # one-way: dropped with a logged reason
                replies["dropped"] += 1
                return
            reply = await nc.request(subject, payload, timeout=5)
            answer = protocol.decode(protocol.decoder_for(ErrorReply), reply.data)
            assert answer.code == "bad-request", (subject, payload[:80], answer)
            replies["error"] += 1

        @settings(
            max_examples=12 * len(endpoints),
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.sampled_from(endpoints), hostile(nc.max_payload))
        def fuzz(subject: str, payload: bytes) -> None:
            asyncio.run_coroutine_threadsafe(send(subject, payload), loop).result(15)

        await asyncio.to_thread(fuzz)
        for subject in endpoints:  # every endpoint got the deepest nesting at least once
            await send(subject, DEEP)

        await nc.flush()

        def hits(name: str) -> int:
            return sum(sent[concrete(e.subject)] for e in before[name].endpoints)

        async def counted() -> dict[str, ServiceStats] | None:
            now = {name: await stats_of(nc, name) for name in names}
            done = all(moved(before[n], now[n]) >= hits(n) for n in names)
            return now if done else None

        after = await poll(counted, timeout_s=30, every_s=0.2)
        job = make_job(rng, "after-fuzz", max_tokens=64)
        result = await run(cluster.client, job)
        pids_after = {name: child.pid for name, child in cluster.supervisor.children.items()}
        main_after = await poll(lambda: cluster.engine_pid("e0"))

    assert all(count > 0 for count in sent.values()), sent
    for name in names:
        assert moved(before[name], after[name]) >= hits(name), name
        assert after[name].pid == before[name].pid
    assert replies["error"] > 50 and replies["dropped"] > 20, replies
    assert pids_after == pids_before and main_after == main_pid  # nothing died and was replaced
    assert result.tokens == reference_tokens([job])[job.request_id]


def moved(before: ServiceStats, after: ServiceStats) -> int:
    return after.errors.get("bad-request", 0) - before.errors.get("bad-request", 0)
