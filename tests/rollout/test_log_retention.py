"""The token log's retention (services/router/retention.py): each client holds at most its share of
the log, an ended request leaves it once it has been over for --ended-keep, and a successor router
reads only the requests in flight, while an ended one stays attachable until it leaves."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Awaitable, Callable

import nats.js.errors
import pytest
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.services.router.retention import Retention
from belayer_rl.services.router.router import Router
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import RouterConfig
from belayer_rl.shared.protocol import CancelRequest, GenerateRequest, LogStart, RouterStarted
from tests.rollout.test_router_engines import in_process_router
from tests.rollout.test_worker_faults import make_job, run
from tests.support import EventLog, kill, poll, reference_tokens, running_cluster

K = 16


def big_request(request_id: str, inbox: str, tokens: int = 15_000) -> GenerateRequest:
    """A prompt of `tokens` ids of four bytes each in the log (`200,`): 60 KB by default."""
    return GenerateRequest(
        request_id=request_id,
        prompt="",
        prompt_tokens=[200] * tokens,
        max_tokens=4,
        weight_version="w",
        reply_to=inbox,
    )


async def with_tasks(router: Router, body: Callable[[], Awaitable[None]]) -> None:
    """Run `body` while the router holds its lease and runs its log writer, retention and watchdog."""
    await router.lease.acquire()
    loops = (router.lease.renew(), router.writer.run(), router.retention.run(), router.watchdog())
    tasks = [asyncio.create_task(loop) for loop in loops]
    try:
        await body()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def fill_as_greedy(nats_server, cluster_id: str) -> tuple[int, ServiceError, ServiceError | None]:  # type: ignore[no-untyped-def]
    """Client "greedy" sends 60 KB prompts to a router with a 1 MiB log until it is refused; then
    client "other" asks once. Returns greedy's accepted count, its refusal, and other's (None: taken)."""
    refusal: list[ServiceError] = []
    other: list[ServiceError | None] = []
    accepted = 0
    async with in_process_router(nats_server, cluster_id=cluster_id, log_max_mb=1) as router:

        async def body() -> None:
            nonlocal accepted
            inbox = router.nc.new_inbox()
            for i in range(40):
                try:
                    await router.on_generate(
                        big_request(f"greedy-{i}", inbox), router.subjects.router_generate("greedy")
                    )
                except ServiceError as exc:
                    refusal.append(exc)
                    break
                accepted += 1
            await asyncio.sleep(token_log.ROOM_CHECK_S + 0.1)  # the router reads the log's size again
            try:
                await router.on_generate(
                    big_request("other", inbox, 100), router.subjects.router_generate("other")
                )
                other.append(None)
            except ServiceError as exc:
                other.append(exc)

        await with_tasks(router, body)
    return accepted, refusal[0], other[0]


async def test_a_client_past_its_share_of_the_log_is_refused_and_the_others_go_on(
    nats_server, monkeypatch
) -> None:
    """Trust finding 10: one client's huge prompts filled the log and every client was refused for
    up to a day. With a quarter of the room as each client's share (236 KB of a 1 MiB log), the
    greedy client is refused after three 60 KB prompts, by name, and another client is still taken.
    Mutation check, run here: without the share the greedy client fills the log to nine tenths and
    the other client is refused too."""
    accepted, refusal, other = await fill_as_greedy(nats_server, "shared")
    assert accepted == 3, accepted
    assert refusal.code == "log-full" and "client greedy holds" in refusal.message, refusal
    assert other is None, other

    monkeypatch.setattr(Retention, "check_share", lambda self, start: None)
    accepted, refusal, other = await fill_as_greedy(nats_server, "unshared")
    assert accepted > 10 and refusal.code == "log-full"
    assert other is not None and other.code == "log-full", other


async def subject_is_empty(js, subject: str, stream: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return True
    return False


async def test_an_ended_request_leaves_the_log_after_its_keep_and_a_successor_purges_what_is_left(
    nats_server,
) -> None:
    """With --ended-keep 1 s: an ended request's records and index entry are gone about a second
    after its end, its bytes no longer count against its client, its id may be used again, and a
    request still running keeps all of its records. A router that stops before a closed request is
    due leaves it to its successor, which purges it on time. Mutation checks, run by hand: without
    `purge_due` the ended request's records stay; without `load_closed` the successor never
    purges its predecessor's."""
    settings = {"cluster_id": "keep", "ended_keep_s": 1.0}
    async with in_process_router(nats_server, **settings) as router:
        js, names, cli = router.js, router.subjects, router.subjects.router_generate("cli")
        inbox = router.nc.new_inbox()

        async def first_life() -> None:
            for request_id in ("gone", "kept"):
                await router.on_generate(big_request(request_id, inbox, 1000), cli)
            assert not await subject_is_empty(js, names.request_open("gone"), names.request_index_stream)
            await router.on_cancel(CancelRequest(request_id="gone"), cli)

            async def closed() -> bool | None:
                return (
                    not await subject_is_empty(js, names.request_closed("gone"), names.request_index_stream)
                    or None
                )

            await poll(closed, timeout_s=5, every_s=0.05)
            assert not await subject_is_empty(js, names.token_log("gone"), names.token_log_stream)
            assert await subject_is_empty(js, names.request_open("gone"), names.request_index_stream)

            async def purged() -> bool | None:
                return await subject_is_empty(js, names.token_log("gone"), names.token_log_stream) or None

            await poll(purged, timeout_s=5, every_s=0.05)
            assert await subject_is_empty(js, names.request_closed("gone"), names.request_index_stream)
            assert set(router.writer.usage.requests) == {"kept"}
            kept = await token_log.read_request(js, names, "kept")
            assert kept is not None and kept.end is None and kept.start.prompt_tokens == [200] * 1000

            await asyncio.sleep(1.0)  # the router forgets "gone" too; the same id is a new request
            await router.on_generate(big_request("gone", inbox, 10), cli)
            again = await token_log.read_request(js, names, "gone")
            assert again is not None and again.start.prompt_tokens == [200] * 10 and again.end is None
            await router.on_cancel(CancelRequest(request_id="gone"), cli)
            await poll(closed, timeout_s=5, every_s=0.05)  # stopped now, before it is due
            assert not await subject_is_empty(js, names.token_log("gone"), names.token_log_stream)

        await with_tasks(router, first_life)

    async with in_process_router(nats_server, **settings) as successor:
        js = successor.js

        async def second_life() -> None:
            async def purged() -> bool | None:
                return await subject_is_empty(js, names.token_log("gone"), names.token_log_stream) or None

            await poll(purged, timeout_s=5, every_s=0.05)
            assert not await subject_is_empty(js, names.token_log("kept"), names.token_log_stream)

        await with_tasks(successor, second_life)


