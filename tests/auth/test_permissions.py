"""The bus refuses what a role may not do: nats-server's permissions, not the receivers' goodwill.

A local cluster with its embedded, authorizing nats-server (what `belayer up` runs). Each forged
publish or subscription below is made with real credentials of the wrong role; nats-server must
answer it with a permissions violation (to the client and in its own log), and the cluster must
go on serving token-exact generations. The admin credential makes the same publishes unrefused:
the control that shows the check can tell a refusal from silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings, local_cluster
from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared import bus, protocol, registry
from belayer_rl.shared.access import Access
from belayer_rl.shared.client import Client
from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import (
    FrameSeq,
    Heartbeat,
    ServiceStats,
    StatsRequest,
    StatusRequest,
    TokenChunk,
    WorkerFrame,
)
from tests.support import Job, poll, reference_tokens

VIOLATION_WAIT_S = 2.0


class Refusals:
    """A connection as one role, collecting the errors the server sends it."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.arrived = asyncio.Event()

    async def on_error(self, exc: Exception) -> None:
        self.errors.append(str(exc))
        self.arrived.set()

    async def wait_for(self, subject: str) -> str:
        """The server's violation naming `subject`; fails after VIOLATION_WAIT_S without one."""
        async with asyncio.timeout(VIOLATION_WAIT_S):
            while True:
                for error in self.errors:
                    # nats-py hands the server's -ERR line on lowercased.
                    if "permissions violation" in error.lower() and f'"{subject.lower()}"' in error.lower():
                        return error
                self.arrived.clear()
                await self.arrived.wait()


@contextlib.asynccontextmanager
async def connected(url: str, access: Access) -> AsyncIterator[tuple[NATS, Refusals]]:
    refusals = Refusals()
    nc = await nats.connect(
        url, error_cb=refusals.on_error, allow_reconnect=False, **access.connect_options()
    )
    try:
        yield nc, refusals
    finally:
        await nc.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Supervisor]:
    config = ClusterConfig(state_dir=tmp_path / "state", engines=2, shadows=False, sandboxes=False)
    async with local_cluster(config) as supervisor:
        async with await Client.connect(supervisor.target("cli"), "test-cli") as client:
            await client.wait_for_engines(2, 120)
        yield supervisor


def forbidden_publishes(supervisor: Supervisor) -> dict[str, list[str]]:
    s = supervisor.subjects
    stream_api = f"$JS.API.STREAM.%s.{s.token_log_stream}"
    return {
        "engine-e0": [
            s.sandbox_rpc("somehost", "create", "cli"),  # only the rollout side makes sandboxes
            s.worker_stream("e1"),  # a chunk for another engine
            s.kv_arena("e1"),  # another engine's KV arena (its CUDA IPC handle on a GPU)
            f"$KV.{s.prefix_pointer_bucket}.t1",  # a prefix pointer: the checkpointer's alone
            f"$KV.{s.engine_registry_bucket}.e1",  # another engine's registry entry
            stream_api % "PURGE",
            stream_api % "DELETE",
            stream_api % "UPDATE",
            f"$JS.API.STREAM.DELETE.KV_{s.engine_registry_bucket}",
            s.event("heartbeat", "e1"),
            s.router_generate("cli"),
        ],
        # A Compose engine container holds only its own engine's supervisor credential: it
        # flushes, quarantines and announces that engine alone.
        "shadow-supervisor-e0": [
            s.kv_flush("e1"),  # zeroing another engine's arena under its live worker
            f"$KV.{s.engine_registry_bucket}.e1",  # quarantining another engine
            s.event("handover", "e1"),
            s.event("engine_quarantined", "e1"),
            s.event("process", "worker-e1-main"),
            s.event("process", "router"),  # a forged exit would let a standby take the lease early
            s.worker_dispatch("e0"),
        ],
        "cli": [
            s.worker_dispatch("e0"),  # clients go through the router
            f"$KV.{s.prefix_pointer_bucket}.t1",
            stream_api % "PURGE",
            f"$JS.API.STREAM.DELETE.KV_{s.engine_registry_bucket}",
            f"$JS.API.STREAM.DELETE.OBJ_{s.checkpoint_object_bucket}",
            s.event("handover", "e0"),
        ],
        "trainer": [
            s.worker_dispatch("e0"),
            s.sandbox_rpc("somehost", "create", "cli"),  # its trajectories' sandboxes are its own
            f"$JS.API.STREAM.DELETE.OBJ_{s.weights_object_bucket}",  # it puts weights, never deletes
            f"$JS.API.STREAM.PURGE.OBJ_{s.weights_object_bucket}",
            stream_api % "PURGE",
            s.event("weights_published", "v"),  # only the weight server announces versions
        ],
    }


