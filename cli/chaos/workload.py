"""The work a chaos campaign keeps running: generations, each with its fault-free reference computed
in-process, and sandbox trajectories that write a file one line per action, checkpoint after
every action and recover from their latest checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE
from belayer_rl.shared import tokenizer
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client
from belayer_rl.shared.protocol import (
    SandboxSpec,
)

WORDS = ["rope", "anchor", "belay", "carabiner", "crux", "ledge", "pitch", "summit", "traverse", "chalk"]
SANDBOX_RETRY_S = 0.5  # between tries of a sandbox call that met no checkpointer or no bus
AWAY_TRIES, TIMEOUT_TRIES = 120, 2  # the bounds of those tries
HOST_AWAY = ("no-responders", "daemon-unavailable", "store-full")  # a sandbox call tried again
SANDBOX = SandboxSpec(image=DEFAULT_IMAGE, memory_mb=64)
RECOVERY_BACKOFF_MAX_S = 8.0  # between recoveries of one trajectory: 0.5 s, doubling, at most this
MAX_RECOVERIES = 12  # per trajectory: past it, it fails, naming the last error
TRAJECTORY_DEADLINE_S = 240.0  # a trajectory of `--steps` actions that takes longer has failed
CLEANUP_DEADLINE_S, CLEANUP_TRY_S = 60.0, 10.0  # a trajectory's end, and its destroy: each, each try
SETTLE_S = 120.0  # for the work still running after the last fault to end


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: str
    max_tokens: int
    seed: int
    temperature: float = 0.8
    min_tokens: int = 0  # EOS held back until this many are generated


@dataclass(frozen=True)
class Output:
    """What a generation produced: its tokens and the logprob of each."""

    tokens: list[int]
    logprobs: list[float]


def reference_outputs(jobs: list[Job], preset: str = "tiny", weights_seed: int = 0) -> dict[str, Output]:
    """What an uninterrupted run produces: the engine in-process, all jobs in one batch."""
    from belayer_rl.services.worker.engine import Engine, EngineConfig, SeqSpec  # torch: only when asked

    engine = Engine(EngineConfig(preset=preset, weights_seed=weights_seed))
    for job in jobs:
        spec = SeqSpec(
            key=job.request_id,
            prompt_tokens=tokenizer.encode(job.prompt),
            prefix_tokens=[],
            max_new_tokens=job.max_tokens,
            seed=job.seed,
            temperature=job.temperature,
            min_new_tokens=job.min_tokens,
        )
        engine.submit(spec)
    out = {job.request_id: Output([], []) for job in jobs}
    while engine.has_work():
        for event in engine.step():
            out[str(event.key)].tokens.extend(event.new_tokens)
            out[str(event.key)].logprobs.extend(event.new_logprobs)
    return out


def reference_tokens(jobs: list[Job], preset: str = "tiny", weights_seed: int = 0) -> dict[str, list[int]]:
    """The tokens of reference_outputs."""
    return {rid: output.tokens for rid, output in reference_outputs(jobs, preset, weights_seed).items()}


@dataclass
class Generations:
    """Generations run one after another in each of `slots` producers until `stopping`."""

    client: Client
    seed: int
    max_tokens: int
    jobs: list[Job] = field(default_factory=list)
    outputs: dict[str, Output] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> the bound or error that ended it

    def in_flight(self) -> str:
        ended = self.outputs.keys() | self.failed.keys()
        return ", ".join(j.request_id for j in self.jobs if j.request_id not in ended) or "no generation"

    async def produce(self, slot: int, stopping: asyncio.Event) -> None:
        rng = random.Random(self.seed * 1000 + slot)
        n = 0
        while not stopping.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            job = Job(f"chaos-g{slot}-{n}", prompt, self.max_tokens, seed=rng.randrange(1 << 31))
            self.jobs.append(job)
            try:
                async with asyncio.timeout(SETTLE_S):
                    result = await self.client.generate_all(
                        job.prompt, max_tokens=job.max_tokens, seed=job.seed,
                        temperature=job.temperature, request_id=job.request_id,
                    )  # fmt: skip
                self.outputs[job.request_id] = Output(result.tokens, result.logprobs)
            except ServiceError as exc:
                self.failed[job.request_id] = f"{exc.code}: {exc.message}"
            except TimeoutError:
                self.failed[job.request_id] = f"no end within {SETTLE_S:.0f}s"
            n += 1


def trail_line(trajectory: str, step: int) -> str:
    return f"{trajectory}:{step}"


def context_for(trajectory: str, k: int) -> list[int]:
    """The L_k a trajectory checkpoints at step k: its own, so a restore can be checked exactly."""
    base = sum(trajectory.encode()) % 1000
    return [base + i for i in range(k)]


class TrajectoryFailed(Exception):
    """A trajectory past its bound of recoveries: the message names the bound and the last error."""


@dataclass
class Trajectories:
    """Sandbox trajectories run one after another in each of `slots` producers until `stopping`.
    Action i appends line i to /tmp/trail and prints the file; each is checkpointed as k = i."""

    sandboxes: SandboxClient
    steps: int
    started: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    restores: int = 0
    running: dict[str, int] = field(default_factory=dict)  # trajectory -> its step now
    # trajectory -> (the call it waits on, since when, its tries so far)
    waiting: dict[str, tuple[str, float, str]] = field(default_factory=dict)

    async def produce(self, slot: int, stopping: asyncio.Event) -> None:
        n = 0
        while not stopping.is_set():
            trajectory = f"chaos-t{slot}-{n}"
            self.started.append(trajectory)
            try:
                async with asyncio.timeout(TRAJECTORY_DEADLINE_S):
                    await self.run(trajectory)
                self.completed.append(trajectory)
            except TrajectoryFailed as exc:
                self.failed[trajectory] = str(exc)
                await asyncio.sleep(SANDBOX_RETRY_S)  # not a hot loop when every trajectory fails
            except TimeoutError:
                step = self.running.get(trajectory, 0)
                self.failed[trajectory] = (
                    f"trajectory-deadline: at step {step} after {TRAJECTORY_DEADLINE_S:.0f}s, "
                    f"waiting on {self.waiting_on(trajectory)}"
                )
            finally:
                self.running.pop(trajectory, None)
                # Each bounded: a sandbox left behind is the leak check's to report.
                for what, make in (
                    ("end", lambda t=trajectory: self.sandboxes.end(t, timeout_s=CLEANUP_TRY_S)),
                    ("destroy", lambda t=trajectory: self.sandboxes.destroy(t, timeout_s=CLEANUP_TRY_S)),
                ):
                    with contextlib.suppress(ServiceError, TimeoutError):
                        async with asyncio.timeout(CLEANUP_DEADLINE_S):
                            await self.call(trajectory, what, make)
                self.waiting.pop(trajectory, None)
            n += 1

    def in_flight(self) -> str:
        """Each trajectory not yet ended, with its step and its last sandbox call (create, exec,
        checkpoint, restore, end, destroy)."""
        running = [
            f"{t} at step {self.running.get(t, '-')}, last call {self.waiting_on(t)}" for t in self.waiting
        ]
        return ", ".join(running) or "no trajectory"

    def waiting_on(self, trajectory: str) -> str:
        if trajectory not in self.waiting:
            return "nothing"
        what, since, tries = self.waiting[trajectory]
        return f"{what} for {time.monotonic() - since:.0f}s ({tries})"

    async def call(self, trajectory: str, what: str, make):
        """A sandbox call, tried again while nobody serves it (the checkpointer or the bus
        restarting), Docker is away or the store is full, and, a few times, when it timed out
        (a reply lost with the bus). `waiting` says what it waits on, for a deadline's report."""
        away, timeouts, since = 0, 0, time.monotonic()
        while True:
            self.waiting[trajectory] = (what, since, f"{away} away, {timeouts} timeouts")
            try:
                return await make()
            except ServiceError as exc:
                away += exc.code in HOST_AWAY
                timeouts += exc.code == "timeout"
                if exc.code not in (*HOST_AWAY, "timeout") or away > AWAY_TRIES or timeouts > TIMEOUT_TRIES:
                    raise
                await asyncio.sleep(SANDBOX_RETRY_S)

    async def run(self, trajectory: str) -> None:
        """The trajectory's actions; any failure of the sandbox or of the services under it is
        recovered from the latest checkpoint (or the base image), up to MAX_RECOVERIES times, as
        a rollout driver's bounded retries would."""
        step, acked, recoveries = 0, 0, 0
        failed: ServiceError | None = None
        try:
            await self.call(trajectory, "create", lambda: self.sandboxes.create(SANDBOX, sandbox=trajectory))
        except ServiceError as exc:  # the restore below starts it from the base image
            failed, recoveries = exc, 1
        while step < self.steps:
            self.running[trajectory] = step
            try:
                if failed is not None:
                    step, failed = await self.restore(trajectory, acked), None
                    continue
                result = await self.call(
                    trajectory, "exec", lambda step=step: self.sandboxes.exec(
                        trajectory, f"echo {trail_line(trajectory, step + 1)} >> /tmp/trail && cat /tmp/trail",
                        timeout_s=30.0, expect_step=step,
                    )
                )  # fmt: skip
                expected = [trail_line(trajectory, i) for i in range(1, step + 2)]
                if result.stdout.split() != expected:
                    self.violations.append(
                        f"{trajectory} step {step + 1}: the file system shows {result.stdout.split()}, "
                        f"expected {expected}"
                    )
                step += 1
                with contextlib.suppress(ServiceError):  # a checkpoint is an optimisation
                    self.waiting[trajectory] = (f"checkpoint k={step}", time.monotonic(), "one try")
                    done = await self.sandboxes.checkpoint(
                        trajectory,
                        trajectory,
                        k=step,
                        context_tokens=context_for(trajectory, step),
                        timeout_s=30.0,
                    )
                    acked = max(acked, done.k)
            except ServiceError as exc:
                recoveries += 1
                if recoveries > MAX_RECOVERIES:
                    raise TrajectoryFailed(
                        f"too-many-recoveries: {recoveries - 1} recoveries (the bound), then {exc.code}: {exc.message}"
                    ) from None
                failed = exc
                await asyncio.sleep(min(SANDBOX_RETRY_S * 2 ** (recoveries - 1), RECOVERY_BACKOFF_MAX_S))

    async def restore(self, trajectory: str, acked: int) -> int:
        """Restore the latest checkpoint, check it, and return the step it resumes at."""
        self.restores += 1
        try:
            restored = await self.call(
                trajectory, "restore", lambda: self.sandboxes.restore(trajectory, timeout_s=60.0)
            )
        except ServiceError as exc:
            if exc.code not in ("no-checkpoint", "no-sandbox"):  # (no-sandbox: its create failed)
                raise
            restored = None
        k = 0 if restored is None else restored.k
        if k < acked:
            self.violations.append(
                f"{trajectory}: checkpoint k={acked} was acknowledged, the restore gave k={k}"
                + ("" if restored is None else f" ({restored.source}; rejected: {restored.rejected})")
            )
        if restored is not None and k > 0 and list(restored.context_tokens) != context_for(trajectory, k):
            self.violations.append(f"{trajectory}: the restore of k={k} returned another L_k")
        if k == 0:  # from the base image
            with contextlib.suppress(ServiceError):
                await self.call(trajectory, "destroy", lambda: self.sandboxes.destroy(trajectory))
            await self.call(trajectory, "create", lambda: self.sandboxes.create(SANDBOX, sandbox=trajectory))
        return k
