"""`belayer train`: GRPO on a running cluster, with a line per step and a reward curve.

    belayer train --workload reverse --steps 100 [--prompts 16 --group-size 8 --lr 3e-3]
                  [--off-policy] [--kl-beta B] [--seed S] [--checkpoint-every N] [--out DIR]
    belayer train --workload lookup --steps 40 [--sandbox docker|local] [--policy adaptive]

Samples are generated through the cluster's router (the `belayer up` cluster by default) and every
step's weights are published to its weight server over the bus, under the trainer's credential.
Writes DIR/steps.jsonl (one TrainerStep per line; a step replayed after a reschedule is written
again), DIR/reward.png and DIR/summary.json; with --checkpoint-every, DIR/checkpoints, from which
a rerun with the same flags resumes (--steps may grow; a checkpoint of other settings, another
seed or run id, is refused rather than mixed into this run). An agentic workload (`lookup`) samples whole trajectories:
turns through the router, actions in sandboxes of the checkpointer of --host-id with the policy
service deciding checkpoints (--sandbox local: scratch folders, no checkpoints). The actor runs as --world ranks under the fault manager
(--backend local: processes; ray: Ray actors), the reward as a group of its own, and so does the
reference with --kl-beta; --chaos injects a seeded schedule of faults (services/trainer/group_faults.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import uvloop

from belayer_rl.cli.target import resolve_target
from belayer_rl.services.rollout.agent import RolloutSettings
from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
from belayer_rl.shared import config as flags
from belayer_rl.shared.bus import Target
from belayer_rl.shared.config import TrainerGroupConfig, hostname_id, same_as, setting

if TYPE_CHECKING:
    from belayer_rl.cli.chaos.training import RolloutChaos
    from belayer_rl.services.trainer.group_faults import Fault, Running
    from belayer_rl.shared.metrics import TrainerMetrics
    from belayer_rl.shared.protocol import TrainerStep


@dataclass(frozen=True)
class TrainConfig:
    """`belayer train`'s settings. What the groups share with the trainer repeats their config's
    field (`same_as`), so each default is written once; the fault manager's come from its own."""

    workload: Literal["reverse", "lookup", "lookup-control"] = setting(
        "reverse",
        "the task (lookup: agentic, in sandboxes; lookup-control: lookup with every observation a constant)",
    )
    length: int | None = setting(None, "digits per item (default: reverse 2, lookup 3)")
    steps: int = setting(100, "training steps")
    prompts: int = setting(16, "prompts per step")
    group_size: int = setting(16, "samples per prompt (G)")
    lr: float = same_as(TrainerGroupConfig, "lr")
    ppo_epochs: int = same_as(TrainerGroupConfig, "ppo_epochs")
    kl_beta: float = same_as(TrainerGroupConfig, "kl_beta")
    off_policy: bool = setting(False, "generate step n+1 while training step n")
    seed: int = setting(0, "seeds the initial weights, the data order and the sampling")
    concurrency: int = setting(64, "samples generated at once (whole trajectories, in an agentic workload)")
    sandbox: Literal["docker", "local"] = setting(
        "docker",
        "agentic workloads: docker: the checkpointer's sandboxes; local: scratch folders (no Docker, no checkpoints)",
    )
    in_docker: int = setting(
        0,
        "agentic workloads with --sandbox local: this many of each step's trajectories run in the"
        " checkpointer's Docker sandboxes all the same",
    )
    host_id: str | None = setting(
        None, "agentic workloads: the checkpointer's host (default: this host's name)"
    )
    run_id: str | None = setting(None, "run id (default train-<seed>)")
    checkpoint_every: int = setting(0, "steps between checkpoints (0: none)")
    backend: Literal["local", "ray", "inline"] = setting(
        "local",
        "local: the actor as a group of processes under the fault manager; ray: as Ray actors;"
        " inline: in this process",
    )
    ray_address: str | None = setting(None, "the Ray cluster to join (default: start a local one, 2 CPUs)")
    world: int = setting(2, "data-parallel actor ranks (local and ray)")
    cold_start: bool = setting(
        False, "local backend: start every rank as a new Python process, not forked from the warm fork server"
    )
    chaos: str = setting(
        "",
        "faults to inject: GROUP@STEP:ACTION[@POINT],... (actor|reference|reward, kill|stop;"
        " points forward, backward, publish, state-write; the local cluster's worker|router kill|stop,"
        " sandbox kill|pause, checkpointer kill, nats restart), e.g. actor@3:kill,worker@2:stop",
    )
    chaos_seed: int = setting(0, "seeds the faults' delays and ranks")
    metrics_port: int = setting(-1, "serve Prometheus metrics here (0: a free port; -1: off)")
    metrics_host: str = setting("127.0.0.1", "where the metrics are served")
    out: Path = setting(Path("train"), "the run's folder: steps, reward curve, summary, checkpoints")
    progress: bool = setting(True, "the progress bar", flag="--progress")
    held_out: bool = setting(
        True,
        "measure the held-out accuracy before and after (an agentic workload runs 200 trajectories each)",
        flag="--held-out",
    )


