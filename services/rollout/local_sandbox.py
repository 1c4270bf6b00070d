"""Sandboxes without Docker: each one a scratch folder, each action `sh -c` in it.

What a trajectory runs its actions in where no Docker daemon (or no CRIU) is at hand, the demo's
fallback: the same calls as the checkpointer's client (`SandboxClient`), answered in this
process. There are no checkpoints (a checkpoint fails with "checkpoint-failed", a restore finds
"no-checkpoint", so a failure restarts the trajectory from its setup) and no isolation beyond the
folder: the actions run as this user, on this host. Only tasks whose actions the project wrote
belong here (a menu, a setup, a check given a shell-quoted answer); the model's free text never does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import (
    Ack,
    CheckpointResult,
    ExecResult,
    RestoreResult,
    SandboxInfo,
    SandboxSpec,
)

SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as the checkpointer's (protocol.SandboxId)
OUTPUT_CAP = 64 << 10  # bytes kept of each stream: the agent sees only the tail of it anyway
TIMED_OUT_EXIT = 137  # what a killed action exits with, as in a container


def run_action(folder: Path, command: str, timeout_s: float) -> tuple[bytes, bytes, int, bool]:
    """`sh -c command` in `folder`: (stdout, stderr, exit code, timed out). Blocking. Spawned with
    subprocess from a thread, not the event loop's spawn: that one forks the whole trainer (its
    weights, hundreds of MiB), tens of milliseconds a fork, where subprocess takes vfork's
    couple."""
    process = subprocess.Popen(
        ["/bin/sh", "-c", command],
        cwd=folder, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killed whole on a timeout
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
        return stdout, stderr, process.returncode, False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return stdout, stderr, TIMED_OUT_EXIT, True


class LocalSandboxes:
    """The sandboxes of one process, under `root` (a fresh temporary folder by default)."""

    def __init__(self, root: Path | None = None, host_id: str = "local", actions_at_once: int = 64) -> None:
        self.root = root if root is not None else Path(tempfile.mkdtemp(prefix="belayer-sandboxes-"))
        self.host_id = host_id
        self.steps: dict[str, int] = {}  # sandbox -> actions it has completed
        # Actions wait in threads of their own: the loop's default pool (a few threads) would run
        # a handful at once, and share them with the trainer's file and torch work.
        self.threads = ThreadPoolExecutor(actions_at_once, thread_name_prefix="local-sandbox")

    def folder(self, sandbox: str) -> Path:
        if not SANDBOX_ID.fullmatch(sandbox):
            raise ServiceError("bad-request", f"bad sandbox id {sandbox!r}")
        return self.root / sandbox

    async def create(self, spec: SandboxSpec, sandbox: str = "", timeout_s: float = 60.0) -> SandboxInfo:
        folder = self.folder(sandbox)
        if sandbox in self.steps:
            raise ServiceError("exists", f"sandbox {sandbox} exists")
        await asyncio.to_thread(shutil.rmtree, folder, ignore_errors=True)  # an earlier process's
        await asyncio.to_thread(folder.mkdir, parents=True)
        self.steps[sandbox] = 0
        return SandboxInfo(
            sandbox=sandbox, host_id=self.host_id, container_id="", image=spec.image, state="running", step=0
        )

    async def exec(
        self, sandbox: str, command: str, timeout_s: float = 60.0, expect_step: int | None = None
    ) -> ExecResult:
        folder = self.folder(sandbox)
        if sandbox not in self.steps:
            raise ServiceError("no-sandbox", f"no sandbox {sandbox}")
        step = self.steps[sandbox]
        if expect_step is not None and expect_step != step:
            raise ServiceError("wrong-step", f"sandbox {sandbox} is at step {step}, not {expect_step}")
        loop = asyncio.get_running_loop()
        stdout, stderr, exit_code, timed_out = await loop.run_in_executor(
            self.threads, run_action, folder, command, timeout_s
        )
        self.steps[sandbox] = step + 1
        return ExecResult(
            sandbox=sandbox,
            step=step + 1,
            exit_code=exit_code,
            stdout=stdout[-OUTPUT_CAP:].decode(errors="replace"),
            stderr=stderr[-OUTPUT_CAP:].decode(errors="replace"),
            timed_out=timed_out,
            truncated=max(len(stdout), len(stderr)) > OUTPUT_CAP,
        )

    async def checkpoint(
        self,
        sandbox: str,
        trajectory: str,
        k: int,
        context_tokens: list[int] | None = None,
        context_ref: str = "",
        timeout_s: float = 120.0,
    ) -> CheckpointResult:
        raise ServiceError("checkpoint-failed", "no checkpoints without Docker and CRIU")

    async def restore(self, trajectory: str, timeout_s: float = 300.0) -> RestoreResult:
        raise ServiceError("no-checkpoint", "no checkpoints without Docker and CRIU")

    async def destroy(self, sandbox: str, timeout_s: float = 60.0) -> Ack:
        folder = self.folder(sandbox)
        self.steps.pop(sandbox, None)
        await asyncio.to_thread(shutil.rmtree, folder, ignore_errors=True)
        return Ack()

    async def end(self, trajectory: str, timeout_s: float = 60.0) -> Ack:
        return Ack()  # no checkpoint pointers to drop

    async def close(self) -> None:
        """Every folder removed; the actions still running are waited for."""
        await asyncio.to_thread(self.threads.shutdown)
        await asyncio.to_thread(shutil.rmtree, self.root, ignore_errors=True)