async def test_a_takeover_reads_only_the_requests_in_flight(nats_server, tmp_path, seed) -> None:
    """The active router is killed while 2 requests run and 12 have ended. Its standby rebuilds the
    2 it finds open in the request index, not all 14, and they complete token-exact; an ended one
    is still attachable through it, to its owner alone, and asking for it again by its id follows
    it. Mutation check, run by hand: with the whole log read at a takeover, 14 are rebuilt."""
    rng = random.Random(seed)
    options = {"engines": 1, "chunk_tokens": K, "standby_routers": 1, "lease_ttl_s": 1.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        client = cluster.client
        started = await EventLog.start(client, "router_started")
        ended_jobs = [make_job(rng, f"ended-{i}", max_tokens=8) for i in range(12)]
        ended = await asyncio.gather(*(run(client, job) for job in ended_jobs))
        long_jobs = [make_job(rng, f"long-{i}", max_tokens=400, min_tokens=400) for i in range(2)]
        running = [asyncio.create_task(run(client, job)) for job in long_jobs]

        async def mid_stream() -> bool | None:
            status = await client.status()
            return (
                True
                if len(status.requests) == 2 and all(K < r.num_tokens < 300 for r in status.requests)
                else None
            )

        await poll(mid_stream, timeout_s=60)
        holder = await lease_holder(client.nc.jetstream(), client.subjects)
        assert holder is not None
        kill(holder.pid, signal.SIGKILL)
        successor = await started.wait_for(
            lambda e: isinstance(e, RouterStarted) and e.incarnation > holder.incarnation, timeout_s=30
        )
        finished = await asyncio.gather(*running)

        attached: list[int] = []
        async for item in client.attach("ended-3"):
            if isinstance(item, protocol.TokenChunk):
                attached.extend(item.tokens)
        again = await client.generate_all("another prompt", max_tokens=8, request_id="ended-5")
        stranger = Client(client.nc, client="stranger")
        with pytest.raises(ServiceError) as unknown:
            async for _ in stranger.attach("ended-7"):
                pass

    assert isinstance(successor, RouterStarted)
    assert successor.rebuilt_requests == 2 and successor.resumed_requests == 2, successor
    expected = reference_tokens(long_jobs)
    assert [result.tokens for result in finished] == [expected[job.request_id] for job in long_jobs]
    assert attached == ended[3].tokens
    assert again.tokens == ended[5].tokens
    assert unknown.value.code == "unknown-request"


async def test_a_log_of_an_earlier_version_is_indexed_once_and_kept(nats_server) -> None:
    """A token log made before the request index: JetStream never lifts its deny-purge, and its
    requests have no index entries. The router still starts; its first takeover reads the log
    whole, once, rebuilds the running request and the ended one, and indexes them; ended requests
    are not purged (they age out) and the router says so. Mutation checks, run by hand: updating
    the stream with deny-purge off fails every start (JetStream refuses it), and without the whole
    read the running request is not rebuilt."""
    names = RouterConfig(nats_url=nats_server.url, cluster_id="old").subjects
    nc = await bus.connect(nats_server.url, "test-old-log")
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=names.token_log_stream, subjects=[names.token_log_all], storage=StorageType.FILE,
                discard=DiscardPolicy.NEW, max_bytes=1 << 30, deny_delete=True, deny_purge=True,
            )
        )  # fmt: skip
        for request_id, ended in (("was-running", False), ("had-ended", True)):
            start = LogStart(
                request_id=request_id, prompt_tokens=[1, 2], max_tokens=8, chunk_tokens=4, owner="cli"
            )
            after = await token_log.append(js, names, start, 0, incarnation=0)
            if ended:
                end = protocol.LogEnd(request_id=request_id, finish_reason="length", num_tokens=0)
                await token_log.append(js, names, end, after, incarnation=0)
    finally:
        await nc.close()

    async with in_process_router(nats_server, cluster_id="old", ended_keep_s=0.5) as router:
        rebuilt: list[RouterStarted] = []

        async def takeover() -> None:
            rebuilt.append(await router.rebuild())
            await asyncio.sleep(1.5)  # past --ended-keep: the ended one is due, but is not purged

        await with_tasks(router, takeover)
        js = router.js
        assert await router.retention.open_ids() == {"was-running"}
        assert not router.retention.purgeable
        still = await token_log.read_request(js, names, "had-ended")
    assert rebuilt[0].rebuilt_requests == 2 and rebuilt[0].resumed_requests == 1, rebuilt
    assert still is not None and still.end is not None
