"""Fixtures for checkpointer tests: a real dockerd with CRIU, a real nats-server, the checkpointer
as a real subprocess.

Tests that need Docker or CRIU use the `docker_env` fixture (directly or through another). When
either is missing they are skipped, except under CI=true, where they fail: CI must never go green
by skipping the sandbox tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker
import msgspec
import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.services.checkpointer.sandbox import LABEL_HOST, EngineInfo
from belayer_rl.shared import bus
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process

IN_CI = os.environ.get("CI", "").lower() == "true"


def _missing() -> str | None:
    """Why Docker + CRIU checkpoints cannot run here, or None."""
    if shutil.which("criu") is None:
        return "criu is not installed (run .ci/docker-setup)"
    check = subprocess.run(["criu", "check"], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        return f"`criu check` fails: {(check.stdout + check.stderr).strip()[-300:]}"

    async def info() -> EngineInfo:
        docker = aiodocker.Docker()
        try:
            return msgspec.convert(await docker.system.info(), type=EngineInfo)
        finally:
            await docker.close()

    try:
        found = asyncio.run(info())
    except Exception as exc:
        return f"no Docker engine reachable: {exc}"
    if not found.experimental_build:
        return "dockerd runs without experimental features (checkpoints need them)"
    return None


@pytest.fixture(scope="session")
def docker_env() -> str:
    """The test image's name, once Docker with experimental checkpoints and CRIU are known to work."""
    reason = _missing()
    if reason is not None:
        if IN_CI:
            pytest.fail(f"CI=true and Docker/CRIU are missing: {reason}")
        pytest.skip(reason)

    async def build() -> str:
        docker = aiodocker.Docker()
        try:
            await ensure_image(docker, DEFAULT_IMAGE)
        finally:
            await docker.close()
        return DEFAULT_IMAGE

    return asyncio.run(build())


@pytest.fixture
async def nats_url(tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    process = await start_nats_server(tmp_path / "jetstream", port, tmp_path / "nats-server.log")
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        await stop_process(process)


ROOT = "0"  # the user of a spec whose actions leave a process running across a checkpoint


@dataclass
class Service:
    """The checkpointer as a subprocess; kill() and start() again at will."""

    nats_url: str
    host_id: str
    state_dir: Path
    log_path: Path
    docker_url: str | None = None
    process: subprocess.Popen | None = None
    extra: list[str] = field(default_factory=list)
    # The test image runs actions as nobody. A test whose actions leave a process running across a
    # checkpoint asks for root (ROOT): CRIU cannot dump another user's process on a host whose root
    # lacks CAP_SYS_RESOURCE (the checkpointer's README).
    allow_root_user: bool = True

    def start(self, *extra: str) -> None:
        argv = [
            sys.executable, "-m", "belayer_rl.services.checkpointer",
            "--nats", self.nats_url, "--host-id", self.host_id, "--state-dir", str(self.state_dir),
            *self.extra, *(["--allow-root-user"] if self.allow_root_user else []), *extra,
        ]  # fmt: skip
        if self.docker_url:
            argv += ["--docker", self.docker_url]
        # Only `allow_root_user` decides, whatever the variable says where the tests run.
        env = {k: v for k, v in os.environ.items() if k != "BELAYER_ALLOW_ROOT_USER"}
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    async def ready(self, client: SandboxClient, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"checkpointer exited with {self.process.returncode}:\n{self.log()}")
            try:
                await client.list(timeout_s=1.0)
                return
            except bus.ServiceError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"checkpointer not ready in {timeout_s}s:\n{self.log()}") from None
                await asyncio.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


async def remove_host_containers(host_id: str, docker_url: str | None = None) -> None:
    docker = aiodocker.Docker(url=docker_url)
    try:
        for c in await docker.containers.list(all=True, filters={"label": [f"{LABEL_HOST}={host_id}"]}):
            with contextlib.suppress(aiodocker.DockerError):
                await c.delete(force=True)
    finally:
        await docker.close()


@pytest.fixture
async def service(docker_env: str, nats_url: str, tmp_path: Path) -> AsyncIterator[Service]:
    host_id = f"t{secrets.token_hex(4)}"
    svc = Service(nats_url, host_id, tmp_path / "state", tmp_path / "checkpointer.log")
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()
        await remove_host_containers(host_id)


@pytest.fixture
async def client(service: Service) -> AsyncIterator[SandboxClient]:
    nc = await bus.connect(service.nats_url, "test-client")
    sandbox_client = SandboxClient(nc, service.host_id)
    try:
        await service.ready(sandbox_client)
        yield sandbox_client
    finally:
        await nc.close()


@pytest.fixture
def image(docker_env: str) -> str:
    return docker_env


@pytest.fixture
def canary_dir(tmp_path: Path) -> Iterator[Path]:
    """Host files a hostile layer must not touch."""
    folder = tmp_path / "host-canary"
    folder.mkdir()
    (folder / "canary").write_text("untouched\n")
    yield folder
