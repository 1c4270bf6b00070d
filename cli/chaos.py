"""`belayer chaos`: a seeded fault campaign against a local cluster, and the oracle that judges it.

The campaign starts what `belayer up` starts (nats-server, a router and a warm standby, workers
under the shadow supervisor, the weight and KV servers, the checkpointer and the policy service)
and keeps two kinds of work running throughout:
- generations, each compared afterwards with its fault-free reference (the engine in-process);
- sandbox trajectories, whose every action appends a line to a file and prints the file, and which
  are checkpointed after every action with an L_k of their own making; a failed sandbox is
  restored from its latest checkpoint and carries on.

Meanwhile a seeded schedule injects faults, one every `--interval` seconds on average: SIGKILL and
SIGSTOP/SIGCONT of workers, routers and services, nats-server killed and restarted, sandbox
containers killed and paused, the checkpoint store full for a while, dockerd restarted. Each fault
is a `chaos_fault` event. The seed fixes the kinds and the times; the targets are whatever is in
flight when a fault fires. The campaign runs its own nats-server, its own dockerd and its own
size-capped checkpoint store (a tmpfs), so that restarting or filling them touches nothing else;
the last two need root.

The oracle then checks:
- every generation's tokens equal its reference;
- the token log: every whole chunk came from the attempt its request was last dispatched to, no
  record of a router incarnation older than one that claimed the request, and the tokens the log
  holds for each finished request are the ones its client got (no acknowledged chunk lost);
- every action's output shows exactly the file its trajectory wrote so far, after any restore too;
  every restore returns the L_k its checkpoint was given and no checkpoint older than the newest
  acknowledged one;
- at least `--min-completion` of the generations and of the trajectories completed; any that did
  not names the bound that stopped it;
- afterwards nothing leaked: no shared-memory segment, container, checkpoint or process of the
  cluster, and no more JetStream consumers than the cluster held at rest.

    belayer chaos --faults 1000 --seed 7 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker
import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from belayer_rl.cli.cluster import ClusterConfig, Supervisor, local_cluster, role_access, write_credentials
from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.services.checkpointer.probe import docker_unreachable
from belayer_rl.services.checkpointer.sandbox import LABEL_SANDBOX
from belayer_rl.services.router import token_log
from belayer_rl.services.router.lease import lease_holder
from belayer_rl.shared import bus, protocol, tokenizer
from belayer_rl.shared import config as flags
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import hostname_id, positive, setting
from belayer_rl.shared.processes import free_port, start_nats_server
from belayer_rl.shared.protocol import (
    ChaosFault,
    LogChunk,
    LogDispatch,
    LogEnd,
    LogStart,
    LogTakeover,
    RequestResumed,
    SandboxSpec,
)
from belayer_rl.shared.subjects import Subjects

FAULT_KINDS = (
    "worker-kill",
    "worker-stop",
    "router-kill",
    "router-stop",
    "service-kill",
    "nats-restart",
    "container-kill",
    "container-pause",
    "store-full",
    "dockerd-restart",
)
KILLED_SERVICES = ("kv-server", "weight-server", "shadow-supervisor", "checkpointer", "policy")
WORDS = "rope anchor belay carabiner crux ledge pitch summit traverse chalk".split()
SANDBOX_RETRY_S = 0.5  # between tries of a sandbox call that met no checkpointer or no bus
AWAY_TRIES, TIMEOUT_TRIES = 120, 2  # the bounds of those tries
HOST_AWAY = ("no-responders", "daemon-unavailable", "store-full")  # a sandbox call tried again
SANDBOX = SandboxSpec(image=DEFAULT_IMAGE, memory_mb=64)
RECOVERY_BACKOFF_MAX_S = 8.0  # between recoveries of one trajectory: 0.5 s, doubling, at most this
MAX_RECOVERIES = 12  # per trajectory: past it, it fails, naming the last error
TRAJECTORY_DEADLINE_S = 240.0  # a trajectory of `--steps` actions that takes longer has failed
CLEANUP_DEADLINE_S, CLEANUP_TRY_S = 60.0, 10.0  # a trajectory's end, and its destroy: each, each try
PROGRESS_EVERY = 25  # faults between progress lines
DOCKER_CALL_S = 5.0  # a pause, unpause or kill that takes longer is stuck (see Injector.unpause)
SETTLE_S = 120.0  # for the work still running after the last fault to end
IN_FLIGHT_REPORT_S = 30.0  # while that work ends, what still runs is printed this often
TARGET_TRIES, TARGET_RETRY_S = 20, 0.25  # a fault whose target is away waits for it this long
STORE_MB = 256  # the checkpoint store's tmpfs: far more than the campaign's checkpoints need


@dataclass(frozen=True)
class ChaosConfig:
    state_dir: Path | None = setting(
        None,
        "the campaign cluster's state (default: a temporary folder, removed after)",
        flag="--campaign-dir",
    )
    faults: int = setting(200, "faults to inject")
    seed: int = setting(0, "fixes the kinds of the faults and when they come")
    interval_s: float = setting(1.0, "mean seconds between faults")
    kinds: tuple[str, ...] = setting(FAULT_KINDS, "fault kinds, comma-separated", flag="--kinds")
    engines: int = setting(2, "rollout workers")
    generators: int = setting(4, "generations kept running at once")
    trajectories: int = setting(2, "sandbox trajectories kept running at once")
    steps: int = setting(6, "actions per trajectory")
    max_tokens: int = setting(300, "tokens per generation")
    nats_restarts: int = setting(5, "most nats-server restarts in the campaign")
    dockerd_restarts: int = setting(5, "most restarts of the campaign's own dockerd")
    min_completion: float = setting(0.95, "share of generations and of trajectories that must complete")
    debug_accept_stale: bool = setting(
        False, "DEBUG: the router accepts stale attempts; the oracle must then report violations"
    )
    json: bool = setting(False, "print the summary as one JSON object")

    def __post_init__(self) -> None:
        positive("--interval", self.interval_s)
        unknown = sorted(set(self.kinds) - set(FAULT_KINDS))
        if unknown or not self.kinds:
            raise flags.ConfigError(f"--kinds: unknown {unknown}; choose from {', '.join(FAULT_KINDS)}")


# ---------------------------------------------------------------- the reference


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: str
    max_tokens: int
    seed: int
    temperature: float = 0.8
    min_tokens: int = 0  # EOS held back until this many are generated


def reference_tokens(jobs: list[Job], preset: str = "tiny", weights_seed: int = 0) -> dict[str, list[int]]:
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
    out: dict[str, list[int]] = {job.request_id: [] for job in jobs}
    while engine.has_work():
        for event in engine.step():
            out[str(event.key)].extend(event.new_tokens)
    return out


# ---------------------------------------------------------------- the work kept running


@dataclass
class Generations:
    """Generations run one after another in each of `slots` producers until `stopping`."""

    client: Client
    seed: int
    max_tokens: int
    jobs: list[Job] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> the bound or error that ended it

    def in_flight(self) -> str:
        ended = self.tokens.keys() | self.failed.keys()
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
                self.tokens[job.request_id] = result.tokens
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


# ---------------------------------------------------------------- faults


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float
    hits: int  # requests or trajectories in flight on the target when it struck


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


@dataclass
class Injector:
    config: ChaosConfig
    cluster: Supervisor
    lab: Lab
    client: Client
    subjects: Subjects
    trajectories: Trajectories
    started_at: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)
    seen_pids: dict[int, int | None] = field(default_factory=dict)  # pid -> its start_ticks
    resumptions: list[asyncio.Task[None]] = field(default_factory=list)  # the SIGCONTs and unpauses due

    async def run(self) -> None:
        """Inject the schedule; whatever ends it, every SIGCONT, unpause and ballast removal due
        is still made before it returns."""
        try:
            await self.inject()
        finally:
            await asyncio.gather(*self.resumptions)

    async def inject(self) -> None:
        # The schedule (kinds and times) comes from the seed alone; the targets, drawn from
        # another stream, depend on what is in flight.
        schedule, targets = random.Random(self.config.seed), random.Random(self.config.seed + 1)
        kinds = list(self.config.kinds)
        capped = {"nats-restart": self.config.nats_restarts, "dockerd-restart": self.config.dockerd_restarts}
        while len(self.faults) < self.config.faults and kinds:
            await asyncio.sleep(schedule.expovariate(1.0 / self.config.interval_s))
            kind = schedule.choice(kinds)
            if kind in capped and self.count(kind) >= capped[kind]:
                kinds.remove(kind)
                continue
            fault = None
            for _ in range(TARGET_TRIES):  # the target may be restarting (a router after its kill)
                try:
                    fault = await self.strike(kind, targets)
                except (ServiceError, aiodocker.DockerError, nats.errors.Error, TimeoutError, OSError) as exc:
                    # (the bus restarting, a process gone: ProcessLookupError is an OSError)
                    print(f"chaos: no target for {kind} yet ({type(exc).__name__}: {exc})", file=sys.stderr)
                if fault is not None:
                    break
                await asyncio.sleep(TARGET_RETRY_S)
            if fault is None:
                continue
            self.faults.append(fault)
            if len(self.faults) % PROGRESS_EVERY == 0:
                elapsed = time.monotonic() - self.started_at
                print(f"chaos: {len(self.faults)} faults in {elapsed:.0f}s", file=sys.stderr)
            with contextlib.suppress(Exception):  # the bus may be the fault
                event = ChaosFault(kind=fault.kind, target=fault.target, hits=fault.hits, at_s=fault.at_s)
                await bus.publish(self.client.nc, self.subjects.event("chaos_fault", kind), event)

    def count(self, kind: str) -> int:
        return sum(1 for f in self.faults if f.kind == kind)

    def later(self, delay_s: float, action) -> None:
        async def after() -> None:
            await asyncio.sleep(delay_s)
            with contextlib.suppress(ProcessLookupError, aiodocker.DockerError):
                await action()

        self.resumptions.append(asyncio.create_task(after()))

    def signal(self, pid: int, sig: signal.Signals) -> None:
        self.seen_pids.setdefault(pid, start_ticks(pid))
        os.kill(pid, sig)

    async def strike(self, kind: str, rng: random.Random) -> Fault | None:
        at = time.monotonic() - self.started_at
        if kind in ("worker-kill", "worker-stop"):
            status = await self.client.status()
            engines = [e for e in status.engines if e.alive and e.pid > 0]
            if not engines:
                return None
            engine = rng.choice(engines)
            hits = sum(1 for r in status.requests if r.engine_id == engine.engine_id)
            if kind == "worker-kill":
                self.signal(engine.pid, signal.SIGKILL)
            else:
                self.signal(engine.pid, signal.SIGSTOP)
                self.later(rng.uniform(0.3, 1.5), lambda pid=engine.pid: self.resume_pid(pid))
            return Fault(kind, f"{engine.engine_id} pid {engine.pid}", at, hits)
        if kind in ("router-kill", "router-stop"):
            holder = await lease_holder(self.client.nc.jetstream(), self.subjects)
            if holder is None or holder.released:
                return None
            status = await self.client.status()
            hits = sum(1 for r in status.requests if r.engine_id)
            if kind == "router-kill":
                self.signal(holder.pid, signal.SIGKILL)
            else:
                self.signal(holder.pid, signal.SIGSTOP)
                self.later(holder.ttl_s + rng.uniform(0.5, 1.5), lambda pid=holder.pid: self.resume_pid(pid))
            return Fault(kind, f"router incarnation {holder.incarnation} pid {holder.pid}", at, hits)
        if kind == "service-kill":
            name = rng.choice([n for n in KILLED_SERVICES if n in self.cluster.children])
            pid = self.cluster.children[name].pid
            if pid <= 0:
                return None
            if name in ("checkpointer", "policy"):
                hits = len(self.trajectories.running)
            else:  # the weight and KV servers, and the shadow supervisor, serve every request
                hits = await self.requests_in_flight()
            self.signal(pid, signal.SIGKILL)
            return Fault(kind, f"{name} pid {pid}", at, hits)
        if kind == "nats-restart":
            hits = len(self.trajectories.running) + await self.requests_in_flight()
            await self.lab.nats.restart(rng.uniform(0.2, 1.0))
            return Fault(kind, f"nats-server :{self.lab.nats.port}", at, hits)
        if kind == "store-full":
            assert self.lab.store is not None
            hits = len(self.trajectories.running)
            self.resumptions.append(asyncio.create_task(self.lab.store.full_for(rng.uniform(1.0, 3.0))))
            return Fault(kind, str(self.lab.store.path), at, hits)
        if kind == "dockerd-restart":
            assert self.lab.dockerd is not None
            hits = len(self.trajectories.running)
            if hits == 0:  # a restart between trajectories tests nothing: wait for one, as below
                return None
            await self.lab.dockerd.restart()
            return Fault(kind, self.lab.dockerd.url, at, hits)
        # container-kill, container-pause: a running trajectory's sandbox
        running = sorted(self.trajectories.running)
        if not running:
            return None
        trajectory = rng.choice(running)
        containers = await self.lab.docker.containers.list(
            filters={"label": [f"{LABEL_SANDBOX}={trajectory}"]}
        )
        if not containers:
            return None
        container = containers[0]
        try:
            async with asyncio.timeout(DOCKER_CALL_S):  # see `unpause`: the daemon may be stuck on it
                if kind == "container-kill":
                    await container.kill()
                else:
                    await container.pause()
        except TimeoutError:
            thaw(container.id)
            return None
        if kind == "container-pause":
            self.later(rng.uniform(0.3, 2.0), lambda c=container, t=trajectory: self.unpause(c, t))
        return Fault(kind, f"{trajectory} container {container.id[:12]}", at, 1)

    async def unpause(self, container, trajectory: str) -> None:
        """Docker cannot always undo its own pause: an exec that starts as the container freezes
        waits in the frozen cgroup while holding the daemon's lock on the container, and every
        later call on it (unpause, inspect) waits behind it. The cgroup is then thawed directly."""
        try:
            async with asyncio.timeout(DOCKER_CALL_S):
                await container.unpause()
        except aiodocker.DockerError as exc:  # gone, or thawed by a checkpointer restart
            print(f"chaos: unpausing {trajectory} ({container.id[:12]}): {exc}", file=sys.stderr)
        except TimeoutError:
            print(
                f"chaos: docker did not unpause {trajectory} ({container.id[:12]}): thawing its cgroup",
                file=sys.stderr,
            )
            thaw(container.id)

    async def requests_in_flight(self) -> int:
        """As the router sees them; 0 while no router answers."""
        try:
            return len((await self.client.status(patience_s=0.5)).requests)
        except ServiceError:
            return 0

    async def resume_pid(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)


# ---------------------------------------------------------------- the oracle


END_DURABLE_WAIT_S = 15.0  # for the LogEnds of requests whose clients already heard of their end


async def check_token_log(
    js, names: Subjects, finished: dict[str, list[int]], *, end_wait_s: float = END_DURABLE_WAIT_S
) -> list[str]:
    """The log's own invariants, request by request, and the tokens it holds for each finished one.

    The router tells a request's clients of its end as it queues the LogEnd, so a client may
    finish before its end is in the log. The log is read again, for a bounded time, while a
    finished request's end is all that is missing."""
    deadline = time.monotonic() + end_wait_s
    while True:
        violations, unended = await read_token_log(js, names, finished)
        if not unended or time.monotonic() > deadline:
            return violations
        await asyncio.sleep(0.5)


