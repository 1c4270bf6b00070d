"""`belayer demo`: GRPO learns an agentic task while a fault strikes every layer, and ends with the
weights of its fault-free twin.

It starts a local cluster (nats-server, the router, one tiny worker with its shadow; where Docker
with CRIU answers, the checkpointer and the policy service too) and trains the lookup task
(services/trainer/tasks.py) with 2-digit codes: the agent picks an action from a menu, reads its
output, answers, and the sandbox's check scores the answer. Chance is 1%.

Every step trains on 256 trajectories (16 codes, 16 each).

1. **The faulted steps** (the first FAULTED_STEPS): one seeded schedule, a fault of every kind
   (SCHEDULE), each struck at work in flight and reported with what it interrupted; the events
   that recovered them are printed as they come. The first IN_DOCKER trajectories
   of each of these steps run its actions in the checkpointer's Docker sandboxes, the others in local
   folders: a Docker sandbox costs about half a second a trajectory on 2 cores
   (docs/benchmarks.md), and learning takes thousands of trajectories. Without Docker and CRIU
   they all run in local folders (no checkpoints), and the sandbox and checkpointer faults are
   left out; the demo says so before it starts.
2. **The learning steps**, on to --steps: the same run resumed from its checkpoint, fault-free,
   every action in a local folder.
3. **The twin**: the faulted steps again on a fresh cluster, with no fault. The oracle
   (services/trainer/oracle.py) compares the two runs' checkpoints after those steps (weights and
   AdamW state, bitwise) and every sample they trained on.

It ends with the held-out accuracy before and after, the faults and their recoveries, the time the
faults added (the faulted steps' wall against the twin's), and whether the weights equal the
twin's; it writes reward.png and timeline.png under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import uvloop
from nats.aio.msg import Msg

from belayer_rl.cli.cluster import ClusterConfig, UpSettings, local_cluster
from belayer_rl.cli.train import TrainConfig, TrainOutcome, train
from belayer_rl.services.rollout.agent import RolloutSettings
from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
from belayer_rl.shared import protocol
from belayer_rl.shared.bus import Target
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.subjects import event_kind

FAULTED_STEPS = 3
# One fault of every kind, in the first steps. The rollout side's strike whatever their step has in
# flight; the trainer's groups are struck at their named points, and hung (SIGSTOP) at some.
SCHEDULE = (
    "worker@0:kill,sandbox@0:kill,reward@0:kill@forward,actor@0:kill@forward,actor@0:kill@state-write,"
    "router@1:kill,sandbox@1:pause,checkpointer@1:kill,actor@1:kill@backward,reference@1:kill@forward,"
    "worker@2:stop,router@2:stop,nats@2:restart,actor@2:kill@publish,actor@2:stop@forward,"
    "reference@2:stop@forward,reward@2:stop@forward"
)
DOCKER_ONLY = ("sandbox", "checkpointer")
NOT_FIRED = re.compile(r"not fired|not reached|not carried out|skipped|missed")


@dataclass(frozen=True)
class Recipe:
    """What the run trains with: 16 codes a step, 16 trajectories each, 8 optimizer passes over
    them. With fewer passes the lookup task does not learn within 11 steps on 2 cores."""

    workload: str = "lookup"
    length: int = 2
    prompts: int = 16
    group_size: int = 16
    lr: float = 3e-3
    ppo_epochs: int = 8
    kl_beta: float = 1e-3


RECIPE = Recipe()
# Where Docker answers, the first 8 trajectories of each faulted step run in the checkpointer's
# sandboxes and the others in local folders: a Docker sandbox costs about half a second a
# trajectory on 2 cores (docs/benchmarks.md), and learning takes thousands of them.
IN_DOCKER = 8
CREATE_TIMEOUT_S = 20.0  # a create is an image inspect, a container create and a start: seconds
# The recovery events shown as they come (and on the timeline); the rest are counted.
SHOWN = ("worker_failed", "handover", "router_started", "sandbox_restored", "env_failure",
         "group_failed", "group_rebuilt", "reschedule", "process")  # fmt: skip


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps", type=int, default=11, help="training steps in all (the first 3 under faults)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the data and the samples")
    parser.add_argument("--chaos-seed", type=int, default=1, help="seeds the faults' delays and targets")
    parser.add_argument(
        "--out", type=Path, default=Path("belayer-demo"), help="where the run and the plots go"
    )
    parser.add_argument(
        "--sandbox", choices=("auto", "docker", "local"), default="auto",
        help="where the faulted steps' actions run (auto: Docker where it answers with CRIU)",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.steps <= FAULTED_STEPS:
        raise SystemExit(f"belayer demo: --steps must be more than the {FAULTED_STEPS} faulted steps")
    return uvloop.run(demo(args))


def say(text: str = "") -> None:
    print(text, flush=True)


@dataclass
class Recovery:
    at: float  # time.monotonic()
    kind: str
    text: str


@dataclass
class Phase:
    """One `train` call of the demo and what the cluster reported while it ran."""

    name: str
    outcome: TrainOutcome
    recoveries: list[Recovery] = dataclasses.field(default_factory=list)
    resumed_requests: int = 0


async def demo(args: argparse.Namespace) -> int:
    zero = time.monotonic()
    why_not = await docker_with_criu() if args.sandbox == "auto" else None
    sandbox = args.sandbox if args.sandbox != "auto" else ("docker" if why_not is None else "local")
    schedule = ",".join(
        f for f in SCHEDULE.split(",") if sandbox == "docker" or f.split("@")[0] not in DOCKER_ONLY
    )
    out = args.out.absolute()
    if out.exists():
        shutil.rmtree(out / "run", ignore_errors=True)
        shutil.rmtree(out / "twin", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    in_docker = IN_DOCKER if sandbox == "docker" else 0
    say("belayer demo: GRPO learns an agentic task (read a 2-digit code hidden in a sandbox file, answer it;")
    say("chance 1%) while a fault strikes every layer, then checks the weights against a fault-free twin.")
    if sandbox == "local":
        say(f"no Docker with CRIU here ({why_not or '--sandbox local'}): actions run in local subprocesses,")
        say("in scratch folders, with no checkpoints and no sandbox or checkpointer faults.")
    else:
        say(f"in steps 1-{FAULTED_STEPS}, {in_docker} trajectories a step run in the checkpointer's Docker"
            " sandboxes (CRIU checkpoints), the others in local folders.")  # fmt: skip
    say(f"{args.steps} steps of {RECIPE.prompts * RECIPE.group_size} trajectories;"
        f" a fault of every kind strikes steps 1-{FAULTED_STEPS}.\n")  # fmt: skip
    if sandbox == "docker":
        await sandbox_image()
    with tempfile.TemporaryDirectory(prefix="belayer-demo-") as scratch:
        say("starting the cluster: nats-server, the router, a worker and its shadow"
            + (", the checkpointer and the policy service" if sandbox == "docker" else "") + " ...")  # fmt: skip
        async with cluster(Path(scratch) / "cluster", sandbox == "docker") as (trainer_target, operator):
            say(f"cluster up ({time.monotonic() - zero:.0f} s)\n")
            faulty = await phase(
                "faulted", operator,
                train(*settings(out / "run", args, FAULTED_STEPS, in_docker, schedule),
                      trainer_target, (operator, Path(scratch) / "cluster"), evaluate=(True, False),
                      say=lambda line: say(f"  {line}")),
            )  # fmt: skip
            say(
                f"\nsteps {FAULTED_STEPS + 1}-{args.steps}: the run goes on from its checkpoint, fault-free ..."
            )
            learning = await phase(
                "learning", operator,
                train(*settings(out / "run", args, args.steps, 0, ""),
                      trainer_target, evaluate=(False, True), say=lambda line: say(f"  {line}")),
            )  # fmt: skip
        say(f"\nthe twin: steps 1-{FAULTED_STEPS} again on a fresh cluster, with no fault ...")
        async with cluster(Path(scratch) / "twin-cluster", sandbox == "docker") as (trainer_target, operator):
            twin = await phase(
                "twin", operator,
                train(*settings(out / "twin", args, FAULTED_STEPS, in_docker, ""),
                      trainer_target, evaluate=(False, False), say=lambda line: say(f"  twin: {line}")),
            )  # fmt: skip
    return report(args, out, sandbox, faulty, learning, twin, time.monotonic() - zero)


@contextlib.asynccontextmanager
async def cluster(state_dir: Path, sandboxes: bool) -> AsyncIterator[tuple[Target, Target]]:
    """A local cluster for the demo: its trainer's and its operator's view of it."""
    config = ClusterConfig(
        state_dir=state_dir, engines=1, sandboxes=sandboxes,
        services=UpSettings(preset="tiny"),
    )  # fmt: skip
    async with local_cluster(config) as supervisor:
        operator = supervisor.target("admin")
        async with await Client.connect(operator, "demo") as client:
            await client.wait_for_engines(1, 120)
        yield supervisor.target("trainer"), operator


def settings(
    out: Path, args: argparse.Namespace, steps: int, in_docker: int, chaos: str
) -> tuple[TrainConfig, FaultManagerConfig, RolloutSettings]:
    config = TrainConfig(
        **dataclasses.asdict(RECIPE),
        steps=steps,
        seed=args.seed,
        sandbox="local",
        in_docker=in_docker,
        run_id=f"demo-{args.seed}",
        checkpoint_every=1,
        world=2,
        chaos=chaos,
        chaos_seed=args.chaos_seed,
        out=out,
        progress=False,
    )
    # Short timeouts, so that a hang costs seconds; bounds wide enough for a fault of every kind
    # (an actor fault close to the rollout side's is a joint failure: a reschedule).
    faults = replace(
        FaultManagerConfig(hang_timeout_s=3.0),
        actor_max_rebuild_times=8,
        max_restarts=4,
        max_reschedule_times=4,
    )
    # A create whose checkpointer was killed with it in flight is never answered: it fails sooner.
    rollout = RolloutSettings(host_id=hostname_id(), scripted=False, create_timeout_s=CREATE_TIMEOUT_S)
    return config, faults, rollout


async def phase(name: str, operator: Target, run: Coroutine[Any, Any, TrainOutcome]) -> Phase:
    """Run one `train` call while following the cluster's recovery events."""
    recoveries: list[Recovery] = []
    resumed = 0
    kinds = (*SHOWN, "request_resumed")
    decoders = {kind: protocol.decoder_for(protocol.EVENT_TYPES[kind]) for kind in kinds}
    nc = await operator.connect(f"demo-{name}-events")

    async def on_event(msg: Msg) -> None:
        nonlocal resumed
        kind = event_kind(msg.subject)
        if kind not in decoders:
            return
        try:
            event = protocol.decode(decoders[kind], msg.data)
        except protocol.BadMessage:
            return
        if kind == "request_resumed":
            resumed += 1
            return
        text = describe(event)
        if text:
            recoveries.append(Recovery(time.monotonic(), kind, text))
            say(f"  recovery: {text}")

    await nc.subscribe(operator.subjects.events_all, cb=on_event)
    await nc.flush()
    try:
        outcome = await run
    finally:
        await nc.close()
    return Phase(name, outcome, recoveries, resumed)


