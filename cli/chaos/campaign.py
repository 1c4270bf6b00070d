"""A chaos campaign run: its cluster and lab started, the work and the faults run together, the
oracle's verdict summed up; and the `belayer chaos` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker
import msgspec
from nats.aio.client import Client as NATS

from belayer_rl.cli.chaos.config import ChaosConfig
from belayer_rl.cli.chaos.injector import Injector
from belayer_rl.cli.chaos.lab import STORE_MB, CappedStore, Lab, Nats, OwnDockerd
from belayer_rl.cli.chaos.oracle import (
    check_token_log,
    consumers,
    first_difference,
    leaks,
    start_ticks,
)
from belayer_rl.cli.chaos.workload import (
    SETTLE_S,
    Generations,
    Job,
    Output,
    Trajectories,
    reference_outputs,
)
from belayer_rl.cli.cluster import (
    ClusterConfig,
    Supervisor,
    UpSettings,
    local_cluster,
    role_access,
    write_credentials,
)
from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.services.checkpointer.sandbox import LABEL_SANDBOX
from belayer_rl.shared import bus, protocol
from belayer_rl.shared import config as flags
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.processes import free_port, start_nats_server
from belayer_rl.shared.protocol import (
    RequestResumed,
)

IN_FLIGHT_REPORT_S = 30.0  # while that work ends, what still runs is printed this often


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
            state_dir=state_dir, engines=config.engines, standby_routers=1,
            services=UpSettings(
                chunk_tokens=32, debug_accept_stale=config.debug_accept_stale,
                docker_url=dockerd.url if dockerd else None, ended_keep_s=bus.TOKEN_LOG_MAX_AGE_S,
                kind=config.engine, model_path=config.model_path, engine_python=config.engine_python,
            ),
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


# How far a logprob may differ from the reference. The built-in engine is batch-invariant: bitwise.
# vLLM's prefill of a resumed prefix gives its decode's logits up to float32 rounding (1e-6 seen
# in `belayer bench vllm-resume`, where 400 resumes out of 400 drew the same tokens).
LOGPROB_TOLERANCE = {"builtin": 0.0, "vllm": 1e-4}
TWIN_CONCURRENCY = 8


def same(got: list[int] | list[float], want: list[int] | list[float], tolerance: float) -> bool:
    if tolerance == 0.0 or len(got) != len(want):
        return got == want
    return all(abs(a - b) <= tolerance for a, b in zip(got, want, strict=True))


async def twin_outputs(client: Client, jobs: list[Job]) -> dict[str, Output]:
    """The reference where no engine runs in this process (vLLM): each job again on the cluster,
    after the faults, with nothing failing: its uninterrupted twin."""
    slots = asyncio.Semaphore(TWIN_CONCURRENCY)

    async def twin(job: Job) -> tuple[str, Output]:
        async with slots:
            again = await client.generate_all(
                job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=job.temperature
            )
        return job.request_id, Output(again.tokens, again.logprobs)

    return dict(await asyncio.gather(*(twin(job) for job in jobs)))


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

    finished = dict(generations.outputs)
    phases.next(f"the reference of {len(finished)} generations")
    jobs = [j for j in generations.jobs if j.request_id in finished]
    if config.engine == "builtin":
        expected = await asyncio.to_thread(reference_outputs, jobs)
    else:
        expected = await twin_outputs(client, jobs)
    violations = [
        f"{rid}: {what} differ from the reference at {first_difference(got, want)}"
        for rid, output in finished.items()
        for what, got, want in (
            ("tokens", output.tokens, expected[rid].tokens),
            ("logprobs", output.logprobs, expected[rid].logprobs),
        )
        if not same(got, want, LOGPROB_TOLERANCE[config.engine] if what == "logprobs" else 0.0)
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
