"""A checkpoint taken of a restored sandbox restores too.

A restore puts the sandbox's processes in a new time namespace, and a process an action starts
afterwards stays outside it (runc does not enter time namespaces). A dump that holds such a
process is one CRIU will not restore: the fault campaign found acknowledged checkpoints of this
kind, taken while the last action's timeout watcher was still dying. The checkpointer now waits for
those, and refuses a checkpoint that would hold a live one, naming it."""

from __future__ import annotations

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .helpers import kill_container

ROUNDS = 4  # restore, act, checkpoint at once: each round is a chance for the watcher's race
QUICK_ACTIONS = 20  # the watcher race lost at least once in 20 on an idle machine, before the fix


async def crash_and_restore(client: SandboxClient, trajectory: str) -> int:
    await kill_container((await client.list()).sandboxes[0].container_id)
    restored = await client.restore(trajectory)
    assert restored.rejected == []
    return restored.k


async def test_each_checkpoint_of_a_restored_sandbox_restores(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="r")
    for k in range(1, ROUNDS + 1):
        out = await client.exec("r", f"echo {k} >> /tmp/trail && cat /tmp/trail", expect_step=k - 1)
        assert out.stdout.split() == [str(i) for i in range(1, k + 1)]
        await client.checkpoint("r", "traj-r", k=k, context_tokens=list(range(k)))
        assert await crash_and_restore(client, "traj-r") == k


async def test_a_process_started_after_a_restore_is_named_not_checkpointed(
    client: SandboxClient, image: str
) -> None:
    await client.create(SandboxSpec(image=image), sandbox="r")
    await client.exec("r", "echo one >> /tmp/trail")
    await client.checkpoint("r", "traj-r", k=1, context_tokens=[1])
    assert await crash_and_restore(client, "traj-r") == 1
    await client.exec(
        "r",
        "echo two >> /tmp/trail; setsid sleep 100 </dev/null >/dev/null 2>&1 & echo $! > /tmp/stray",
        expect_step=1,
    )
    with pytest.raises(ServiceError) as refused:
        await client.checkpoint("r", "traj-r", k=2, context_tokens=[1, 2])
    assert refused.value.code == "checkpoint-failed" and "(sleep)" in refused.value.message
    # Once an action has ended the process, the next step checkpoints and restores.
    await client.exec("r", "kill -KILL $(cat /tmp/stray)", expect_step=2)
    await client.checkpoint("r", "traj-r", k=3, context_tokens=[1, 2, 3])
    assert await crash_and_restore(client, "traj-r") == 3
    out = await client.exec("r", "cat /tmp/trail", expect_step=3)
    assert out.stdout.split() == ["one", "two"]


async def test_no_timeout_watcher_outlives_a_quick_action(client: SandboxClient, image: str) -> None:
    """A quick action used to end before its watcher had made itself a process group, so the
    wrapper's kill of that group missed, and the watcher slept out the whole timeout. Besides
    holding up checkpoints of a restored sandbox, it would then have killed whatever process group
    had by then been given the action's old pid."""
    await client.create(SandboxSpec(image=image), sandbox="w")
    for step in range(QUICK_ACTIONS):
        await client.exec("w", "true", timeout_s=60.0, expect_step=step)
    # (this action's own watcher waits 61 s: only the quick actions' ones show "watcher 60.000")
    listing = await client.exec("w", "ps -o pid,args", timeout_s=61.0, expect_step=QUICK_ACTIONS)
    watchers = [line for line in listing.stdout.splitlines() if " watcher 60.000 " in line]
    assert watchers == []
