"""One engine credential answers for the router's questions: its answers are its own word only.

Findings 1 and 2 of the trust review, attacked from outside a real local cluster (authorizing
nats-server, router and standby, two workers). The attacker holds engine e0's credential, which
the bus lets subscribe to e0's dispatch and adopt subjects and answer there; the real e0 worker is
stopped (SIGSTOP) so that only the attacker answers. Heartbeat timeouts are long, so a stopped
worker is not declared failed while the attack runs.

1. A `fenced` answer to a dispatch or an adopt made the router step down without asking the lease,
   and every standby that took over asked e0 again: the routers crash-looped. Now the router steps
   down only when the lease bucket names a later incarnation; otherwise e0's epoch is distrusted
   and its requests go elsewhere.
2. A takeover's adopt answers were trusted: e0 could answer as e1, with an attempt on a request e1
   runs, and end it with tokens of its own making. Now an answer counts only for the engine whose
   subject was asked, and an attempt only where the token log's LogDispatch records name it.

Each generation is checked token for token against the same request run without the attack: the
mutation an attacker makes (invented tokens, a lost lease) shows up there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from belayer_rl.cli.cluster import ClusterConfig, Supervisor, local_cluster
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import AdoptReply, AdoptRequest, ErrorReply, HeldAttempt, TokenChunk
from tests.support import Job, cluster_config, poll, reference_tokens


@contextlib.contextmanager
def stopped(*pids: int) -> Iterator[None]:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def as_engine(cluster: Supervisor, engine_id: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(
        cluster.nats_url, allow_reconnect=False, **cluster.access(f"engine-{engine_id}").connect_options()
    )
    try:
        yield nc
    finally:
        await nc.close()


def config(tmp_path: Path, **options: object) -> ClusterConfig:
    options = {"engines": 2, "shadows": False, "sandboxes": False, "heartbeat_timeout_s": 60.0, **options}
    return cluster_config(tmp_path / "state", **options)


async def test_a_false_fenced_answer_does_not_unseat_the_router(tmp_path: Path) -> None:
    jobs = [Job(f"fenced-{i}", f"prompt number {i}", max_tokens=24, seed=i) for i in range(6)]
    expected = await asyncio.to_thread(reference_tokens, jobs)
    async with local_cluster(config(tmp_path, standby_routers=1)) as cluster:
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            before = await client.wait_for_engines(2, 120)
            e0 = next(e for e in before.engines if e.engine_id == "e0")
            answered: list[str] = []

            async def say_fenced(msg: Msg) -> None:
                answered.append(msg.subject)
                await msg.respond(protocol.encode(ErrorReply(code="fenced", message="a later router asked")))

            async with as_engine(cluster, "e0") as attacker:
                await attacker.subscribe(cluster.subjects.worker_dispatch("e0"), cb=say_fenced)
                await attacker.subscribe(cluster.subjects.worker_adopt("e0"), cb=say_fenced)
                await attacker.flush()
                with stopped(e0.pid):
                    results = await asyncio.wait_for(
                        asyncio.gather(
                            *(
                                client.generate_all(
                                    job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8
                                )
                                for job in jobs
                            )
                        ),
                        60,
                    )
                    after = await client.status()
    assert answered, "the attacker was never asked: the test proves nothing"
    assert after.incarnation == before.incarnation, "a false `fenced` answer unseated the router"
    assert {job.request_id: r.tokens for job, r in zip(jobs, results, strict=True)} == {
        job.request_id: expected[job.request_id] for job in jobs
    }
    assert not next(e for e in after.engines if e.engine_id == "e0").alive, "e0 is still trusted"


@pytest.mark.parametrize("claims", ["the-victim", "itself"])
async def test_a_forged_adopt_answer_cannot_end_another_engines_request(tmp_path: Path, claims: str) -> None:
    """The attacker answers the new router's adopt on e0 with an attempt, one past the real one,
    on the request that e1 runs, ended with invented tokens: claiming to be e1 (its epoch and pid),
    or as itself (no LogDispatch names e0 for that request). The request is young (no whole chunk
    logged), so the log's prefix checks nothing."""
    job = Job("adopt-forged", "whose request is this", max_tokens=400, seed=11)
    expected = (await asyncio.to_thread(reference_tokens, [job]))[job.request_id]
    async with local_cluster(config(tmp_path, chunk_tokens=1024)) as cluster:
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            engines = {e.engine_id: e for e in (await client.wait_for_engines(2, 120)).engines}
            stream = client.generate(job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8)
            first = await anext(stream)
            assert isinstance(first, TokenChunk), "the request must still run when it is held"
            tokens = list(first.tokens)
            with stopped(*(e.pid for e in engines.values())):
                held = next(r for r in (await client.status()).requests if r.request_id)
                victim = engines[held.engine_id]
                forger = "e0" if victim.engine_id == "e1" else "e1"
                impostor = victim if claims == "the-victim" else engines[forger]
                forged = AdoptReply(
                    engine_id=impostor.engine_id,
                    epoch=impostor.epoch,
                    pid=impostor.pid,
                    attempts=[
                        HeldAttempt(
                            request_id=held.request_id,
                            attempt=held.attempt + 1,
                            incarnation=held.attempt >> 32,
                            tokens=[7] * job.max_tokens,
                            finish_reason="length",
                        )
                    ],
                )
                answered: list[str] = []

                async def answer(msg: Msg) -> None:
                    answered.append(msg.subject)
                    await msg.respond(protocol.encode(forged))

                async with as_engine(cluster, forger) as attacker:
                    await attacker.subscribe(cluster.subjects.worker_adopt(forger), cb=answer)
                    await attacker.flush()
                    router = cluster.children["router"]
                    old_pid = router.pid
                    os.kill(old_pid, signal.SIGKILL)
                    await poll(lambda: asyncio.sleep(0, answered or None), timeout_s=60)
                    await asyncio.sleep(1.0)  # the new router weighs the answers
            async for item in stream:  # the engines run again: the request ends
                if isinstance(item, TokenChunk):
                    tokens += item.tokens
    assert router.pid != old_pid
    assert tokens == expected, "the forged answer's tokens reached the client"


