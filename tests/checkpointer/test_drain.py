"""The runtime's two signals, on the checkpointer: the first drains (a running action is let
finish, so the process stays), the second ends the process at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec


async def test_first_sigterm_drains_a_running_action_second_exits_at_once(
    service, client: SandboxClient, image
):
    info = await client.create(SandboxSpec(image=image))
    action = asyncio.create_task(client.exec(info.sandbox, "sleep 60", timeout_s=120))
    await asyncio.sleep(1.0)  # the action is running in the container
    assert service.process is not None
    service.process.send_signal(signal.SIGTERM)
    await asyncio.sleep(2.0)
    draining = service.process.poll() is None  # still waiting for the action
    service.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        code = await asyncio.to_thread(service.process.wait, 10)
    except subprocess.TimeoutExpired:
        code = None
    waited = time.monotonic() - started
    action.cancel()
    with contextlib.suppress(asyncio.CancelledError, ServiceError):
        await action

    assert draining, "the first SIGTERM did not wait for the running action"
    assert code == 1, f"exit status {code} after the second SIGTERM ({waited:.1f}s)\n{service.log()}"
    assert "second SIGTERM, exiting now" in service.log()