async def test_an_unauthenticated_connection_is_refused(cluster: Supervisor) -> None:
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        await nats.connect(cluster.nats_url, allow_reconnect=False, max_reconnect_attempts=0)
    # A key the server does not know is refused the same way.
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
        stranger = Path(cluster.config.state_dir) / "stranger.creds"
        from belayer_rl.shared.roles import new_seed

        stranger.write_text(new_seed())
        await nats.connect(
            cluster.nats_url, allow_reconnect=False, **Access(creds=stranger).connect_options()
        )


async def test_the_trainer_may_call_the_rollout_side_in_its_own_name(cluster: Supervisor) -> None:
    """An agentic workload's samples are trajectories: the trainer's credential reaches the
    checkpointer and the policy service and reports their events, as the rollout side does."""
    s = cluster.subjects
    allowed = [
        *(
            s.sandbox_rpc("somehost", verb, "trainer")
            for verb in ("create", "exec", "checkpoint", "restore", "end", "destroy", "list")
        ),
        s.policy_decide,
        *(
            s.event(kind, "t1")
            for kind in ("env_step", "llm_response", "checkpoint_timeout", "policy_fallback")
        ),
    ]
    async with connected(cluster.nats_url, cluster.access("trainer")) as (nc, refusals):
        for subject in allowed:
            await nc.publish(subject, b"{}")
        await nc.flush()
        await asyncio.sleep(VIOLATION_WAIT_S)  # what a refusal would take to arrive
        assert not [e for e in refusals.errors if "permissions violation" in e.lower()], refusals.errors


@pytest.mark.parametrize("role", ["engine-e0", "shadow-supervisor-e0", "cli", "trainer"])
async def test_a_wrong_role_is_refused_by_the_server_and_the_cluster_keeps_serving(
    cluster: Supervisor, role: str
) -> None:
    subjects = forbidden_publishes(cluster)[role]
    payload = protocol.encode(
        WorkerFrame(epoch=1, engine_id="e1", seqs=[FrameSeq("forged", 1, 0, [1, 2, 3], [-0.5, -0.5, -0.5])])
    )
    async with connected(cluster.nats_url, cluster.access(role)) as (nc, refusals):
        for subject in subjects:
            await nc.publish(subject, payload)
        await nc.flush()
        for subject in subjects:
            await refusals.wait_for(subject)
        # Other clients' inboxes and other engines' dispatches cannot be read.
        for pattern in ("_INBOX.>", cluster.subjects.worker_dispatch("e1")):
            await nc.subscribe(pattern)
            await nc.flush()
            await refusals.wait_for(pattern)
        assert not nc.is_closed, "a refused publish must not cost the connection"

    server_log = (cluster.config.state_dir / "logs" / "nats-server.log").read_text()
    for subject in subjects:
        assert f'Publish Violation - Subject "{subject}"' in server_log, subject

    # The cluster still serves, token-exact, with the rightful credential.
    job = Job("after-refusals", "the bus held", max_tokens=24, seed=5)
    async with await Client.connect(cluster.target("cli"), "test-cli") as client:
        result = await client.generate_all(
            job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8
        )
    assert result.tokens == (await asyncio.to_thread(reference_tokens, [job]))[job.request_id]


