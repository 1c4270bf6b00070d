"""Running the real `belayer` command in tests, and one sample message of every event kind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator
from pathlib import Path

from belayer_rl.shared import protocol
from belayer_rl.shared.config import NATS_URL_ENV, STATE_DIR_ENV

# The console script pip installed for this interpreter: what a user runs. From a source tree without
# it, the same entry point through the interpreter.
_SCRIPT = Path(sysconfig.get_path("scripts")) / "belayer"
BELAYER = (
    [str(_SCRIPT)]
    if _SCRIPT.exists()
    else [sys.executable, "-c", "import sys; from belayer_rl.cli.main import main; sys.exit(main())"]
)
READY_LINE = "following "  # what `belayer events` writes on stderr once it is subscribed


def clean_env() -> dict[str, str]:
    """The environment minus the variables that would point a command at some other cluster."""
    env = {k: v for k, v in os.environ.items() if k not in (NATS_URL_ENV, STATE_DIR_ENV)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def belayer(*args: str, timeout_s: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BELAYER, *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=timeout_s,
        check=False,
        cwd=cwd,
    )


class EventsProcess:
    """A running `belayer events ...`, subscribed (its ready line was read) before it is handed out."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def output(self, timeout_s: float = 30) -> list[str]:
        """Its stdout lines, once it has exited by itself (--count reached)."""
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await self.process.communicate()
        assert self.process.returncode == 0, stderr.decode()
        return stdout.decode().splitlines()


