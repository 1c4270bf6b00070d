"""An action is applied at most once, even when the checkpointer dies while it runs.

The fault campaign found a trail line written twice: the checkpointer was SIGKILLed during an
action, restarted with the sandbox's record still at the step before it, and the caller's retry
(its reply was lost) passed `expect_step` and ran the action again. The record now marks an action
as started before it runs; a restart that finds the mark fails the sandbox as `interrupted`.
Mutation check: with the restart ignoring the mark, the retry is accepted (DID NOT RAISE)."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .conftest import Service

ACTION = "echo {line} >> /tmp/trail; sleep {sleep}; cat /tmp/trail"
KILLED_ACTION_S = 10  # long past the kill, which comes at most 2 s after the line is written
WRITTEN = "until grep -q 2 /tmp/trail 2>/dev/null; do sleep 0.05; done"  # the action's effect is there


async def test_an_action_interrupted_by_a_checkpointer_kill_is_not_given_twice(
    client: SandboxClient, service: Service, image: str, seed: int
) -> None:
    info = await client.create(SandboxSpec(image=image), sandbox="x")
    assert (await client.exec("x", ACTION.format(line=1, sleep=0), expect_step=0)).stdout.split() == ["1"]
    await client.checkpoint("x", "traj-x", k=1)
    slow = ACTION.format(line=2, sleep=KILLED_ACTION_S)
    attempt = asyncio.create_task(client.exec("x", slow, timeout_s=30, expect_step=1))
    # From the host: wait until the action has written its line, then kill at a random point of
    # its remaining sleep, as a crash of the service would.
    docker_exec = await asyncio.create_subprocess_exec(
        "docker", "exec", info.container_id, "sh", "-c", WRITTEN
    )
    await asyncio.wait_for(docker_exec.wait(), 10)
    await asyncio.sleep(random.Random(seed).uniform(0.0, 2.0))
    service.kill()
    attempt.cancel()  # its reply is lost with the service
    with contextlib.suppress(asyncio.CancelledError, ServiceError):
        await attempt
    service.start()
    await service.ready(client)

    with pytest.raises(ServiceError) as refused:  # the caller's retry of the same step
        await client.exec("x", slow, timeout_s=30, expect_step=1)
    assert refused.value.code == "env-failure" and "interrupted" in refused.value.message
    restored = await client.restore("traj-x")
    assert restored.k == 1
    again = await client.exec("x", ACTION.format(line=2, sleep=0), timeout_s=30, expect_step=1)
    assert again.stdout.split() == ["1", "2"]