async def read_token_log(js, names: Subjects, finished: dict[str, list[int]]) -> tuple[list[str], bool]:
    """One read of the log: its violations, and whether a finished request lacks only its end."""
    violations: list[str] = []
    claimed: dict[str, int] = {}  # request -> highest incarnation that claimed it
    current: dict[str, tuple[str, int, int]] = {}  # request -> the (engine, epoch, attempt) last dispatched
    logged: dict[str, token_log.LoggedRequest] = {}
    async for stored in token_log.each_record(js, names):
        record = stored.record
        if record is None:
            violations.append(f"{stored.subject} #{stored.sequence} does not decode: {stored.error}")
            continue
        request_id = record.request_id
        written = token_log.written_by(record)
        if written and written < claimed.get(request_id, 0):
            violations.append(f"{request_id} #{stored.sequence}: written by incarnation {written} after "
                              f"incarnation {claimed[request_id]} claimed it")  # fmt: skip
        match record:
            case LogStart():
                logged[request_id] = token_log.LoggedRequest(record)
            case LogTakeover():
                claimed[request_id] = max(claimed.get(request_id, 0), record.incarnation)
            case LogDispatch():
                current[request_id] = (record.engine_id, record.epoch, record.attempt)
            case LogChunk():
                source = (record.engine_id, record.epoch, record.attempt)
                whole = request_id in logged and len(record.tokens) == logged[request_id].start.chunk_tokens
                if whole and source != current.get(request_id):
                    violations.append(f"{request_id} chunk {record.index}: from {source}, but the request "
                                      f"was dispatched to {current.get(request_id)}")  # fmt: skip
                if request_id in logged:
                    logged[request_id].place(record)
            case LogEnd():
                if request_id in logged:
                    logged[request_id].end = record
    unended = False
    for request_id, tokens in finished.items():
        entry = logged.get(request_id)
        if entry is None:
            violations.append(f"{request_id}: finished, but its log has no start")
        elif entry.end is None:
            unended = True
            violations.append(f"{request_id}: finished, but its log has no end")
        elif entry.tokens != tokens:
            violations.append(f"{request_id}: the log holds {len(entry.tokens)} tokens, the client got {len(tokens)} "
                              "(or other ones)")  # fmt: skip
    return violations, unended


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks after boot, field 22 of /proc/<pid>/stat), or None
    when it is gone. With its pid it names one process, however often pids are handed out again."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def outliving(pids: dict[int, int | None]) -> list[int]:
    """The processes of `pids` (pid -> start_ticks when seen) that still run. A pid that names a
    process started at another time now was handed out again: not ours."""
    found = []
    for pid, started in sorted(pids.items()):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            os.kill(pid, 0)
            alive = not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
            if alive and (started is None or start_ticks(pid) == started):
                found.append(pid)
    return found