@contextlib.asynccontextmanager
async def events_process(*args: str, timeout_s: float = 30) -> AsyncIterator[EventsProcess]:
    process = await asyncio.create_subprocess_exec(
        *BELAYER, "events", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=clean_env(),
    )  # fmt: skip
    try:
        assert process.stderr is not None
        async with asyncio.timeout(timeout_s):
            line = (await process.stderr.readline()).decode()
        assert line.startswith(READY_LINE), f"belayer events did not start: {line!r}"
        yield EventsProcess(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


DIGEST = "sha256:" + "ab" * 32

# kind -> (the id its publisher puts after the kind, a message of the kind's type)
SAMPLES: dict[str, tuple[str, protocol.Message]] = {
    "heartbeat": (
        "e0",
        protocol.Heartbeat(
            engine_id="e0", epoch=3, pid=101, running=1, waiting=2, outstanding_tokens=40, weight_version="v1"
        ),
    ),
    "worker_registered": (
        "e1",
        protocol.WorkerRegistration(engine_id="e1", epoch=4, pid=102, preset="tiny", weight_version="v1"),
    ),
    "worker_failed": (
        "e0",
        protocol.WorkerFailed(engine_id="e0", epoch=3, pid=101, reason="heartbeat-timeout", detail="1.2s"),
    ),
    "request_resumed": (
        "r1",
        protocol.RequestResumed(
            request_id="r1", attempt=2, engine_id="e1", epoch=4, from_position=17, reason="worker-failed"
        ),
    ),
    "request_failed": (
        "r2",
        protocol.RequestFailed(request_id="r2", code="no-workers", message="no engine within 30s"),
    ),
    "process": (
        "router",
        protocol.ProcessEvent(name="router", pid=103, state="restarting", exit_code=1, backoff_s=0.4),
    ),
    "router_started": ("104", protocol.RouterStarted(router_pid=104, rebuilt_requests=2, resumed_requests=1)),
    "handover": (
        "e1",
        protocol.Handover(
            engine_id="e1",
            reason="exit",
            path="shadow",
            old_pid=102,
            new_pid=105,
            epoch=5,
            detected_at=1_700_000_000.5,
            phases_ms={"kill_confirmed": 1.5, "promoted": 3.25},
        ),
    ),
    "engine_quarantined": ("e1", protocol.EngineQuarantined(engine_id="e1", failures=2, window_s=60.0)),
    "engine_unstable": (
        "e1",
        protocol.EngineUnstable(engine_id="e1", failures=3, window_s=60.0, backoff_s=2.0),
    ),
    "record_skipped": (
        "router",
        protocol.RecordSkipped(
            service="router", store="engine-registry", key="e0", sequence=7, reason="nested too deeply"
        ),
    ),
    "weights_published": (
        "v2",
        protocol.WeightsPublished(version="v2", segment="belayer.w.v2", size=4096, previous="v1"),
    ),
    "model_published": (
        "hf-0123456789abcdef",
        protocol.ModelPublished(version="hf-0123456789abcdef", path="/models/step-1"),
    ),
    "checkpoint_ready": (
        "t1",
        protocol.CheckpointReady(
            trajectory="t1",
            sandbox="s1",
            host_id="h1",
            checkpoint_id="c1",
            incarnation=0,
            k=3,
            context_digest=DIGEST,
            bytes_written=1024,
            freeze_s=0.1,
            total_s=0.5,
        ),
    ),
    "env_failure": (
        "s2",
        protocol.EnvFailure(
            sandbox="s2", host_id="h1", container_id="abc123", reason="oom-killed", detail="137", step=4
        ),
    ),
    "sandbox_restored": (
        "t2",
        protocol.SandboxRestored(
            trajectory="t2",
            sandbox="s3",
            host_id="h1",
            source="previous",
            checkpoint_id="c0",
            incarnation=1,
            k=2,
            rejected=["c1: digest mismatch"],
            restore_s=0.3,
        ),
    ),
    "trajectory_ended": ("t3", protocol.TrajectoryEnded(trajectory="t3", host_id="h2")),
    "policy_decision": (
        "t2",
        protocol.PolicyDecision(
            trajectory="t2",
            host_id="h1",
            step=4,
            policy="adaptive",
            checkpoint=True,
            reason="benefit p·C 0.4 s ≥ expected visible cost 0.3 s (3 samples)",
            p=0.01,
            rate_per_s=0.02,
            step_duration_s=0.5,
            exposure_s=40.0,
            elapsed_s=1.0,
            cost_s=2.0,
            samples=3,
            expected_visible_cost_s=0.3,
            survival=0.6,
            benefit_s=0.4,
        ),
    ),
    "env_step": ("t2", protocol.EnvStep(trajectory="t2", host_id="h1", step=4, duration_s=0.5)),
    "llm_response": ("t2", protocol.LlmResponse(trajectory="t2", seconds=2.5, tokens=180)),
    "checkpoint_timeout": (
        "h1",
        protocol.CheckpointTimeout(trajectory="t2", host_id="h1", k=4, waited_s=30.0),
    ),
    "policy_fallback": (
        "t2",
        protocol.PolicyFallback(trajectory="t2", policy="every-3", why="no answer in 0.5 s"),
    ),
    "chaos_kill": (
        "t2",
        protocol.ChaosKill(
            trajectory="t2", sandbox="t2", host_id="h1", container_id="c0ffee", step=5, delay_s=0.12
        ),
    ),
    "chaos_fault": (
        "worker-kill",
        protocol.ChaosFault(kind="worker-kill", target="e0 pid 4242", hits=3, at_s=12.5),
    ),
    "trainer_step": (
        "run1",
        protocol.TrainerStep(
            run="run1",
            step=3,
            weight_version="sha256:ab",
            generated_with=["sha256:aa"],
            reward_mean=0.5,
            loss=-0.01,
            kl=0.0,
            clipped_fraction=0.02,
            samples=256,
            response_tokens=512,
            tokens_per_s=900.0,
            resumes=0,
            rollout_s=0.5,
            update_s=0.3,
            publish_s=0.05,
        ),
    ),
    "group_heartbeat": (
        "run1",
        protocol.GroupHeartbeat(run="run1", group="actor", rank=1, pid=103, step=3, progress=6, cpu_s=1.5),
    ),
    "group_failed": (
        "run1",
        protocol.GroupFailed(
            run="run1",
            group="actor",
            rank=0,
            kind="exit",
            cause="killed by SIGKILL",
            step=3,
            attempt=1,
            detected_s=0.01,
        ),
    ),
    "group_rebuilt": (
        "run1",
        protocol.GroupRebuilt(
            run="run1", group="actor", rebuild=1, step=3, stop_s=0.05, start_s=7.0, total_s=7.05
        ),
    ),
    "reschedule": (
        "run1",
        protocol.Reschedule(run="run1", attempt=1, from_step=2, failed_step=3, cause="group actor failed"),
    ),
}
