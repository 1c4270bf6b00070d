"""dockerd restarted between a checkpoint and its restore. Uses a dockerd of its own (own data
root, exec root, socket and containerd namespace), never the user's."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiodocker
import pytest

from belayer_rl.cli.chaos.lab import OwnDockerd
from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.shared import bus
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .conftest import ROOT, Service, remove_host_containers
from .test_recovery import SEEN


@pytest.fixture
async def own_dockerd(docker_env: str, tmp_path: Path) -> AsyncIterator[OwnDockerd]:
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
        daemon.remove(keep_log=tmp_path / "dockerd.log")


@contextlib.asynccontextmanager
async def checkpointer_on(
    own_dockerd: OwnDockerd, nats_url: str, tmp_path: Path, host_id: str, *flags: str
) -> AsyncIterator[SandboxClient]:
    """A checkpointer on the test's own dockerd, ready, and a client of it; all gone after."""
    svc = Service(
        nats_url, host_id, tmp_path / "state", tmp_path / "checkpointer.log", docker_url=own_dockerd.url
    )
    svc.start(*flags)
    try:
        nc = await bus.connect(nats_url, "test-client")
        try:
            client = SandboxClient(nc, svc.host_id)
            await svc.ready(client)
            yield client
        finally:
            await nc.close()
    finally:
        svc.stop()
        with contextlib.suppress(Exception):
            await remove_host_containers(svc.host_id, own_dockerd.url)


async def test_dockerd_restart_between_checkpoint_and_restore(
    own_dockerd: OwnDockerd, nats_url: str, tmp_path: Path
) -> None:
    async with checkpointer_on(own_dockerd, nats_url, tmp_path, "tdockerd") as client:
        await client.create(SandboxSpec(image=DEFAULT_IMAGE, user=ROOT), sandbox="r")
        counter = (
            "(i=0; while :; do i=$((i+1)); echo $i > /tmp/seen; sleep 0.1; done) >/dev/null 2>&1 </dev/null &"
        )
        await client.exec("r", f"echo one > /tmp/one; {counter}")
        first = await client.checkpoint("r", "traj-r", k=1, context_tokens=[3, 1, 4])
        await client.exec("r", "echo two > /tmp/two")

        await own_dockerd.restart()

        with pytest.raises(ServiceError) as failed:
            await client.exec("r", "echo hi")
        assert failed.value.code == "env-failure"
        restored = await client.restore("traj-r")
        assert (restored.source, restored.checkpoint_id, restored.context_tokens) == (
            "latest",
            first.checkpoint_id,
            [3, 1, 4],
        )
        state = await client.exec(
            "r", f"cat /tmp/one; ls /tmp/two 2>&1; a=$({SEEN}); sleep 0.5; echo $a $({SEEN})"
        )
        lines = state.stdout.splitlines()
        assert lines[0] == "one" and "No such file" in lines[1]
        before, after = map(int, lines[2].split())
        assert after > before > 0


async def test_a_restore_while_dockerd_is_down_keeps_the_checkpoint(
    own_dockerd: OwnDockerd, nats_url: str, tmp_path: Path
) -> None:
    """A restore that cannot reach Docker says so (daemon-unavailable) and deletes nothing; once
    Docker is back, the same checkpoint restores. Mutation check, run by hand: treating the
    daemon's error as the checkpoint's fault (the earlier code) deletes it, and the second restore
    starts from the base image."""
    async with checkpointer_on(own_dockerd, nats_url, tmp_path, "tdockerdown") as client:
        await client.create(SandboxSpec(image=DEFAULT_IMAGE), sandbox="d")
        await client.exec("d", "echo kept > /tmp/mark")
        first = await client.checkpoint("d", "traj-d", k=1, context_tokens=[2, 7])
        await asyncio.to_thread(own_dockerd.stop)
        with pytest.raises(ServiceError) as refused:
            await client.restore("traj-d")
        assert refused.value.code == "daemon-unavailable", refused.value
        own_dockerd.start()
        await own_dockerd.ready()
        restored = await client.restore("traj-d")
        assert (restored.source, restored.checkpoint_id, restored.k, restored.context_tokens) == (
            "latest", first.checkpoint_id, 1, [2, 7],
        )  # fmt: skip
        assert (await client.exec("d", "cat /tmp/mark")).stdout.strip() == "kept"


async def test_a_silent_dockerd_fails_each_call_and_not_the_service(
    own_dockerd: OwnDockerd, nats_url: str, tmp_path: Path
) -> None:
    """dockerd SIGSTOPped (a daemon that holds a frozen container's lock is as silent): each call
    fails after --docker-timeout, the service keeps answering, and nothing acknowledged is lost.
    Mutation check, run by hand: without the bound, the exec waits until the client gives up
    ("timeout"), and the restore behind it with it."""
    assert own_dockerd.process is not None
    async with checkpointer_on(own_dockerd, nats_url, tmp_path, "tsilent", "--docker-timeout", "2") as client:
        await client.create(SandboxSpec(image=DEFAULT_IMAGE), sandbox="s")
        await client.exec("s", "echo kept > /tmp/mark")
        first = await client.checkpoint("s", "traj-s", k=1, context_tokens=[5, 8])
        own_dockerd.process.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(ServiceError) as failed:
                await client.exec("s", "echo lost > /tmp/mark", timeout_s=5)
            assert failed.value.code == "env-failure" and "did not answer" in failed.value.message, (
                failed.value
            )
            with pytest.raises(ServiceError) as refused:
                await client.restore("traj-s", timeout_s=10)
            assert refused.value.code == "daemon-unavailable", refused.value
            listing = await client.list()
            assert [s.sandbox for s in listing.sandboxes] == ["s"]
        finally:
            own_dockerd.process.send_signal(signal.SIGCONT)
        restored = await client.restore("traj-s")
        assert (restored.checkpoint_id, restored.k, restored.context_tokens) == (
            first.checkpoint_id,
            1,
            [5, 8],
        )
        assert (await client.exec("s", "cat /tmp/mark")).stdout.strip() == "kept"