async def test_the_admin_control_is_not_refused(cluster: Supervisor) -> None:
    """The same publishes with the admin credential draw no violation: the refusals above are
    the permissions' doing, not something every publish gets."""
    subjects = forbidden_publishes(cluster)["engine-e0"][:2]
    async with connected(cluster.nats_url, cluster.access("admin")) as (nc, refusals):
        for subject in subjects:
            await nc.publish(subject, b"{}")
        await nc.flush()
        with pytest.raises(TimeoutError):
            await refusals.wait_for(subjects[0])
        assert refusals.errors == []


# The stats key each role's process answers under (Runtime.stats_key), as its __main__ names it.
SERVICE_NAMES = {
    "router": "router",
    "engine-e0": "worker.e0.4242",  # and its pid
    "shadow-supervisor": "shadow-supervisor",
    "weight-server": "weight-server",
    "kv-server": "kv-server",
    "checkpointer": "checkpointer.somehost",  # one per Docker host, named after it
    "policy": "policy",
    "trainer": "trainer.actor.0",  # its group workers: group and rank
}


async def test_every_service_may_answer_its_own_stats(cluster: Supervisor) -> None:
    """A service's runtime answers stats on its own name; a role that cannot subscribe there has a
    stats endpoint nobody reaches (the checkpointer's, whose name carries its host, was one)."""

    async def refused(role: str, name: str) -> str | None:
        subject = cluster.subjects.service_stats(name)
        async with connected(cluster.nats_url, cluster.access(role)) as (nc, refusals):
            await nc.subscribe(subject)
            await nc.flush()
            with contextlib.suppress(TimeoutError):
                return await refusals.wait_for(subject)
        return None

    answers = await asyncio.gather(*(refused(role, name) for role, name in SERVICE_NAMES.items()))
    assert dict(zip(SERVICE_NAMES, answers, strict=True)) == dict.fromkeys(SERVICE_NAMES)

    # ... and no other's: the engine, trainer and checkpointer credentials could subscribe to every
    # service's stats subject (a wildcard), read what was asked and answer in the router's name.
    others = {
        "engine-e0": ["router", "worker.e1.4242", "checkpointer.somehost"],
        "trainer": ["router", "worker.e0.4242"],
        "checkpointer": ["router", "trainer.actor.0"],
    }
    asked = [(role, name) for role, names in others.items() for name in names]
    answers = await asyncio.gather(*(refused(role, name) for role, name in asked))
    assert all(answers), dict(zip(asked, answers, strict=True))


async def test_each_engine_credential_serves_only_its_own_engine(cluster: Supervisor) -> None:
    """engine-e0 may publish e0's chunks and heartbeats and read e0's dispatches: what it needs."""
    s = cluster.subjects
    async with connected(cluster.nats_url, cluster.access("engine-e0")) as (nc, refusals):
        await nc.subscribe(s.worker_dispatch("e0") + ".probe")  # not its subject either: refused
        await nc.flush()
        await refusals.wait_for(s.worker_dispatch("e0") + ".probe")
        refusals.errors.clear()
        await nc.publish(s.worker_stream("e0"), b"{}")
        await nc.flush()
        with pytest.raises(TimeoutError):
            await refusals.wait_for(s.worker_stream("e0"))


async def test_each_engine_supervisor_credential_serves_only_its_own_engine(cluster: Supervisor) -> None:
    """shadow-supervisor-e0 answers e0's restarts and flushes e0's arena; e1's restarts are not its
    to hear. The every-engine credential (`belayer up`'s one supervisor) hears both."""
    s = cluster.subjects
    async with connected(cluster.nats_url, cluster.access("shadow-supervisor-e0")) as (nc, refusals):
        await nc.subscribe(s.engine_restart("e1"))
        await nc.flush()
        await refusals.wait_for(s.engine_restart("e1"))
        refusals.errors.clear()
        await nc.subscribe(s.engine_restart("e0"))
        await nc.publish(s.kv_flush("e0"), b"{}")
        await nc.publish(s.event("process", "worker-e0-shadow"), b"{}")
        await nc.flush()
        with pytest.raises(TimeoutError):
            await refusals.wait_for(s.kv_flush("e0"))
        assert refusals.errors == []
    async with connected(cluster.nats_url, cluster.access("shadow-supervisor")) as (nc, refusals):
        for engine in ("e0", "e1"):
            await nc.subscribe(s.engine_restart(engine))
            await nc.publish(s.kv_flush(engine), b"{}")
        await nc.flush()
        await asyncio.sleep(0.5)
        assert refusals.errors == []