def leaks(cluster: Supervisor, pids: dict[int, int | None]) -> list[str]:
    """What the stopped cluster left behind: segments, processes, containers, checkpoints."""
    found = [f"/dev/shm/{name}" for name in os.listdir("/dev/shm") if name.startswith(cluster.shm_prefix)]
    found += [f"process {pid}" for pid in outliving(pids)]
    checkpoints = cluster.config.state_dir / "checkpointer"
    if checkpoints.exists():
        found += [str(p) for p in checkpoints.rglob("chaos-*") if p.is_dir() and any(p.iterdir())]
    return found


async def consumers(js) -> set[str]:
    """Every durable or ephemeral consumer the server holds, as stream/name."""
    found = set()
    for stream in await js.streams_info():
        found |= {f"{stream.config.name}/{c.name}" for c in await js.consumers_info(stream.config.name)}
    return found


# ---------------------------------------------------------------- the campaign


class Summary(msgspec.Struct, kw_only=True):
    seed: int
    duration_s: float
    faults: dict[str, int]
    hits: dict[str, int]  # by kind: in-flight requests or trajectories the faults struck
    generations: int
    generations_completed: int
    trajectories: int
    trajectories_completed: int
    recoveries: dict[str, int]
    incomplete: dict[str, str]  # request or trajectory -> the bound or error that stopped it
    violations: list[str]
    leaks: list[str]
    # Every process a fault struck, with its start_ticks: none may outlive the cluster.
    pids: dict[int, int | None] = {}
    phases: dict[str, float] = {}  # seconds each step took, in order: a slow run says where

    @property
    def passed(self) -> bool:
        return not self.violations and not self.leaks


