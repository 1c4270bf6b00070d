"""What a chaos campaign runs of its own, so that restarting or filling it touches nothing else:
its nats-server, its dockerd (with runc wrapped so a restore can be slowed) and its size-capped
checkpoint store (a tmpfs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiodocker

from belayer_rl.services.checkpointer.probe import docker_unreachable
from belayer_rl.shared.processes import start_nats_server

STORE_MB = 256  # the checkpoint store's tmpfs: far more than the campaign's checkpoints need


@dataclass
class Nats:
    """The campaign's own nats-server, so that it can kill and restart it."""

    port: int
    store: Path
    log: Path
    config: Path | None
    process: asyncio.subprocess.Process

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def restart(self, down_s: float) -> None:
        await self.stop()
        await asyncio.sleep(down_s)
        self.process = await start_nats_server(self.store, self.port, self.log, self.config)

    async def stop(self) -> None:
        self.process.kill()
        await self.process.wait()


# runc as the campaign's dockerd calls it: a restore or checkpoint that fails leaves CRIU's log
# (restore.log or dump.log in its --work-path) in the campaign's logs/criu.
RUNC_WRAPPER = """#!/bin/sh
work= previous=
for arg; do [ "$previous" = --work-path ] && work=$arg; previous=$arg; done
{runc} "$@"
status=$?
if [ $status -ne 0 ] && [ -n "$work" ]; then
    for log in "$work"/*.log; do
        [ -f "$log" ] && cp "$log" {logs}/"$(date +%s.%N)-$(basename "$log")"
    done
fi
exit $status
"""


class OwnDockerd:
    """A dockerd of the campaign's own (its own data root, exec root, socket and containerd
    namespace), so that restarting it touches no one else's containers. Needs root."""

    def __init__(self, root: Path, criu_logs: Path | None = None) -> None:
        self.root = root
        self.url = f"unix://{root}/docker.sock"
        self.process: subprocess.Popen[bytes] | None = None
        config: dict[str, object] = {}
        if criu_logs is not None:
            # containerd deletes a failed restore's bundle, CRIU's log with it: runc goes through
            # a wrapper that copies the log out first.
            criu_logs.mkdir(parents=True, exist_ok=True)
            wrapper = root / "runc-keeping-logs"
            runc = shlex.quote(shutil.which("runc") or "runc")
            wrapper.write_text(RUNC_WRAPPER.format(runc=runc, logs=shlex.quote(str(criu_logs))))
            wrapper.chmod(0o755)
            config = {
                "runtimes": {"runc-keeping-logs": {"path": str(wrapper)}},
                "default-runtime": "runc-keeping-logs",
            }
        (root / "daemon.json").write_text(json.dumps(config) + "\n")

    def start(self) -> None:
        argv = [
            "dockerd", "--experimental", "--config-file", str(self.root / "daemon.json"),
            "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "x"),
            "--pidfile", str(self.root / "dockerd.pid"), "--host", self.url,
            "--bridge", "none", "--iptables=false", "--ip-masq=false",
            "--containerd-namespace", "belayer-chaos", "--containerd-plugins-namespace", "belayer-chaos-plugins",
        ]  # fmt: skip
        with (self.root / "dockerd.log").open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    async def ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while docker_unreachable(self.url) is not None:
            if time.monotonic() > deadline or (self.process is not None and self.process.poll() is not None):
                tail = (self.root / "dockerd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the campaign's dockerd did not come up:\n{tail}")
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    async def restart(self) -> None:
        await asyncio.to_thread(self.stop)
        self.start()
        await self.ready()

    def remove(self, keep_log: Path) -> None:
        self.stop()
        containerd = self.root / "x" / "containerd" / "containerd.pid"  # a crash leaves it running
        with contextlib.suppress(OSError, ValueError):
            pid = int(containerd.read_text().strip())
            if Path(f"/proc/{pid}/comm").read_text().strip() == "containerd":  # not a reused pid
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            shutil.copyfile(self.root / "dockerd.log", keep_log)
        subprocess.run(["umount", "-R", "-l", str(self.root / "data")], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


DOCKER_CALL_S = 5.0  # a pause, unpause or kill that takes longer is stuck (see `unpause`)


def after(delay_s: float, action: Callable[[], Awaitable[object]]) -> asyncio.Task[None]:
    """`action()` `delay_s` from now, in a task the caller owns and awaits; a process or container
    gone meanwhile is no error."""

    async def later() -> None:
        await asyncio.sleep(delay_s)
        with contextlib.suppress(ProcessLookupError, aiodocker.DockerError):
            await action()

    return asyncio.create_task(later())


async def resume(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


async def unpause(container: aiodocker.containers.DockerContainer, what: str) -> None:
    """Docker cannot always undo its own pause: an exec that starts as the container freezes
    waits in the frozen cgroup while holding the daemon's lock on the container, and every
    later call on it (unpause, inspect) waits behind it. The cgroup is then thawed directly."""
    try:
        async with asyncio.timeout(DOCKER_CALL_S):
            await container.unpause()
    except aiodocker.DockerError as exc:  # gone, or thawed by a checkpointer restart
        print(f"chaos: unpausing {what} ({container.id[:12]}): {exc}", file=sys.stderr)
    except TimeoutError:
        print(
            f"chaos: docker did not unpause {what} ({container.id[:12]}): thawing its cgroup", file=sys.stderr
        )
        thaw(container.id)


def thaw(container_id: str) -> None:
    """Thaw a container's freezer cgroup (v1 or v2) under the daemon's back."""
    root = Path("/sys/fs/cgroup")
    for state in root.glob(f"freezer/*/{container_id}/freezer.state"):  # v1, cgroupfs driver
        state.write_text("THAWED")
    for pattern in (f"*/{container_id}/cgroup.freeze", f"*/docker-{container_id}.scope/cgroup.freeze"):  # v2
        for freeze in root.glob(pattern):
            freeze.write_text("0")


class CappedStore:
    """The checkpointer's state folder on a tmpfs of its own size, which a fault fills for a while:
    every checkpoint then meets a full disk. Needs root."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)

    def fill(self) -> Path:
        """Write a ballast file of its own until the store is full; returns it."""
        ballast = self.path / f".ballast-{time.monotonic_ns()}"
        block = b"\0" * (1 << 20)
        try:
            with ballast.open("wb") as out:
                while True:
                    out.write(block)
                    out.flush()
        except OSError:  # full: the point (or full already, by another fault's ballast)
            pass
        return ballast

    async def full_for(self, seconds: float) -> None:
        ballast = await asyncio.to_thread(self.fill)
        await asyncio.sleep(seconds)
        ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)


@dataclass
class Lab:
    """What the campaign runs of its own, so that its faults touch nothing else."""

    nats: Nats
    docker: aiodocker.Docker
    dockerd: OwnDockerd | None  # None: the host's dockerd, which is never restarted
    store: CappedStore | None  # None: no store-full faults