async def test_two_routers_of_one_incarnation_are_told_apart(tmp_path: Path) -> None:
    """Finding 9's fence: were a lease revision lost (a power cut with writes not yet on disk), a
    second router could take the same incarnation again. Workers then take only the first router
    they heard of that incarnation: an adopt with the current incarnation but another holder is
    refused as `fenced`, one from the lease's holder is answered. Sent with the router credential,
    as a second router would."""
    async with local_cluster(config(tmp_path, engines=1)) as cluster:
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            await client.wait_for_engines(1, 120)
            await client.generate_all("the worker hears the real router", max_tokens=4, seed=1)
        async with await Client.connect(cluster.target("admin"), "test-admin") as admin:
            lease = await lease_holder(admin.nc.jetstream(), cluster.subjects)
        assert lease is not None and lease.holder
        nc = await nats.connect(
            cluster.nats_url, allow_reconnect=False, **cluster.access("router").connect_options()
        )
        try:
            answers = {}
            for holder in ("a-second-router", lease.holder):
                ask = AdoptRequest(incarnation=lease.incarnation, holder=holder)
                reply = await nc.request(cluster.subjects.worker_adopt("e0"), protocol.encode(ask), timeout=5)
                answers[holder] = protocol.decode(protocol.decoder_for(AdoptReply | ErrorReply), reply.data)
        finally:
            await nc.close()
    refused, answered = answers["a-second-router"], answers[lease.holder]
    assert isinstance(refused, ErrorReply) and refused.code == "fenced", refused
    assert isinstance(answered, AdoptReply) and answered.engine_id == "e0", answered


async def test_another_requests_chunks_sent_to_a_stream_are_not_taken(tmp_path: Path) -> None:
    """Finding 10: any `cli` holder may attach to any request and name any inbox as its reply_to,
    so the router relays request X's tokens and end into the inbox of a stream that follows Y. The
    client takes only its own request's messages, and Y's tokens stay exact. On the old client, X's
    end (fewer tokens than Y had) ended Y's stream early."""
    short = Job("x-short", "another request", max_tokens=8, seed=3)
    long = Job("y-long", "the stream under attack", max_tokens=300, seed=4)
    expected = await asyncio.to_thread(reference_tokens, [short, long])
    async with local_cluster(config(tmp_path, engines=1)) as cluster:
        async with (
            await Client.connect(cluster.target("cli"), "victim") as victim,
            await Client.connect(cluster.target("cli"), "attacker") as attacker,
            await Client.connect(cluster.target("admin"), "spy") as spy,
        ):
            engine = (await victim.wait_for_engines(1, 120)).engines[0]
            await attacker.generate_all(short.prompt, max_tokens=short.max_tokens, seed=short.seed,
                                        temperature=0.8, request_id=short.request_id)  # fmt: skip
            inboxes: list[str] = []

            async def on_inbox(msg: Msg) -> None:  # the inbox that y's tokens go to
                with contextlib.suppress(protocol.BadMessage):
                    chunk = protocol.decode(protocol.decoder_for(TokenChunk), msg.data)
                    if chunk.request_id == long.request_id:
                        inboxes.append(msg.subject)

            await spy.nc.subscribe("_INBOX.>", cb=on_inbox)
            await spy.nc.flush()
            stream = victim.generate(long.prompt, max_tokens=long.max_tokens, seed=long.seed,
                                     temperature=0.8, request_id=long.request_id)  # fmt: skip
            first = await anext(stream)
            assert isinstance(first, TokenChunk)
            # The spy hears y's first chunk on its own connection, maybe after the victim did.
            await poll(lambda: asyncio.sleep(0, inboxes or None), timeout_s=10)
            tokens = list(first.tokens)
            while len(tokens) <= short.max_tokens:  # y's position past x's end
                item = await anext(stream)
                assert isinstance(item, TokenChunk), item
                tokens += item.tokens
            with stopped(engine.pid):
                attach = protocol.AttachRequest(
                    request_id=short.request_id, from_position=0, reply_to=inboxes[0]
                )
                await bus.request(attacker.nc, cluster.subjects.router_attach(attacker.client), attach, 5.0)
                await asyncio.sleep(0.5)
            async for item in stream:
                if isinstance(item, TokenChunk):
                    tokens += item.tokens
    assert tokens == expected[long.request_id]