def describe(event: msgspec.Struct) -> str:
    """One line for a recovery event ("" for one not worth a line: a process starting)."""
    match event:
        case protocol.WorkerFailed():
            return f"the router saw engine {event.engine_id} fail ({event.reason}); its requests resume elsewhere"
        case protocol.Handover():
            what = "its main's exit" if event.reason == "exit" else f"a {event.reason}"
            return f"engine {event.engine_id}: {event.path} takeover after {what}, pid {event.old_pid} -> {event.new_pid}"
        case protocol.RouterStarted() if event.incarnation > 1:
            return (f"router incarnation {event.incarnation} took over (pid {event.router_pid}),"
                    f" {event.rebuilt_requests} requests rebuilt from the token log")  # fmt: skip
        case protocol.SandboxRestored():
            return f"sandbox of {event.trajectory} restored from its {event.source} checkpoint at action {event.k} ({event.restore_s:.2f} s)"
        case protocol.EnvFailure():
            return f"sandbox {event.sandbox}: {event.reason}"
        case protocol.GroupFailed():
            return f"trainer {event.group} rank {event.rank}: {event.kind} in step {event.step + 1} detected after {event.detected_s:.1f} s"
        case protocol.GroupRebuilt():
            return f"trainer {event.group} rebuilt in {event.total_s:.1f} s (rebuild {event.rebuild})"
        case protocol.Reschedule():
            return f"the run restarts from its step-{event.from_step} checkpoint (reschedule {event.attempt})"
        case protocol.ProcessEvent() if event.state == "exited":
            return f"{event.name} pid {event.pid} exited ({event.exit_code}); its supervisor restarts it"
    return ""