async def start_nats(state_dir: Path, cluster: ClusterConfig) -> tuple[Nats, Path]:
    creds_dir = state_dir / "creds"
    server_config = write_credentials(cluster, creds_dir)
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port()
    store, log_path = state_dir / "jetstream", state_dir / "logs" / "nats-server.log"
    process = await start_nats_server(store, port, log_path, server_config)
    return Nats(port, store, log_path, server_config, process), creds_dir


@contextlib.asynccontextmanager
async def campaign_state(config: ChaosConfig) -> AsyncIterator[Path]:
    if config.state_dir is not None:
        config.state_dir.mkdir(parents=True, exist_ok=True)
        yield config.state_dir.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="belayer-chaos-") as folder:
        yield Path(folder)


@dataclass
class Phases:
    """The campaign's steps, one after another, each reported as it starts and as it ends, with
    how long it took: a run past its time bound says where the time went."""

    report: Callable[[str], None]
    took: dict[str, float] = field(default_factory=dict)
    running: tuple[str, float] | None = None

    def next(self, name: str | None) -> None:
        """End the running step; start `name` (None: none)."""
        now = time.monotonic()
        if self.running is not None:
            ended, started = self.running
            self.took[ended] = round(now - started, 1)
            self.report(f"chaos: {ended} took {self.took[ended]:.0f}s")
        self.running = None if name is None else (name, now)
        if name is not None:
            self.report(f"chaos: {name}...")


