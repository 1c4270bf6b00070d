"""Prefix pointers that go missing or race: a pointer lost by the broker (a purge, a fresh server)
is rebuilt from the checkpoints' authenticated manifests instead of those checkpoints being
deleted; two checkpoints of one (incarnation, k) from two hosts are a conflict, never an overwrite;
a folder signed with another key is never restored."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from belayer_rl.services.checkpointer import pointer
from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.store import MANIFEST, Manifest
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import CheckpointResult, SandboxSpec

from .conftest import ROOT, Service, remove_host_containers
from .helpers import NAMES, checkpoint_dir, kill_container


async def read_pointer(nats_url: str, trajectory: str) -> pointer.PrefixPointer | None:
    nc = await bus.connect(nats_url, "test-pointer")
    try:
        kv = await nc.jetstream().key_value(NAMES.prefix_pointer_bucket)
        current, _ = await pointer.read(kv, trajectory)
        return current
    finally:
        await nc.close()


async def purge_pointer(nats_url: str, trajectory: str) -> None:
    nc = await bus.connect(nats_url, "test-pointer")
    try:
        kv = await nc.jetstream().key_value(NAMES.prefix_pointer_bucket)
        await kv.purge(trajectory)
    finally:
        await nc.close()


async def two_checkpoints(client: SandboxClient, image: str) -> tuple[CheckpointResult, CheckpointResult]:
    await client.create(SandboxSpec(image=image), sandbox="lp")
    await client.exec("lp", "echo one > /tmp/one")
    first = await client.checkpoint("lp", "traj-lp", k=1, context_tokens=[1])
    await client.exec("lp", "echo two > /tmp/two")
    second = await client.checkpoint("lp", "traj-lp", k=2, context_tokens=[1, 2])
    return first, second


def forge_newer(state_dir: Path, source_id: str) -> str:
    """Copy a checkpoint under a name that claims k=9 and edit its manifest to match, unsigned."""
    source = checkpoint_dir(state_dir, "traj-lp", source_id)
    forged_id = "i0-k9-0badf00d"
    forged = source.parent / forged_id
    shutil.copytree(source, forged)
    manifest = msgspec.json.decode((forged / MANIFEST).read_bytes(), type=Manifest)
    edited = msgspec.structs.replace(manifest, checkpoint_id=forged_id, k=9)
    (forged / MANIFEST).write_bytes(msgspec.json.encode(edited))
    return forged_id


async def test_a_purged_pointer_is_rebuilt_at_start_and_nothing_is_deleted(
    client: SandboxClient, service: Service, image: str
) -> None:
    """Mutation check: the code before this change deleted every checkpoint of a trajectory whose
    pointer was missing at start, and this test then finds no folder and no pointer."""
    first, second = await two_checkpoints(client, image)
    forged_id = forge_newer(service.state_dir, second.checkpoint_id)
    service.stop()
    await purge_pointer(service.nats_url, "traj-lp")
    assert await read_pointer(service.nats_url, "traj-lp") is None
    service.start()
    await service.ready(client)

    rebuilt = await read_pointer(service.nats_url, "traj-lp")
    assert rebuilt is not None
    assert (rebuilt.checkpoint_id, rebuilt.incarnation, rebuilt.k) == (second.checkpoint_id, 0, 2)
    assert rebuilt.context_digest == second.context_digest and rebuilt.host_id == service.host_id
    kept = {p.name for p in (service.state_dir / "checkpoints" / "traj-lp").iterdir()}
    assert {first.checkpoint_id, second.checkpoint_id, forged_id} <= kept  # the forgery is only ignored

    listing = await client.list()
    await kill_container(listing.sandboxes[0].container_id)
    restored = await client.restore("traj-lp")
    assert (restored.source, restored.checkpoint_id, restored.k) == ("latest", second.checkpoint_id, 2)
    assert restored.context_tokens == [1, 2]
    assert (await client.exec("lp", "cat /tmp/one /tmp/two", expect_step=2)).stdout == "one\ntwo\n"


async def test_a_pointer_lost_while_running_is_rebuilt_by_the_restore(
    client: SandboxClient, service: Service, image: str
) -> None:
    _, second = await two_checkpoints(client, image)
    await purge_pointer(service.nats_url, "traj-lp")
    listing = await client.list()
    await kill_container(listing.sandboxes[0].container_id)
    restored = await client.restore("traj-lp")
    assert (restored.source, restored.checkpoint_id, restored.k) == ("latest", second.checkpoint_id, 2)
    assert restored.context_tokens == [1, 2]


@pytest.fixture
async def second_host(service: Service, tmp_path: Path) -> AsyncIterator[tuple[Service, SandboxClient]]:
    """Another checkpointer on the same Docker engine and bus, holding the same checkpoint key."""
    key = service.state_dir / "checkpoint.key"
    other = Service(
        service.nats_url, f"{service.host_id}b", tmp_path / "b-state", tmp_path / "b.log",
        extra=["--checkpoint-key", str(key)],
    )  # fmt: skip
    other.start()
    nc = await bus.connect(service.nats_url, "test-second-host")
    client = SandboxClient(nc, other.host_id)
    try:
        await other.ready(client)
        yield other, client
    finally:
        await nc.close()
        other.stop()
        await remove_host_containers(other.host_id)


async def test_two_checkpointers_race_one_checkpoint_and_exactly_one_wins(
    client: SandboxClient, service: Service, image: str, second_host: tuple[Service, SandboxClient]
) -> None:
    """Both hosts read the pointer (none yet) before either advances it: each dump holds 200 MiB,
    which takes CRIU far longer than the read. Mutation check: with the earlier rule, where an
    equal (incarnation, k) from another host replaced the pointer, both checkpoints succeed."""
    other, there = second_host
    for sandboxes in ((client, "ra"), (there, "rb")):
        c, name = sandboxes
        await c.create(SandboxSpec(image=image, user=ROOT, memory_mb=512), sandbox=name)
        await c.exec(name, f"echo {name} > /tmp/who")
        await c.exec(name, "(exec memhold 200) >/dev/null 2>&1 </dev/null & sleep 2")
    results = await asyncio.gather(
        client.checkpoint("ra", "traj-race", k=2), there.checkpoint("rb", "traj-race", k=2),
        return_exceptions=True,
    )  # fmt: skip
    won = [r for r in results if isinstance(r, CheckpointResult)]
    lost = [r for r in results if isinstance(r, ServiceError)]
    assert len(won) == 1 and len(lost) == 1, results
    assert lost[0].code == "conflict" and won[0].checkpoint_id in str(lost[0])
    current = await read_pointer(service.nats_url, "traj-race")
    assert current is not None and current.checkpoint_id == won[0].checkpoint_id
    loser = other if won[0].sandbox == "ra" else service
    left = loser.state_dir / "checkpoints" / "traj-race"
    assert sorted(p.name for p in left.iterdir()) == ["trajectory.json", "trajectory.mac"]  # discarded


async def test_a_folder_signed_with_another_key_is_not_restored(
    client: SandboxClient, service: Service, image: str, tmp_path: Path
) -> None:
    """Neither the checkpoint nor the trajectory's base settings authenticate on a host with another
    key: the restore is refused whole, nothing is created, and nothing is deleted."""
    info = await client.create(SandboxSpec(image=image), sandbox="fk")
    await client.exec("fk", "echo one > /tmp/one")
    first = await client.checkpoint("fk", "traj-fk", k=1, context_tokens=[3])
    await kill_container(info.container_id)
    stranger = Service(service.nats_url, f"{service.host_id}x", tmp_path / "x-state", tmp_path / "x.log")
    stranger.start()  # its own key, made at its first start
    nc = await bus.connect(service.nats_url, "test-stranger")
    there = SandboxClient(nc, stranger.host_id)
    try:
        await stranger.ready(there)
        shutil.copytree(
            service.state_dir / "checkpoints" / "traj-fk", stranger.state_dir / "checkpoints" / "traj-fk"
        )
        with pytest.raises(ServiceError) as refused:
            await there.restore("traj-fk")
        assert refused.value.code == "no-checkpoint" and "not authenticated" in refused.value.message
        assert (await there.list()).sandboxes == []
        kept = stranger.state_dir / "checkpoints" / "traj-fk" / first.checkpoint_id
        assert kept.is_dir()  # refused, not deleted: the key may be what is wrong
    finally:
        await nc.close()
        stranger.stop()
        await remove_host_containers(stranger.host_id)