async def test_a_payload_naming_another_engine_is_dropped_by_the_receiver(cluster: Supervisor) -> None:
    """engine-e0 may publish on its own heartbeat subject, but a heartbeat there that claims to be
    e1 (a newer epoch, another pid) would make the router send e1's requests to the forger. The
    subject is what the bus vouches for: the router drops it and counts a bad-request."""
    s = cluster.subjects
    async with await Client.connect(cluster.target("admin"), "test-admin") as admin:
        before = await admin.status()
        real = next(e for e in before.engines if e.engine_id == "e1")
        stats_before = await bus.request_struct(
            admin.nc, s.service_stats("router"), StatsRequest(), ServiceStats, 5.0
        )
        forged = Heartbeat(
            engine_id="e1", epoch=real.epoch + 5, pid=1, running=0, waiting=0, outstanding_tokens=0
        )
        async with connected(cluster.nats_url, cluster.access("engine-e0")) as (nc, refusals):
            await nc.publish(s.event("heartbeat", "e0"), protocol.encode(forged))
            await nc.flush()
            assert refusals.errors == []  # the bus let it through: its own subject

        async def counted() -> ServiceStats | None:
            stats = await bus.request_struct(
                admin.nc, s.service_stats("router"), StatsRequest(), ServiceStats, 5.0
            )
            bad = stats.errors.get("bad-request", 0) - stats_before.errors.get("bad-request", 0)
            return stats if bad == 1 else None

        await poll(counted, timeout_s=10, every_s=0.05)
        after = next(e for e in (await admin.status()).engines if e.engine_id == "e1")
        assert (after.pid, after.epoch) == (real.pid, real.epoch)


async def test_a_chunk_claiming_another_engine_is_fenced_off(tmp_path: Path) -> None:
    """The forger knows everything about a request on the other engine (id, attempt, epoch,
    position) and publishes on its own stream, which the bus allows. The router reads the sender
    from the subject, so the chunk is dropped and the generation stays token-exact."""
    config = ClusterConfig(
        state_dir=tmp_path / "state", engines=2, shadows=False, sandboxes=False,
        services=UpSettings(heartbeat_timeout_s=60.0),
    )  # fmt: skip
    job = Job("forged-chunk", "whose tokens are these", max_tokens=480, seed=9)
    async with local_cluster(config) as cluster:
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            engines = {e.engine_id: e for e in (await client.wait_for_engines(2, 120)).engines}
            stream = client.generate(job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8)
            first = await anext(stream)
            assert isinstance(first, TokenChunk), "the request must still run when it is held"
            tokens = list(first.tokens)
            for engine in engines.values():  # hold the request where it is while we forge
                os.kill(engine.pid, signal.SIGSTOP)
            try:
                # Chunks published just before the stop may still be on their way: wait until the
                # router's count stands still, so that only the forged chunk could move it.
                held = next(r for r in (await client.status()).requests if r.request_id)
                while True:
                    await asyncio.sleep(0.3)
                    now = next(r for r in (await client.status()).requests if r.request_id == held.request_id)
                    if now.num_tokens == held.num_tokens:
                        break
                    held = now
                victim = engines[held.engine_id]
                forger = "e0" if victim.engine_id == "e1" else "e1"
                chunk = WorkerFrame(
                    epoch=victim.epoch,
                    engine_id=victim.engine_id,
                    seqs=[FrameSeq(held.request_id, held.attempt, held.num_tokens, [7] * 8, [-0.1] * 8)],
                )
                async with connected(cluster.nats_url, cluster.access(f"engine-{forger}")) as (nc, refusals):
                    await nc.publish(cluster.subjects.worker_stream(forger), protocol.encode(chunk))
                    await nc.flush()
                    assert refusals.errors == []  # its own stream: the bus lets it through
                await asyncio.sleep(0.5)
                after = next(r for r in (await client.status()).requests if r.request_id == held.request_id)
                assert after.num_tokens == held.num_tokens, "the forged chunk was taken"
            finally:
                for engine in engines.values():
                    os.kill(engine.pid, signal.SIGCONT)
            async for item in stream:
                if isinstance(item, TokenChunk):
                    tokens += item.tokens
    assert tokens == (await asyncio.to_thread(reference_tokens, [job]))[job.request_id]