async def run_campaign(config: ChaosConfig, report=print) -> Summary:
    started = time.monotonic()
    phases = Phases(report)
    async with campaign_state(config) as state_dir, contextlib.AsyncExitStack() as stack:
        dockerd = store = None
        if "dockerd-restart" in config.kinds:
            # Short: a unix socket's path is bounded.
            dockerd = OwnDockerd(
                Path(tempfile.mkdtemp(prefix="bc-", dir="/tmp")), state_dir / "logs" / "criu"
            )
            stack.callback(dockerd.remove, state_dir / "logs" / "dockerd.log")
            dockerd.start()
            await dockerd.ready()
        if "store-full" in config.kinds:
            store = CappedStore(state_dir / "checkpointer", STORE_MB)
            stack.callback(store.unmount)
        docker = aiodocker.Docker(url=dockerd.url if dockerd is not None else None)
        stack.push_async_callback(docker.close)
        await ensure_image(docker, DEFAULT_IMAGE)
        # The oracle reads every finished request's log at the end: none may leave it before.
        base = ClusterConfig(
            state_dir=state_dir, engines=config.engines, standby_routers=1, chunk_tokens=32,
            debug_accept_stale=config.debug_accept_stale, docker_url=dockerd.url if dockerd else None,
            ended_keep_s=bus.TOKEN_LOG_MAX_AGE_S,
        )  # fmt: skip
        nats, creds_dir = await start_nats(state_dir, base)
        stack.push_async_callback(nats.stop)
        lab = Lab(nats, docker, dockerd, store)
        cluster_config = dataclasses.replace(base, nats_url=nats.url, creds_dir=creds_dir)
        phases.next("cluster start")
        async with local_cluster(cluster_config) as cluster:
            access = role_access(cluster_config, creds_dir, "admin")
            nc: NATS = await bus.connect(nats.url, "chaos", access=access)
            try:
                summary = await campaign(config, cluster, lab, Client(nc), phases)
            finally:
                await nc.close()
            pids = {child.pid: start_ticks(child.pid) for child in cluster.children.values() if child.pid > 0}
            phases.next("cluster stop")
        phases.next("leak check")
        summary.leaks += leaks(cluster, pids | summary.pids)
        containers = await docker.containers.list(all=True, filters={"label": [LABEL_SANDBOX]})
        summary.leaks += [
            f"container {c.id[:12]} ({c['Labels'][LABEL_SANDBOX]})"
            for c in containers
            if c["Labels"][LABEL_SANDBOX].startswith("chaos-")
        ]
        phases.next("lab stop")
    phases.next(None)
    summary.duration_s = time.monotonic() - started
    summary.phases = phases.took
    return summary