# The trajectories' settings that are not flags here: the host is --host-id, a lookup task's agent is
# the model, and the trainer samples at its own temperature.
ROLLOUT_SET_HERE = ("host_id", "scripted", "temperature")


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="GRPO training on the cluster's rollouts")
    flags.add_flags(train, TrainConfig)
    flags.add_flags(train.add_argument_group("fault manager (local and ray backends)"), FaultManagerConfig)
    trajectories = train.add_argument_group("each trajectory (agentic workloads)")
    flags.add_flags(trajectories, RolloutSettings, skip=ROLLOUT_SET_HERE)
    train.set_defaults(run=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from belayer_rl.services.trainer import group_faults as chaos

    config = flags.from_args(TrainConfig, args)
    try:
        faults = flags.from_args(FaultManagerConfig, args, warm_start=not config.cold_start)
        rollout = flags.from_args(
            RolloutSettings,
            args,
            skip=ROLLOUT_SET_HERE,
            host_id=config.host_id or hostname_id(),
            scripted=False,
        )
        if config.in_docker and config.sandbox != "local":
            raise ValueError("--in-docker goes with --sandbox local (with docker, every trajectory is)")
        planned = chaos.schedule(config.chaos, config.chaos_seed)
        if config.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        chaos_target = rollout_chaos_target(args, config, planned)
    except ValueError as exc:
        raise SystemExit(f"belayer train: {exc}") from None
    from belayer_rl.services.trainer.fault_manager import FaultBoundExceeded, GroupFault, RescheduleNeeded
    from belayer_rl.services.trainer.trainer import AnotherRun, TrajectoryFailed

    # Absolute from here on: the ranks (Ray's among them) do not share this process's folder.
    config = replace(config, out=config.out.absolute())
    try:
        uvloop.run(train(config, faults, rollout, resolve_target(args, role="trainer"), chaos_target))
        return 0
    except AnotherRun as exc:
        raise SystemExit(f"belayer train: --out {config.out}: {exc}") from None
    except (GroupFault, RescheduleNeeded, FaultBoundExceeded) as exc:
        where = f" (the ranks' logs: {config.out / 'actor' / 'logs'})" if config.backend == "local" else ""
        raise SystemExit(f"belayer train: {exc}{where}") from None
    except ExceptionGroup as errors:  # from a step's or an evaluation's trajectories
        failed, other = errors.split(TrajectoryFailed)
        if failed is None or other is not None:
            raise
        count = len(failed.exceptions)
        raise SystemExit(
            f"belayer train: {count} trajectories failed; the first: {failed.exceptions[0]}"
        ) from None


def rollout_chaos_target(
    args: argparse.Namespace, config: TrainConfig, planned: list[Fault]
) -> tuple[Target, Path] | None:
    """What the schedule's rollout-side faults strike: the local cluster `belayer up` started, as
    an operator sees it, and its state folder (None when the schedule has none). ValueError says
    why the schedule cannot be carried out here."""
    from belayer_rl.cli.up import read_cluster
    from belayer_rl.services.trainer.tasks import Lookup, workload

    if config.backend == "inline" and any(not f.rollout for f in planned):
        raise ValueError("--chaos: the trainer's groups need --backend local or ray")
    if not any(f.rollout for f in planned):
        return None
    state_dir = args.state_dir.resolve()
    local = read_cluster(state_dir)
    if local is None:
        raise ValueError(
            f"--chaos: the rollout side's faults strike the local cluster `belayer up` started;"
            f" none is recorded in {state_dir} (--state-dir)"
        )
    if any(f.group == "nats" for f in planned) and "nats-server" not in {p.name for p in local.processes}:
        raise ValueError(
            f"--chaos nats: the cluster in {state_dir} did not start its nats-server (it was given"
            " --nats), so nothing would start it again"
        )
    if any(f.group in ("sandbox", "checkpointer") for f in planned) and (
        not isinstance(workload(config.workload), Lookup) or not uses_docker(config)
    ):
        raise ValueError(
            "--chaos sandbox and checkpointer: they need Docker sandboxes (--workload lookup with"
            " --sandbox docker, or --in-docker N)"
        )
    return resolve_target(args, role="admin"), state_dir


@dataclass
class TrainOutcome:
    """What a `train` call did, for a caller that goes on from it (`belayer demo`)."""

    steps: list[TrainerStep]  # each step this call trained, as its trainer_step event
    started: float  # time.monotonic() as the first step started
    ended_s: list[float]  # seconds from then to each of those steps' end
    before: float | None  # held-out accuracy (None: not measured)
    after: float | None
    chaos: list[tuple[float, str]]  # what each fault did, and when (time.monotonic())
    step: int  # the trainer's step count at the end (a resumed run's includes the earlier steps)


def uses_docker(config: TrainConfig) -> bool:
    """Whether some of the run's trajectories run in the checkpointer's Docker sandboxes."""
    return config.sandbox == "docker" or config.in_docker > 0


async def train(
    config: TrainConfig,
    faults: FaultManagerConfig,
    rollout: RolloutSettings,
    target: Target,
    chaos_target: tuple[Target, Path] | None = None,
    evaluate: tuple[bool, bool] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> TrainOutcome:
    """`chaos_target`: the local cluster, as an operator sees it, and its state folder (what the
    rollout side's faults strike). `evaluate`: whether to measure the held-out accuracy before and
    after (default: both with config.held_out). Every line of progress goes to `say`."""
    import torch

    from belayer_rl.services.rollout.local_sandbox import LocalSandboxes
    from belayer_rl.services.trainer import group_faults as chaos
    from belayer_rl.services.trainer.actor import ActorSettings
    from belayer_rl.services.trainer.grpo import GrpoConfig
    from belayer_rl.services.trainer.oracle import RECORD
    from belayer_rl.services.trainer.plot import plot_rewards
    from belayer_rl.services.trainer.tasks import Lookup, workload
    from belayer_rl.services.trainer.trainer import GroupBackend, StepResult, Trainer, TrainSettings
    from belayer_rl.shared.client import Client
    from belayer_rl.shared.protocol import encode

    torch.set_num_threads(1)  # repeatable updates; the engine has the other cores
    planned = chaos.schedule(config.chaos, config.chaos_seed)
    task = workload(config.workload, length=config.length)
    agentic = isinstance(task, Lookup)
    config.out.mkdir(parents=True, exist_ok=True)
    settings = TrainSettings(
        run=config.run_id or f"train-{config.seed}",
        steps=config.steps,
        prompts_per_step=config.prompts,
        group_size=config.group_size,
        seed=config.seed,
        off_policy=config.off_policy,
        concurrency=config.concurrency,
        rollout=rollout if agentic else None,
        in_docker=config.in_docker,
        checkpoint_every=config.checkpoint_every,
        checkpoint_dir=config.out / "checkpoints" if config.checkpoint_every else None,
        actor=ActorSettings(lr=config.lr, ppo_epochs=config.ppo_epochs),
        grpo=GrpoConfig(kl_beta=config.kl_beta),
        record=config.out / RECORD,
    )
    steps: list[TrainerStep] = []
    progress = Bar(config.steps, enabled=config.progress and sys.stderr.isatty())
    async with (
        serving_metrics(config.metrics_host, config.metrics_port) as metrics,
        await Client.connect(target, "trainer") as client,
    ):
        group = None
        if config.backend != "inline":
            worker = TrainerGroupConfig(
                nats_url=target.url,
                cluster_id=target.subjects.cluster_id,
                nats_creds=target.access.creds,
                nats_ca=target.access.ca,
                nats_cert=target.access.cert,
                nats_key=target.access.key,
                metrics_port=-1,
                run=settings.run,
                world=config.world,
                rendezvous=config.out / "actor" / "rendezvous",
                seed=config.seed,
                lr=config.lr,
                ppo_epochs=config.ppo_epochs,
                kl_beta=config.kl_beta,
                workload=config.workload,
                length=task.length,
                allowed=TrainerGroupConfig.allowed_of(task.allowed_sets),
                fault_points=chaos.armed(planned, config.world),
            )
            if config.backend == "ray":
                import ray

                # ray.init annotates these narrower than it takes (a level's name, fractional CPUs).
                options: dict[str, Any]
                if config.ray_address:
                    options = {"address": config.ray_address, "logging_level": "WARNING"}
                else:  # capped, so that it fits beside the cluster on a laptop
                    from belayer_rl.services.trainer.ray_groups import cpus_for

                    cpus = max(2.0, cpus_for(config.world, with_reference=config.kl_beta > 0))
                    options = {
                        "num_cpus": cpus,
                        "object_store_memory": 200_000_000,
                        "include_dashboard": False,
                    }
                try:
                    ray.init(**options)
                except ConnectionError as exc:  # Ray's error runs to a page; its first line says it
                    raise SystemExit(
                        f"belayer train: no Ray cluster joined at {config.ray_address or 'a local Ray'}: {str(exc).splitlines()[0]}"
                        " (a cluster `ray start` made where ~/.ray/auth_token exists wants its token:"
                        " RAY_AUTH_MODE=token)"
                    ) from None
            group = GroupBackend.create(config.backend, client, worker, config.out / "actor", faults, metrics)
        sandboxes = None
        if agentic and config.sandbox == "local":
            sandboxes = LocalSandboxes(config.out / "sandboxes")
            docker = f", but {config.in_docker} a step in Docker sandboxes" if config.in_docker else ""
            say(f"actions run in local folders under {sandboxes.root} (no checkpoints){docker}")
        trainer = Trainer(client, task, settings, group, metrics, sandboxes)
        for skipped in await trainer.resume():
            print(f"skipped a damaged checkpoint: {skipped}", file=sys.stderr)
        if not trainer.version:
            await trainer.publish()
        before_wanted, after_wanted = evaluate or (config.held_out, config.held_out)
        before = await trainer.accuracy(task.held_out) if before_wanted else None
        progress.advance(trainer.step)
        started = time.monotonic()
        ended_s: list[float] = []
        log = (config.out / "steps.jsonl").open("ab")

        def on_step(result: StepResult) -> None:
            e = result.event
            steps.append(e)
            ended_s.append(time.monotonic() - started)
            log.write(encode(e) + b"\n")
            log.flush()
            say(
                f"step {e.step:4d}  reward {e.reward_mean:.3f}  loss {e.loss:+.4f}  kl {e.kl:.4f}"
                f"  clipped {e.clipped_fraction:.1%}  {e.tokens_per_s:7.0f} tok/s  {e.resumes} resumed"
                f"  ({e.rollout_s:.2f} s rollout, {e.update_s:.2f} s update)"
            )
            progress.advance(1)

        for fault in planned:
            say(f"chaos (seed {config.chaos_seed}): {fault}")
        done: list[tuple[float, str]] = []

        def report(line: str, at: float | None = None) -> None:
            done.append((time.monotonic() if at is None else at, line))
            say(f"chaos: {line}")

        timed = [f for f in planned if not f.point and not f.rollout]
        injected: list[str] = []

        def report_timed(line: str) -> None:
            injected.append(line)
            report(line)

        injectors = [asyncio.create_task(chaos.inject(trainer, timed, report_timed))] if timed else []
        struck = [f for f in planned if f.rollout]
        async with contextlib.AsyncExitStack() as stack:
            rollout_chaos = None
            if struck:
                assert chaos_target is not None  # cmd_train found the local cluster
                rollout_chaos = await rollout_side_chaos(stack, trainer, settings.run, config, *chaos_target)
                rollout_chaos.report = report
                injectors.append(asyncio.create_task(rollout_chaos.inject(struck)))
            try:
                await trainer.run(on_step)
            finally:
                log.close()
                progress.close()
                for injector in injectors:
                    injector.cancel()
                await asyncio.gather(*injectors, return_exceptions=True)
        for fault in timed[len(injected) :] + struck[len(rollout_chaos.log) if rollout_chaos else 0 :]:
            report(f"not carried out (the run ended first): {fault}")
        for fault in (f for f in planned if f.point):
            mark = chaos.fired(fault, config.out / "actor", config.world)
            # When it fired: its mark's time, on this clock.
            at = None if mark is None else time.monotonic() - (time.time() - mark.stat().st_mtime)
            report(f"{fault}: {'fired' if mark else 'not reached'}", at)
        after = await trainer.accuracy(task.held_out) if after_wanted else None
        if sandboxes is not None:  # the folders of the trajectories that ended (a failed run keeps them)
            await sandboxes.close()
    if steps:
        plot_rewards(steps, config.out / "reward.png", f"{task.name}, seed {config.seed}")
    summary = {
        "run": settings.run,
        "workload": task.name,
        "steps": trainer.step,
        "weight_version": trainer.version,
        "held_out_accuracy_before": before,
        "held_out_accuracy_after": after,
        "chance": task.chance,
    }
    (config.out / "summary.json").write_text(json.dumps(summary, indent=1))
    accuracy = (
        f"held-out exact match {before:.1%} -> {after:.1%} (chance {task.chance:.1%})"
        if before is not None and after is not None
        else "held-out accuracy not measured"
    )
    say(f"{task.name}: {accuracy} after {trainer.step} steps; weights {trainer.version}; see {config.out}")
    return TrainOutcome(steps, started, ended_s, before, after, sorted(done), trainer.step)


async def rollout_side_chaos(
    stack: contextlib.AsyncExitStack,
    trainer: Running,
    run: str,
    config: TrainConfig,
    operator: Target,
    state_dir: Path,
) -> RolloutChaos:
    """The rollout side's faults of the schedule, against the local cluster in `state_dir`."""
    import aiodocker

    from belayer_rl.cli.chaos.training import LocalCluster, RolloutChaos
    from belayer_rl.shared.client import Client

    client = await stack.enter_async_context(await Client.connect(operator, "trainer-chaos"))
    docker = None
    if uses_docker(config):
        docker = aiodocker.Docker()
        stack.push_async_callback(docker.close)
    return RolloutChaos(trainer, run, LocalCluster(client, docker, state_dir), config.chaos_seed)


@contextlib.asynccontextmanager
async def serving_metrics(host: str, port: int) -> AsyncIterator[TrainerMetrics]:
    """The trainer's metrics, served on `host`:`port` while the run lasts (port -1: off)."""
    from belayer_rl.shared.metrics import Metrics, MetricsServer, TrainerMetrics, url

    registry = Metrics(enabled=port >= 0)
    server = None
    if registry.registry is not None:
        server = MetricsServer(registry.registry, lambda: (True, "training"))
        bound = await server.start(host, port)
        print(f"metrics at {url(host, bound)}", flush=True)
    try:
        yield TrainerMetrics(registry)
    finally:
        if server is not None:
            await server.close()


class Bar:
    """Steps done (rich, on stderr: stdout keeps the per-step lines)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled = enabled
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self.bar = Progress(
                BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True)
            )
            self.task = self.bar.add_task("train", total=total)
            self.bar.start()

    def advance(self, n: int) -> None:
        if self.enabled:
            self.bar.update(self.task, advance=n)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