async def test_the_router_takes_only_an_inbox_as_a_reply_subject(cluster: Supervisor) -> None:
    """The router may publish into any client's inbox; were it to take any reply_to, a client could
    make it publish onto a worker's dispatch subject. Such a request is refused and nothing is sent."""
    s = cluster.subjects
    async with await Client.connect(cluster.target("admin"), "test-admin") as admin:
        landed: list[bytes] = []

        async def on_dispatch(msg: nats.aio.msg.Msg) -> None:
            landed.append(msg.data)

        await admin.nc.subscribe(s.worker_dispatch("e9"), cb=on_dispatch)
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            for request in (
                protocol.GenerateRequest(
                    request_id="r1", prompt="x", max_tokens=4, reply_to=s.worker_dispatch("e9")
                ),
                protocol.AttachRequest(request_id="r1", from_position=0, reply_to=s.worker_dispatch("e9")),
            ):
                subject = (
                    s.router_generate("cli")
                    if isinstance(request, protocol.GenerateRequest)
                    else s.router_attach("cli")
                )
                with pytest.raises(bus.ServiceError) as refused:
                    await bus.request(client.nc, subject, request, 5.0)
                assert refused.value.code == "bad-request" and "inbox" in refused.value.message
        await admin.nc.flush()
        await asyncio.sleep(0.3)
        assert landed == []


async def test_a_restarted_router_rebuilds_from_the_log_within_its_permissions(cluster: Supervisor) -> None:
    """Normal work draws no violation at all: a generation, a router SIGKILL with the log not empty
    (the new router reads it back), and a generation after."""
    jobs = [
        Job("before-kill", "first", max_tokens=16, seed=1),
        Job("after-kill", "second", max_tokens=16, seed=2),
    ]
    expected = await asyncio.to_thread(reference_tokens, jobs)
    async with await Client.connect(cluster.target("cli"), "test-cli") as client:
        first = await client.generate_all(jobs[0].prompt, max_tokens=16, seed=1, temperature=0.8)
        router = cluster.children["router"]
        old_pid = router.pid
        os.kill(old_pid, signal.SIGKILL)
        await poll(
            lambda: asyncio.sleep(
                0, router.pid if router.pid != old_pid and router.state == "running" else None
            )
        )
        second = await client.generate_all(jobs[1].prompt, max_tokens=16, seed=2, temperature=0.8)
    assert (first.tokens, second.tokens) == (expected["before-kill"], expected["after-kill"])
    server_log = (cluster.config.state_dir / "logs" / "nats-server.log").read_text()
    assert "Violation" not in server_log, [line for line in server_log.splitlines() if "Violation" in line]