async def campaign(
    config: ChaosConfig, cluster: Supervisor, lab: Lab, client: Client, phases: Phases
) -> Summary:
    names = client.subjects
    await client.wait_for_engines(config.engines, 120)
    js = client.nc.jetstream()
    at_rest = await consumers(js)
    resumed: Counter[str] = Counter()

    async def on_resumed(msg) -> None:
        with contextlib.suppress(protocol.BadMessage):
            resumed[protocol.decode(protocol.decoder_for(RequestResumed), msg.data).reason] += 1

    await client.nc.subscribe(names.event("request_resumed", "*"), cb=on_resumed)
    host = hostname_id()  # the cluster's checkpointer serves this host
    generations = Generations(client, config.seed, config.max_tokens)
    trajectories = Trajectories(SandboxClient(client.nc, host, subjects=names), config.steps)
    stopping = asyncio.Event()
    producers = [asyncio.create_task(generations.produce(i, stopping)) for i in range(config.generators)]
    producers += [asyncio.create_task(trajectories.produce(i, stopping)) for i in range(config.trajectories)]
    injector = Injector(config, cluster, lab, client, names, trajectories)
    phases.next(f"{config.faults} faults")
    try:
        await injector.run()
    finally:
        phases.next("the work in flight ending")
        stopping.set()
        pending = set(producers)
        while pending:  # each bounded (SETTLE_S, TRAJECTORY_DEADLINE_S); said while it runs
            try:
                done, pending = await asyncio.wait(pending, timeout=IN_FLIGHT_REPORT_S)
            except BaseException:  # the campaign cancelled: its work goes with it
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                raise
            for task in done:
                task.result()
            if pending:
                print(
                    f"chaos: still in flight: {trajectories.in_flight()}; {generations.in_flight()}",
                    file=sys.stderr,
                )
    phases.next("the router settling")
    # Read the log once the router holds nothing running (bounded: a request that never ends is
    # the oracle's to report); the oracle itself waits for ends not yet durable.
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(SETTLE_S):
            while await injector.requests_in_flight():  # noqa: ASYNC110 - the router's state
                await asyncio.sleep(0.5)

    finished = dict(generations.tokens)
    phases.next(f"the reference of {len(finished)} generations")
    expected = await asyncio.to_thread(
        reference_tokens, [j for j in generations.jobs if j.request_id in finished]
    )
    violations = [
        f"{rid}: tokens differ from the reference at {first_difference(tokens, expected[rid])}"
        for rid, tokens in finished.items()
        if tokens != expected[rid]
    ]
    violations += trajectories.violations
    phases.next("the token log check")
    violations += await check_token_log(js, names, finished)
    phases.next("the consumer check")
    leaked: list[str] = []
    deadline = time.monotonic() + 30.0
    while len(now := await consumers(js)) > len(at_rest) and time.monotonic() < deadline:  # noqa: ASYNC110 - the server's state
        await asyncio.sleep(1.0)  # ephemeral consumers go after their inactivity threshold
    if len(now) > len(at_rest):
        leaked.append(f"JetStream consumers {sorted(now - at_rest)} beyond the {len(at_rest)} held at rest")
    incomplete = dict(generations.failed) | dict(trajectories.failed)
    for share, completed, total, what in (
        (config.min_completion, len(finished), len(generations.jobs), "generations"),
        (config.min_completion, len(trajectories.completed), len(trajectories.started), "trajectories"),
    ):
        if total and completed < share * total:
            violations.append(f"only {completed} of {total} {what} completed (at least {share:.0%} must)")
    return Summary(
        seed=config.seed,
        duration_s=0.0,
        faults=dict(Counter(f.kind for f in injector.faults)),
        hits={kind: sum(f.hits for f in injector.faults if f.kind == kind) for kind in config.kinds},
        generations=len(generations.jobs),
        generations_completed=len(finished),
        trajectories=len(trajectories.started),
        trajectories_completed=len(trajectories.completed),
        recoveries=dict(resumed) | {"sandbox-restore": trajectories.restores},
        incomplete=incomplete,
        violations=violations,
        leaks=leaked,
        pids=injector.seen_pids,
    )


