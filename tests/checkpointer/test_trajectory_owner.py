"""Only the sandbox that owns a trajectory checkpoints it or is replaced by its restore (finding 8).

A real checkpointer and dockerd, driven as a rollout-side caller would. On the old checkpointer a
fresh sandbox that checkpointed an existing trajectory took it over under a new incarnation (the
trajectory's next restore brought back the intruder's files), and a restore replaced whatever live
sandbox had the pointer's name, though it ran another trajectory.
"""

from __future__ import annotations

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .conftest import Service


async def test_another_sandbox_cannot_checkpoint_a_trajectory(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="owner")
    await client.exec("owner", "echo owner > /tmp/f")
    await client.checkpoint("owner", "t", 1, context_tokens=[1, 2, 3])

    await client.create(SandboxSpec(image=image), sandbox="intruder")
    await client.exec("intruder", "echo intruder > /tmp/f")
    with pytest.raises(ServiceError) as refused:
        await client.checkpoint("intruder", "t", 1, context_tokens=[9, 9, 9])
    assert refused.value.code == "wrong-trajectory" and "owner" in refused.value.message

    # The owner's own sandbox, made again under its name (a restart from the base image), may.
    await client.destroy("owner")
    restored = await client.restore("t", timeout_s=60)
    assert (restored.sandbox, restored.context_tokens) == ("owner", [1, 2, 3])
    assert (await client.exec("owner", "cat /tmp/f")).stdout == "owner\n"
    await client.destroy("owner")
    await client.create(SandboxSpec(image=image), sandbox="owner")
    await client.exec("owner", "echo again > /tmp/f")
    again = await client.checkpoint("owner", "t", 1, context_tokens=[4, 5])
    assert again.incarnation > 0


async def test_a_restore_does_not_replace_another_trajectorys_sandbox(
    client: SandboxClient, image: str
) -> None:
    await client.create(SandboxSpec(image=image), sandbox="x")
    await client.exec("x", "echo t > /tmp/f")
    await client.checkpoint("x", "t", 1, context_tokens=[1])
    await client.destroy("x")
    await client.create(SandboxSpec(image=image), sandbox="x")  # the name, now for trajectory u
    await client.exec("x", "echo u > /tmp/f")
    await client.checkpoint("x", "u", 1, context_tokens=[2])
    with pytest.raises(ServiceError) as refused:
        await client.restore("t", timeout_s=60)
    assert refused.value.code == "wrong-trajectory" and "trajectory u" in refused.value.message
    assert (await client.exec("x", "cat /tmp/f")).stdout == "u\n"  # still u's, and still running


async def test_another_client_cannot_touch_a_clients_sandbox_or_end_its_trajectory(
    client: SandboxClient, image: str, service: Service
) -> None:
    """Finding 10 of the trust review: any rollout-side credential could end any trajectory,
    deleting its checkpoints. The client's name is the last token of each call's subject (only its
    credential may publish there), and the sandbox, its trajectory's signed record included, keep
    it. To another client the sandbox does not exist and the trajectory is not its to restore or end."""
    other = SandboxClient(client.nc, client.host_id, subjects=client.subjects, client="cli-other")
    await client.create(SandboxSpec(image=image), sandbox="mine")
    await client.exec("mine", "echo mine > /tmp/f")
    await client.checkpoint("mine", "t-owned", 1, context_tokens=[1, 2])
    calls = {
        "exec": other.exec("mine", "cat /tmp/f"),
        "checkpoint": other.checkpoint("mine", "t-owned", 2, context_tokens=[1, 2, 3]),
        "destroy": other.destroy("mine"),
        "restore": other.restore("t-owned", timeout_s=60),
        "end": other.end("t-owned"),
    }
    codes = {}
    for name, call in calls.items():
        with pytest.raises(ServiceError) as refused:
            await call
        codes[name] = refused.value.code
    assert codes == {
        "exec": "no-sandbox", "checkpoint": "no-sandbox", "destroy": "no-sandbox",
        "restore": "not-allowed", "end": "not-allowed",
    }  # fmt: skip
    assert (await client.exec("mine", "cat /tmp/f")).stdout == "mine\n"  # untouched, still step 2
    # Nor may its own sandbox checkpoint under the trajectory's id.
    await other.create(SandboxSpec(image=image), sandbox="theirs")
    await other.exec("theirs", "true")
    with pytest.raises(ServiceError) as refused:
        await other.checkpoint("theirs", "t-owned", 1, context_tokens=[6])
    assert refused.value.code == "not-allowed"

    # With no live sandbox and no signed record here (a host the trajectory never ran on), the
    # pointer, which every host reads and only checkpointers write, still names the owner.
    await client.destroy("mine")
    record = service.state_dir / "checkpoints" / "t-owned" / "trajectory.json"
    record.unlink()
    with pytest.raises(ServiceError) as refused:
        await other.end("t-owned")
    assert refused.value.code == "not-allowed"
    # A sandbox of the other client under the pointer's name is not replaced by the owner's restore.
    await other.create(SandboxSpec(image=image), sandbox="mine")
    with pytest.raises(ServiceError) as refused:
        await client.restore("t-owned", timeout_s=60)
    assert refused.value.code == "not-allowed" and "another client's" in refused.value.message
    await other.destroy("mine")
    restored = await client.restore("t-owned", timeout_s=60)
    assert restored.context_tokens == [1, 2]
    assert (await client.exec("mine", "cat /tmp/f")).stdout == "mine\n"  # the owner's again
    await client.end("t-owned")  # the owner may