async def sandbox_image() -> None:
    """The sandboxes' image, built here where it is missing (a fresh clone's first run)."""
    import aiodocker

    from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image

    docker = aiodocker.Docker()
    try:
        await ensure_image(docker, DEFAULT_IMAGE)
    finally:
        await docker.close()


async def docker_with_criu() -> str | None:
    """None where Docker answers with its experimental features (checkpoints need them) and
    `criu` is installed; otherwise why not."""
    import aiodocker

    from belayer_rl.services.checkpointer.probe import docker_unreachable
    from belayer_rl.services.checkpointer.sandbox import EngineInfo

    unreachable = docker_unreachable()
    if unreachable is not None:
        return unreachable
    if shutil.which("criu") is None:
        return "no criu on PATH"
    async with aiodocker.Docker() as docker:
        info = msgspec.convert(await docker.system.info(), type=EngineInfo)
    if not info.experimental_build:
        return "the Docker engine runs without its experimental features (checkpoints need them)"
    return None


def report(
    args: argparse.Namespace,
    out: Path,
    sandbox: str,
    faulty: Phase,
    learning: Phase,
    twin: Phase,
    wall_s: float,
) -> int:
    from belayer_rl.services.trainer import oracle
    from belayer_rl.services.trainer.checkpoint import path_for
    from belayer_rl.services.trainer.tasks import workload

    held_out = len(workload(RECIPE.workload, RECIPE.length).held_out)
    last = FAULTED_STEPS
    differences = oracle.compare(out / "run", out / "twin", through=last)
    same_weights = oracle.same_checkpoint(path_for(out / "run" / "checkpoints", last),
                                          path_for(out / "twin" / "checkpoints", last))  # fmt: skip
    lines = [line for _, line in faulty.outcome.chaos]
    missed = [line for line in lines if NOT_FIRED.search(line)]
    added_s = faulty.outcome.ended_s[-1] - twin.outcome.ended_s[-1]
    before, after = faulty.outcome.before, learning.outcome.after
    assert before is not None and after is not None
    say("\n" + "=" * 100)
    say(f"held-out accuracy (exact codes, {held_out} codes never trained on; chance 1%):"
        f" {before:.0%} before -> {after:.0%} after {args.steps} steps")  # fmt: skip
    say(f"faults: {len(lines) - len(missed)} struck in steps 1-{last}" + (f", {len(missed)} did not" if missed else "")
        + "; each, then what recovered it:")  # fmt: skip
    start = faulty.outcome.started
    timeline = sorted([(at, f"fault     {line}") for at, line in faulty.outcome.chaos]
                      + [(r.at, f"recovery  {r.text}") for r in faulty.recoveries])  # fmt: skip
    for at, line in timeline:
        say(f"  {at - start:6.1f} s  {line}")
    say(f"  and {faulty.resumed_requests} generations resumed from the router's token log")
    say(f"training time the faults added: {added_s:.1f} s (steps 1-{last} took {faulty.outcome.ended_s[-1]:.1f} s"
        f" under faults, {twin.outcome.ended_s[-1]:.1f} s in the fault-free twin)")  # fmt: skip
    say(
        f"weights and AdamW state after step {last} equal the twin's, bitwise: {'yes' if same_weights else 'NO'}"
    )
    say(f"samples of steps 1-{last} equal the twin's (tokens, actions, observations, rewards): "
        + ("yes" if not differences else f"NO: {'; '.join(differences[:3])}"))  # fmt: skip
    plots(out, faulty, learning, twin)
    say(f"wrote {out / 'reward.png'} and {out / 'timeline.png'}; the whole demo took {wall_s:.0f} s")
    ok = same_weights and not differences and not missed
    return 0 if ok else 1


