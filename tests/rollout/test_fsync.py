"""Acknowledged JetStream writes are on disk before the acknowledgement (trust finding 9).

A power cut cannot be made here, and a SIGKILLed nats-server loses nothing either way (the kernel
keeps its page cache). The closest real thing is to watch the server's system calls: strace
attached to the real nats-server counts fsync/fdatasync while acknowledged publishes go through.
With `sync_interval: always` (what `belayer up` and compose.yaml run) each acknowledged publish is
preceded by one; with nats-server's default (the control) none is made within the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from pathlib import Path

import nats
import pytest
from nats.js.api import StreamConfig

from belayer_rl.shared.processes import free_port, start_nats_server, stop_process

PUBLISHES = 40

# .ci/docker-setup installs strace: under CI its absence fails the test instead.
pytestmark = pytest.mark.skipif(
    shutil.which("strace") is None and os.environ.get("CI") != "true", reason="strace is not installed"
)


async def syncs_during_publishes(folder: Path, sync_always: bool) -> int:
    folder.mkdir(parents=True)
    port = free_port()
    server = await start_nats_server(folder / "jetstream", port, folder / "nats.log", sync_always=sync_always)
    try:
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name="S", subjects=["s.>"]))
            trace = folder / "strace.txt"
            tracer = await asyncio.create_subprocess_exec(
                "strace", "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", str(trace), "-p", str(server.pid),
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            await asyncio.sleep(1.0)  # strace attaches to every thread
            for i in range(PUBLISHES):
                await js.publish(f"s.{i}", b"acknowledged")
            await asyncio.sleep(0.2)
            tracer.terminate()
            await tracer.wait()
            return sum(1 for line in trace.read_text().splitlines() if "sync(" in line)
        finally:
            await nc.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            await stop_process(server)


async def test_each_acknowledged_publish_is_synced_to_disk(tmp_path: Path) -> None:
    synced = await syncs_during_publishes(tmp_path / "always", sync_always=True)
    default = await syncs_during_publishes(tmp_path / "default", sync_always=False)
    assert synced >= PUBLISHES, f"{synced} syncs for {PUBLISHES} acknowledged publishes"
    assert default < PUBLISHES // 4, f"the control synced {default} times: the count tells nothing"