async def test_a_service_answers_only_an_inbox(cluster: Supervisor) -> None:
    """The bus lets a service answer on any reply subject a request carries (allow_responses), so
    a requester could name a bucket or another role's subject as its reply and have the service
    write there. The runtime answers inboxes only: here an engine asks the KV server for an arena
    with a prefix pointer as its reply, and nothing lands; the refusal is counted."""
    s = cluster.subjects
    pointer_key = f"$KV.{s.prefix_pointer_bucket}.stolen"
    async with await Client.connect(cluster.target("admin"), "test-admin") as admin:
        landed: list[bytes] = []

        async def on_write(msg: nats.aio.msg.Msg) -> None:
            landed.append(msg.data)

        await admin.nc.subscribe(pointer_key, cb=on_write)
        await admin.nc.subscribe(s.worker_dispatch("e9"), cb=on_write)
        before = await bus.request_struct(
            admin.nc, s.service_stats("router"), StatsRequest(), ServiceStats, 5.0
        )
        async with connected(cluster.nats_url, cluster.access("engine-e0")) as (nc, _):
            await nc.publish(s.kv_arena("e0"), b"{}", reply=pointer_key)
            await nc.flush()
        async with connected(cluster.nats_url, cluster.access("cli")) as (nc, _):
            await nc.publish(s.router_status, protocol.encode(StatusRequest()), reply=s.worker_dispatch("e9"))
            await nc.flush()

        async def counted() -> bool | None:
            stats = await bus.request_struct(
                admin.nc, s.service_stats("router"), StatsRequest(), ServiceStats, 5.0
            )
            return (
                True
                if stats.errors.get("bad-request", 0) == before.errors.get("bad-request", 0) + 1
                else None
            )

        await poll(counted, timeout_s=10, every_s=0.05)
        await asyncio.sleep(0.3)
        assert landed == []


async def test_no_engine_can_roll_up_the_registry(cluster: Supervisor) -> None:
    """An engine may write its own registry key; a rollup header on that write would purge every
    engine's entry. The registry refuses rollups, and every entry stays."""
    s = cluster.subjects
    async with connected(cluster.nats_url, cluster.access("engine-e0")) as (nc, _):
        reply = await nc.request(
            f"$KV.{s.engine_registry_bucket}.e0", b"x", headers={"Nats-Rollup": "all"}, timeout=5
        )
    assert b"rollup not permitted" in reply.data
    async with await Client.connect(cluster.target("admin"), "test-admin") as admin:
        registry = await admin.nc.jetstream().key_value(s.engine_registry_bucket)

        async def keys() -> list[str] | None:
            # nats-py lists keys with an ordered consumer, which a loaded machine (CI's, once) can
            # see end before the first key arrives: NoKeysError. A purge would fail every read.
            try:
                return sorted(await registry.keys())
            except nats.js.errors.NoKeysError:
                return None

        assert await poll(keys, timeout_s=20, every_s=0.5) == ["e0", "e1"]


async def test_the_supervisor_lists_the_registry_with_its_credential(cluster: Supervisor) -> None:
    """Before it quarantines an engine the supervisor asks whether another one serves: it lists
    the registry through an ordered consumer, which its role allows; an engine's does not."""
    async with connected(cluster.nats_url, cluster.access("shadow-supervisor")) as (nc, refusals):
        kv = await nc.jetstream().key_value(cluster.subjects.engine_registry_bucket)
        found, poisoned = await asyncio.wait_for(registry.entries(kv), 10)
    assert sorted(e.engine_id for e in found) == ["e0", "e1"] and poisoned == []
    assert refusals.errors == []
    async with connected(cluster.nats_url, cluster.access("engine-e0")) as (nc, _):
        kv = await nc.jetstream().key_value(cluster.subjects.engine_registry_bucket)
        with pytest.raises(Exception):  # noqa: B017 (a timeout or a permissions error, by version)
            await asyncio.wait_for(registry.entries(kv), 5)


async def test_the_trainer_publishes_weights_over_the_bus_with_its_credential(tmp_path: Path) -> None:
    """Under auth, the trainer's credential puts weights into the bucket and the weight server
    (its own credential) loads them, deletes the object and announces the version; the workers
    then generate on it."""
    config = ClusterConfig(state_dir=tmp_path / "state", engines=1, shadows=True, sandboxes=False)
    params = init_params(PRESETS["tiny"], 9)
    async with local_cluster(config) as supervisor:
        async with await Client.connect(supervisor.target("trainer"), "test-trainer") as trainer:
            await trainer.wait_for_engines(1, 120)
            handles = await WeightClient(trainer.nc, subjects=trainer.subjects).publish_params(params)
            result = await trainer.generate_all(
                "after publish", max_tokens=4, seed=1, weight_version=handles.version
            )
        assert result.weight_version == handles.version and len(result.tokens) == 4
        server_log = (config.state_dir / "logs" / "nats-server.log").read_text()
        assert "Violation" not in server_log


