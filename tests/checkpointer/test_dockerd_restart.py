"""dockerd restarted between a checkpoint and its restore. Uses a dockerd of its own (own data
root, exec root, socket and containerd namespace), never the user's."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiodocker
import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .conftest import Service, remove_host_containers
from .test_recovery import SEEN


class OwnDockerd:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"unix://{root}/docker.sock"
        self.process: subprocess.Popen | None = None
        (root / "daemon.json").write_text("{}\n")

    def start(self) -> None:
        argv = [
            "dockerd", "--experimental", "--config-file", str(self.root / "daemon.json"),
            "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "x"),
            "--pidfile", str(self.root / "dockerd.pid"), "--host", self.url,
            "--bridge", "none", "--iptables=false", "--ip-masq=false",
            "--containerd-namespace", "belayer-test", "--containerd-plugins-namespace", "belayer-test-plugins",
        ]  # fmt: skip
        with (self.root / "dockerd.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    async def ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            docker = aiodocker.Docker(url=self.url)
            try:
                await docker.system.info()
                return
            except Exception:
                if time.monotonic() > deadline or (self.process and self.process.poll() is not None):
                    log = (self.root / "dockerd.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"own dockerd did not come up:\n{log}") from None
                await asyncio.sleep(0.2)
            finally:
                await docker.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
async def own_dockerd(docker_env: str) -> AsyncIterator[OwnDockerd]:
    root = Path(tempfile.mkdtemp(prefix="bd-", dir="/tmp"))  # short: socket paths are limited
    daemon = OwnDockerd(root)
    daemon.start()
    try:
        await daemon.ready()
        docker = aiodocker.Docker(url=daemon.url)
        try:
            await ensure_image(docker, DEFAULT_IMAGE)
        finally:
            await docker.close()
        yield daemon
    finally:
        daemon.stop()
        await asyncio.to_thread(
            subprocess.run, ["umount", "-R", "-l", str(root / "data")], capture_output=True, check=False
        )
        shutil.rmtree(root, ignore_errors=True)


async def test_dockerd_restart_between_checkpoint_and_restore(
    own_dockerd: OwnDockerd, nats_url: str, tmp_path: Path
) -> None:
    svc = Service(
        nats_url, "tdockerd", tmp_path / "state", tmp_path / "checkpointer.log", docker_url=own_dockerd.url
    )
    svc.start()
    nc = await bus.connect(nats_url, "test-client")
    client = SandboxClient(nc, svc.host_id)
    try:
        await svc.ready(client)
        await client.create(SandboxSpec(image=DEFAULT_IMAGE), sandbox="r")
        counter = (
            "(i=0; while :; do i=$((i+1)); echo $i > /tmp/seen; sleep 0.1; done) >/dev/null 2>&1 </dev/null &"
        )
        await client.exec("r", f"echo one > /one; {counter}")
        first = await client.checkpoint("r", "traj-r", k=1, context_tokens=[3, 1, 4])
        await client.exec("r", "echo two > /two")

        own_dockerd.stop()
        own_dockerd.start()
        await own_dockerd.ready()

        with pytest.raises(ServiceError) as failed:
            await client.exec("r", "echo hi")
        assert failed.value.code == "env-failure"
        restored = await client.restore("traj-r")
        assert (restored.source, restored.checkpoint_id, restored.context_tokens) == (
            "latest",
            first.checkpoint_id,
            [3, 1, 4],
        )
        state = await client.exec("r", f"cat /one; ls /two 2>&1; a=$({SEEN}); sleep 0.5; echo $a $({SEEN})")
        lines = state.stdout.splitlines()
        assert lines[0] == "one" and "No such file" in lines[1]
        before, after = map(int, lines[2].split())
        assert after > before > 0
    finally:
        await nc.close()
        svc.stop()
        with contextlib.suppress(Exception):
            await remove_host_containers(svc.host_id, own_dockerd.url)