def plots(out: Path, faulty: Phase, learning: Phase, twin: Phase) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = faulty.outcome.steps + learning.outcome.steps
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(
        [s.step for s in steps], [s.reward_mean for s in steps], marker="o", label="run (faults in steps 1-3)"
    )
    ax.plot([s.step for s in twin.outcome.steps], [s.reward_mean for s in twin.outcome.steps],
            linestyle="--", marker="x", label="fault-free twin")  # fmt: skip
    ax.axvspan(0.5, FAULTED_STEPS + 0.5, color="tab:red", alpha=0.08, label="faulted steps")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    lanes = {"fault": 0, "trainer": 1, "rollout": 2, "sandbox": 3}
    start = faulty.outcome.started
    for at, line in faulty.outcome.chaos:
        if not NOT_FIRED.search(line):
            ax.scatter([at - start], [lanes["fault"]], color="tab:red", marker="x")
            what = " ".join(line.split()[:2])  # "kill worker", "stop actor", ...
            ax.annotate(what, (at - start, lanes["fault"]), xytext=(0, 8), textcoords="offset points",
                        rotation=60, fontsize=7, color="tab:red")  # fmt: skip
    for r in faulty.recoveries:
        lane = ("trainer" if r.kind in ("group_failed", "group_rebuilt", "reschedule")
                else "sandbox" if r.kind in ("sandbox_restored", "env_failure") else "rollout")  # fmt: skip
        ax.scatter([r.at - start], [lanes[lane]], color="tab:green", marker="o", s=14)
    for end in faulty.outcome.ended_s:
        ax.axvline(end, color="grey", linewidth=0.6, linestyle=":")
    ax.set_yticks(
        list(lanes.values()), ["faults", "trainer recoveries", "rollout recoveries", "sandbox recoveries"]
    )
    ax.set_xlabel("seconds into the faulted steps (dotted: a step ends)")
    ax.set_title("faults (x) and the recoveries that followed (o)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
