"""The token log and the prefix pointers are durable, and nothing still needed is evicted: a full
log refuses new requests with a clear error while the running ones finish and keep their records;
on a 3-node nats-server cluster with 3 replicas, killing the stream's leader loses no acknowledged
chunk and no acknowledged pointer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from belayer_rl.services.checkpointer import pointer
from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from belayer_rl.shared.protocol import LogChunk, LogStart, PrefixPointer, SamplingParams
from tests.rollout.test_worker_faults import make_job
from tests.support import NAMES, Job, kill, poll, reference_tokens, running_cluster


async def started(client: Client, job: Job) -> tuple[AsyncIterator[object], protocol.TokenChunk]:
    """The stream of a generation of `job`, once it has brought its first chunk."""
    stream = client.generate(
        job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=job.temperature,
        request_id=job.request_id,
    )  # fmt: skip
    first = await anext(stream)
    assert isinstance(first, protocol.TokenChunk)
    return stream, first


async def test_a_full_log_refuses_new_requests_and_keeps_the_running_ones(
    nats_server, tmp_path, seed
) -> None:
    """A 1 MiB log, filled to nine tenths behind a running request's back: its worker is stopped
    after the first tokens (with a heartbeat timeout longer than the fill), so it is surely still
    running. Mutation check: without the room check the new request is accepted, and with discard
    OLD (the earlier setting) the running request's LogStart is the first record evicted."""
    rng = random.Random(seed)
    options = {"engines": 1, "log_max_mb": 1, "heartbeat_timeout_s": 30.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        js = cluster.client.nc.jetstream()
        worker = await cluster.engine_pid("e0")
        job = make_job(rng, "running", max_tokens=400)
        stream, first = await started(cluster.client, job)
        kill(worker, signal.SIGSTOP)
        try:
            running = [r.request_id for r in (await cluster.client.status()).requests]
            assert running == ["running"], "it ended before its worker stopped: a faster machine"
            for i in range(10):  # 950 KB of another writer's records on the log's subjects
                await js.publish(NAMES.token_log(f"filler-{i}"), b"x" * 95_000)
            await asyncio.sleep(1.1)  # the router's last reading of the log's size is older than this
            with pytest.raises(ServiceError) as refused:
                await cluster.client.generate_all("refused", max_tokens=4, seed=1)
        finally:
            kill(worker, signal.SIGCONT)
        tokens = list(first.tokens)
        async for item in stream:
            if isinstance(item, protocol.TokenChunk):
                tokens.extend(item.tokens)

        async def ended() -> tuple[dict[str, token_log.LoggedRequest], list[protocol.PoisonedRecord]] | None:
            # The router tells the client first and appends the LogEnd after: under load it lags.
            logged, skipped = await token_log.read_all(js, NAMES)
            return (logged, skipped) if logged["running"].end is not None else None

        logged, skipped = await poll(ended, timeout_s=10.0, every_s=0.2)

    assert refused.value.code == "log-full" and "--log-max-mb" in refused.value.message
    assert tokens == reference_tokens([job])[job.request_id]
    assert logged["running"].tokens == tokens  # nothing of it evicted, its end included
    assert len(skipped) == 10  # the filler records, reported as undecodable and skipped


async def test_a_client_hears_of_an_end_only_once_the_log_holds_it(nats_server, tmp_path, seed) -> None:
    """Trust finding 9: the router told a client its request ended before the LogEnd was appended,
    so a successor rebuilding from the log could find running what a client saw end. Here the log
    is filled to its bound while the request runs (its worker stopped): the end cannot be logged,
    and the client must not hear of it; once the bound is raised, the end is logged and then told.
    Mutation check: telling the clients in `close` (the old order) fails the first assertion."""
    rng = random.Random(seed)
    options = {"engines": 1, "log_max_mb": 1, "heartbeat_timeout_s": 30.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        js = cluster.client.nc.jetstream()
        worker = await cluster.engine_pid("e0")
        job = make_job(rng, "durable-end", max_tokens=200)
        stream, first = await started(cluster.client, job)
        fillers: list[str] = []
        kill(worker, signal.SIGSTOP)
        try:
            for size in (50_000, 5_000, 500, 50, 1):  # another writer's records, up to the bound
                while True:
                    subject = NAMES.token_log(f"filler-{len(fillers)}")
                    try:
                        await js.publish(subject, b"x" * size)
                    except nats.js.errors.APIError:
                        break
                    fillers.append(subject)
        finally:
            kill(worker, signal.SIGCONT)
        tokens = list(first.tokens)

        async def follow() -> protocol.GenerateEnd | protocol.GenerateError:
            async for item in stream:
                if isinstance(item, protocol.TokenChunk):
                    tokens.extend(item.tokens)
                else:
                    return item
            raise AssertionError("the stream stopped without an end")

        end = asyncio.ensure_future(follow())
        await asyncio.sleep(3.0)  # the worker has long finished: only the log holds the end up
        assert not end.done(), "the client heard of an end that the log does not hold"
        # Room again (nothing may purge the log: its bound is raised instead).
        stream_config = (await js.stream_info(NAMES.token_log_stream)).config
        await js.update_stream(dataclasses.replace(stream_config, max_bytes=4 << 20))
        told = await asyncio.wait_for(end, 30.0)
        logged, _ = await token_log.read_all(js, NAMES)
    assert isinstance(told, protocol.GenerateEnd) and told.num_tokens == len(tokens)
    assert logged[job.request_id].end is not None and logged[job.request_id].tokens == tokens
    assert tokens == reference_tokens([job])[job.request_id]


# ---------------------------------------------------------------- a 3-node cluster


@contextlib.asynccontextmanager
async def nats_cluster(folder: Path) -> AsyncIterator[dict[str, tuple[str, asyncio.subprocess.Process]]]:
    """Three nats-servers with JetStream, routed to each other on loopback: name -> (url, process)."""
    names = ["n1", "n2", "n3"]
    ports = {name: (free_port(), free_port()) for name in names}
    servers: dict[str, tuple[str, asyncio.subprocess.Process]] = {}
    try:
        for name in names:
            client_port, route_port = ports[name]
            routes = ", ".join(f"nats-route://127.0.0.1:{ports[o][1]}" for o in names if o != name)
            config = folder / f"{name}.conf"
            config.write_text(
                f"server_name: {name}\n"
                f"cluster {{ name: belayer-test, listen: 127.0.0.1:{route_port}, routes: [{routes}] }}\n"
            )
            process = await start_nats_server(folder / name, client_port, folder / f"{name}.log", config)
            servers[name] = (f"nats://127.0.0.1:{client_port}", process)
        yield servers
    finally:
        for _, process in servers.values():
            await stop_process(process)


async def declared(nc, replicas: int):  # type: ignore[no-untyped-def]
    """The token log and the pointer bucket, once the cluster's JetStream has a meta leader."""
    js = nc.jetstream()
    for _ in range(150):
        try:
            await bus.declare_jetstream(js, NAMES, replicas=replicas)
            return js, await pointer.declare(js, NAMES, replicas=replicas)
        except Exception:  # no meta leader yet
            await asyncio.sleep(0.2)
    raise AssertionError("JetStream cluster not ready in 30 s")


async def advance_until_acknowledged(kv, mark: PrefixPointer) -> None:  # type: ignore[no-untyped-def]
    """Advance the pointer as the checkpointer does: an answer lost in the election is no answer,
    so read again; bounded."""
    for _ in range(150):
        try:
            moved, now = await pointer.advance(kv, mark)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            await asyncio.sleep(0.2)
            continue
        assert moved or (now is not None and now.checkpoint_id == mark.checkpoint_id), now
        return
    raise AssertionError(f"pointer {mark.k} not acknowledged in 30 s")


async def test_killing_the_stream_leader_loses_no_acknowledged_chunk_or_pointer(tmp_path) -> None:
    async with nats_cluster(tmp_path) as servers:
        urls = ",".join(url for url, _ in servers.values())
        nc = await bus.connect(urls, "test-durability")
        try:
            js, kv = await declared(nc, replicas=3)
            info = await js.stream_info(NAMES.token_log_stream)
            # No record is deleted one by one; the router purges a request's subject once it is
            # long over (services/router/retention.py), so purges are allowed.
            assert info.config.num_replicas == 3 and info.config.deny_delete
            leader = info.cluster.leader
            start = LogStart(request_id="dur", prompt_tokens=[1], max_tokens=4096, sampling=SamplingParams(),
                             chunk_tokens=8)  # fmt: skip
            after = await token_log.append(js, NAMES, start, 0, incarnation=0)
            acked_chunks, acked_k = 0, 0
            for i in range(60):
                if i == 20:  # mid-stream: the stream's leader dies
                    servers[leader][1].send_signal(signal.SIGKILL)
                chunk = LogChunk(request_id="dur", index=i, position=8 * i, tokens=[i % 256] * 8, attempt=1)
                after = await token_log.append(
                    js, NAMES, chunk, after, incarnation=0
                )  # retries through the election
                acked_chunks = i + 1
                mark = PrefixPointer(trajectory="traj", host_id="h", sandbox="s", checkpoint_id=f"i0-k{i + 1}-0a0a0a0a",
                                     incarnation=0, k=i + 1)  # fmt: skip
                await advance_until_acknowledged(kv, mark)
                acked_k = i + 1
        finally:
            await nc.close()

        survivors = ",".join(url for name, (url, _) in servers.items() if name != leader)
        reader = await bus.connect(survivors, "test-durability-read")
        try:
            rjs = reader.jetstream()
            for _ in range(60):  # the survivors may still be electing a metadata leader: ask again
                try:
                    logged, skipped = await token_log.read_all(rjs, NAMES)
                    kv_again = await rjs.key_value(NAMES.prefix_pointer_bucket)
                    current, _ = await pointer.read(kv_again, "traj")
                    new_leader = (await rjs.stream_info(NAMES.token_log_stream)).cluster.leader
                    break
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                    await asyncio.sleep(0.5)
            else:
                raise AssertionError("the surviving servers did not answer in 30 s")
        finally:
            await reader.close()

    assert new_leader != leader
    assert skipped == [] and acked_chunks == 60
    assert logged["dur"].tokens == [t for i in range(acked_chunks) for t in [i % 256] * 8]
    assert current is not None and current.k == acked_k == 60
    assert isinstance(logged["dur"].start, protocol.LogStart)


async def test_an_acknowledged_cancel_is_never_resurrected_by_a_successor(
    nats_server, tmp_path, seed
) -> None:
    """The token log stops taking appends (the stream's subjects moved away, as an operator's
    mistake or a lost stream would) while a request runs; the client cancels it, and the active
    router is SIGKILLed before the log comes back. A successor rebuilds from the log: a cancel that
    was acknowledged must stay ended there. The router acknowledges a cancel only once its LogEnd
    is durable, so here the first cancel is refused as not yet durable, and asked again once the log
    is back. Mutation check, run by hand: acknowledging at once (the earlier code) lets the
    successor adopt the request and run it on, and the test fails."""
    rng = random.Random(seed)
    options = {"engines": 1, "standby_routers": 1, "lease_ttl_s": 1.0, "heartbeat_timeout_s": 30.0}
    async with running_cluster(nats_server, tmp_path, **options) as cluster:
        js = cluster.client.nc.jetstream()
        job = make_job(rng, "cancelled", max_tokens=400, min_tokens=400)  # no end of its own (eos)
        stream = cluster.client.generate(
            job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=job.temperature,
            request_id=job.request_id, min_tokens=job.min_tokens,
        )  # fmt: skip
        assert isinstance(await anext(stream), protocol.TokenChunk)
        worker = await cluster.engine_pid("e0")
        kill(worker, signal.SIGSTOP)  # it holds the request, mid-decode, until the end of the test
        router_pid = next(c.pid for n, c in cluster.supervisor.children.items() if n == "router")
        config = (await js.stream_info(NAMES.token_log_stream)).config
        subjects = list(config.subjects or [])
        await js.update_stream(dataclasses.replace(config, subjects=["belayer-test.nowhere.>"]))
        try:
            try:
                await cluster.client.cancel(job.request_id, patience_s=2.0)
                acknowledged_early = True
            except ServiceError as exc:
                assert exc.code == "log-unavailable", exc
                acknowledged_early = False
            if not acknowledged_early:
                await js.update_stream(dataclasses.replace(config, subjects=subjects))
                await cluster.client.cancel(job.request_id, patience_s=30.0)
            kill(router_pid, signal.SIGKILL)
        finally:
            await js.update_stream(dataclasses.replace(config, subjects=subjects))
        try:
            successor = await poll(lambda: rebuilt(cluster, router_pid), timeout_s=30)
            assert job.request_id not in {r.request_id for r in successor.requests}, (
                "a cancel the client saw acknowledged was resurrected"
            )
            logged, _ = await token_log.read_all(js, NAMES)
            end = logged[job.request_id].end
            assert end is not None and end.finish_reason == "cancelled"
        finally:
            kill(worker, signal.SIGCONT)


async def rebuilt(cluster, old_pid: int) -> protocol.RouterStatus | None:  # type: ignore[no-untyped-def]
    """The status from a router other than `old_pid`, once one answers."""
    with contextlib.suppress(ServiceError):
        status = await cluster.client.status()
        holder = await lease_holder(cluster.client.nc.jetstream(), NAMES)
        if holder is not None and holder.pid != old_pid:
            return status
    return None


async def test_an_end_is_never_logged_without_the_chunks_dropped_before_it(nats_server, monkeypatch) -> None:
    """The log stops taking appends while two chunks of a request are written: both are dropped.
    The log comes back before the request's end. A reader places a chunk only where it continues
    the log, so an end written alone would stand for a request whose tokens the log lacks: a
    successor would answer an attach with fewer tokens than were generated. The writer writes the
    dropped chunks again, in order, before anything else of the request. Mutation check, run by
    hand: without `fill_gap` the log ends the request with no tokens."""
    monkeypatch.setattr(token_log, "MAX_PUBLISH_TRIES", 2)  # drop within a second, not two minutes
    monkeypatch.setattr(token_log, "PUBLISH_TIMEOUT_S", 0.2)
    nc = await bus.connect(nats_server.url, "test-writer")
    writer_task = None
    try:
        js = nc.jetstream()
        await bus.declare_jetstream(js, NAMES)
        writer = token_log.LogWriter(js, NAMES, token_log.Usage(), lambda request_id, sequence: None)
        writer.incarnation = 1
        start = LogStart(request_id="r1", prompt_tokens=[1, 2], max_tokens=8, chunk_tokens=4)
        await writer.append_now(start)
        writer_task = asyncio.create_task(writer.run())
        chunks = [
            LogChunk(request_id="r1", index=i, position=4 * i, tokens=[10 + 4 * i + j for j in range(4)],
                     attempt=1, incarnation=1)
            for i in range(2)
        ]  # fmt: skip
        config = (await js.stream_info(NAMES.token_log_stream)).config
        subjects = list(config.subjects or [])
        await js.update_stream(dataclasses.replace(config, subjects=["belayer-test.nowhere.>"]))
        try:
            dropped = [await writer.put(chunk) for chunk in chunks]
        finally:
            await js.update_stream(dataclasses.replace(config, subjects=subjects))
        assert [error.code if error else None for error in dropped] == ["log-unavailable"] * 2
        end = protocol.LogEnd(request_id="r1", finish_reason="length", num_tokens=8, incarnation=1)
        assert await writer.put(end) is None
        logged, _ = await token_log.read_all(js, NAMES)
        assert logged["r1"].end is not None
        assert logged["r1"].tokens == [t for chunk in chunks for t in chunk.tokens]
    finally:
        if writer_task is not None:
            writer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer_task
        await nc.close()