async def test_a_client_follows_and_cancels_only_the_requests_it_started(cluster: Supervisor) -> None:
    """Finding 10 of the trust review: any rollout-side credential could attach to or cancel any
    request, and attach without bound (each attach replays every token). A client's calls now
    carry its name in the subject, which only its credential may publish on; the router keeps the
    name as the request's owner (in the token log, so a successor knows it too). A request streams
    to its newest 8 inboxes."""
    s = cluster.subjects
    async with (
        await Client.connect(cluster.target("cli"), "owner") as owner,
        await Client.connect(cluster.target("trainer"), "other") as other,
    ):
        assert (owner.client, other.client) == ("cli", "trainer")
        stream = owner.generate("mine", max_tokens=300, min_tokens=300, seed=3, temperature=0.8,
                                request_id="owned")  # fmt: skip
        assert isinstance(await anext(stream), TokenChunk)
        attach = protocol.AttachRequest(request_id="owned", from_position=0, reply_to=other.nc.new_inbox())
        for subject, message in (
            (s.router_attach("trainer"), attach),
            (s.router_cancel("trainer"), protocol.CancelRequest(request_id="owned")),
        ):
            with pytest.raises(bus.ServiceError) as refused:
                await bus.request(other.nc, subject, message, 5.0)
            assert refused.value.code == "unknown-request", subject  # not even told it exists
        # Nor can it call in the owner's name: the bus refuses the subject.
        async with connected(cluster.nats_url, cluster.access("trainer")) as (nc, refusals):
            await nc.publish(
                s.router_cancel("cli"), protocol.encode(protocol.CancelRequest(request_id="owned"))
            )
            await nc.flush()
            await refusals.wait_for(s.router_cancel("cli"))

        # The streams of one request are bounded: the newest 8 inboxes that attached hear it.
        heard: dict[str, list[bytes]] = {}

        async def on_message(msg: Msg) -> None:
            heard[msg.subject].append(msg.data)

        inboxes = [owner.nc.new_inbox() for _ in range(10)]
        for inbox in inboxes:
            heard[inbox] = []
            await owner.nc.subscribe(inbox, cb=on_message)
            extra = protocol.AttachRequest(request_id="owned", from_position=0, reply_to=inbox)
            await bus.request(owner.nc, s.router_attach("cli"), extra, 5.0)
        await owner.cancel("owned")  # the owner may
        await owner.nc.flush()
        await asyncio.sleep(0.5)

        def ended(inbox: str) -> bool:
            return any(b'"type":"end"' in data for data in heard[inbox])

        # Mutation check: with no bound, all 10 (and the owner's first stream) would hear the end.
        assert [ended(inbox) for inbox in inboxes] == [False, False] + [True] * 8
        await stream.aclose()


def test_each_named_client_gets_a_credential_of_its_own() -> None:
    """`belayer creds --clients alice`: cli-alice may call the router as cli-alice, and not as cli."""
    from belayer_rl.services import SERVICES
    from belayer_rl.shared.roles import Credentials
    from belayer_rl.shared.subjects import Subjects

    s = Subjects("c")
    creds = Credentials.generate(SERVICES, s, ("e0",), clients=("alice",))
    entries = {user.name: entry for user, entry in zip(creds.users, creds.users_entries(), strict=True)}
    allowed = set(entries["cli-alice"]["permissions"]["publish"]["allow"])  # type: ignore[index]
    assert s.router_generate("cli-alice") in allowed and s.router_cancel("cli-alice") in allowed
    assert s.router_generate("cli") not in allowed and s.router_cancel("cli") not in allowed
    assert s.router_cancel("cli-alice") not in set(entries["cli"]["permissions"]["publish"]["allow"])  # type: ignore[index]