def first_difference(got: list[int], want: list[int]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )
    return f"position {at} (got {len(got)} tokens, want {len(want)})"


# ---------------------------------------------------------------- the command


def add_parser(commands: argparse._SubParsersAction) -> None:
    chaos = commands.add_parser(
        "chaos", help="a seeded fault campaign against a local cluster, and its oracle"
    )
    flags.add_flags(chaos, ChaosConfig)
    chaos.set_defaults(run=cmd_chaos)


def cmd_chaos(args: argparse.Namespace) -> int:
    config = flags.from_args(ChaosConfig, args)
    summary = asyncio.run(run_campaign(config, report=lambda line: print(line, file=sys.stderr)))
    if config.json:
        print(json.dumps(msgspec.to_builtins(summary)))
    else:
        print(render(summary))
    return 0 if summary.passed else 1


def render(summary: Summary) -> str:
    lines = [
        f"chaos campaign, seed {summary.seed}: {sum(summary.faults.values())} faults in {summary.duration_s:.0f}s",
        "  faults: "
        + ", ".join(f"{k} {n} (hit {summary.hits.get(k, 0)})" for k, n in sorted(summary.faults.items())),
        f"  generations: {summary.generations_completed} of {summary.generations} completed",
        f"  trajectories: {summary.trajectories_completed} of {summary.trajectories} completed",
        "  recoveries: " + ", ".join(f"{k} {n}" for k, n in sorted(summary.recoveries.items())),
        f"  violations: {len(summary.violations)}",
        *(f"    {v}" for v in summary.violations[:20]),
        f"  leaks: {len(summary.leaks)}",
        *(f"    {v}" for v in summary.leaks[:20]),
        *(f"  incomplete {k}: {why}" for k, why in list(summary.incomplete.items())[:20]),
        "  time: " + ", ".join(f"{name} {s:.0f}s" for name, s in summary.phases.items()),
    ]
    return "\n".join(lines)
