"""`belayer train`: GRPO on a running cluster, with a line per step and a reward curve.

    belayer train --workload reverse --steps 100 [--prompts 16 --group-size 8 --lr 3e-3]
                  [--off-policy] [--kl-beta B] [--seed S] [--checkpoint-every N] [--out DIR]

Samples are generated through the cluster's router (the `belayer up` cluster by default) and every
step's weights are published to its weight server over the bus, under the trainer's credential.
Writes DIR/steps.jsonl (one TrainerStep per line; a step replayed after a reschedule is written
again), DIR/reward.png and DIR/summary.json; with --checkpoint-every, DIR/checkpoints, from which
a rerun with the same flags resumes. The actor runs as --world ranks under the fault manager
(--backend local: processes; ray: Ray actors), the reward as a group of its own, and so does the
reference with --kl-beta; --chaos injects a seeded schedule of faults (services/trainer/group_faults.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from belayer_rl.cli.target import resolve_target

if TYPE_CHECKING:
    from belayer_rl.shared.metrics import TrainerMetrics
    from belayer_rl.shared.protocol import TrainerStep


def add_parser(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="GRPO training on the cluster's rollouts")
    train.add_argument("--workload", default="reverse", choices=("reverse",))
    train.add_argument("--length", type=int, default=2, help="digits in each reverse prompt")
    train.add_argument("--steps", type=int, default=100)
    train.add_argument("--prompts", type=int, default=16, help="prompts per step")
    train.add_argument("--group-size", type=int, default=16, help="samples per prompt (G)")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--ppo-epochs", type=int, default=2, help="optimizer passes over each batch")
    train.add_argument(
        "--kl-beta", type=float, default=0.0, help="weight of the k3 KL to the reference (the initial policy)"
    )
    train.add_argument("--off-policy", action="store_true", help="generate step n+1 while training step n")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--run-id", default=None, help="run id (default train-<seed>)")
    train.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)")
    train.add_argument(
        "--backend",
        default="local",
        choices=("local", "ray", "inline"),
        help="local: the actor as a group of processes under the fault manager; ray: as Ray actors;"
        " inline: in this process",
    )
    train.add_argument(
        "--ray-address", default=None, help="the Ray cluster to join (default: start a local one, 2 CPUs)"
    )
    train.add_argument("--world", type=int, default=2, help="data-parallel actor ranks (local and ray)")
    faults = train.add_argument_group("fault manager (local and ray backends)")
    faults.add_argument(
        "--no-retry", action="store_true", help="enable_retry off: a fault reschedules at once"
    )
    faults.add_argument("--max-task-retries", type=int, default=1)
    faults.add_argument("--actor-max-rebuild-times", type=int, default=2)
    faults.add_argument("--max-restarts", type=int, default=1, help="restarts in place of the reward worker")
    faults.add_argument(
        "--rollout-max-rebuild-times",
        type=int,
        default=1,
        help="restarts of the rollout engines through the shadow supervisors' cold path",
    )
    faults.add_argument("--max-reschedule-times", type=int, default=1)
    faults.add_argument("--call-timeout", type=float, default=120.0, help="seconds one group call may take")
    faults.add_argument(
        "--cold-start",
        action="store_true",
        help="local backend: start every rank as a new Python process, not forked from the warm fork server",
    )
    faults.add_argument(
        "--hang-timeout", type=float, default=30.0, help="seconds without progress that make a worker hung"
    )
    faults.add_argument(
        "--rollout-timeout",
        type=float,
        default=60.0,
        help="seconds without a generation finished that make the rollout side hung",
    )
    train.add_argument(
        "--chaos",
        default="",
        metavar="SPEC",
        help="faults to inject: GROUP@STEP:ACTION[@POINT],... (actor|reference|reward, kill|stop;"
        " points forward, backward, publish, state-write), e.g. actor@3:kill,actor@5:kill@backward",
    )
    train.add_argument("--chaos-seed", type=int, default=0, help="seeds the faults' delays and ranks")
    train.add_argument(
        "--metrics-port", type=int, default=-1, help="serve Prometheus metrics here (0: a free port; -1: off)"
    )
    train.add_argument("--metrics-host", default="127.0.0.1")
    train.add_argument("--out", type=Path, default=Path("train"))
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from belayer_rl.services.trainer import group_faults as chaos

    try:
        chaos.schedule(args.chaos, args.chaos_seed)
    except ValueError as exc:
        raise SystemExit(f"belayer train: {exc}") from None
    if args.chaos and args.backend == "inline":
        raise SystemExit("belayer train: --chaos needs worker groups to aim at (--backend local or ray)")
    return uvloop.run(train(args))


async def train(args: argparse.Namespace) -> int:
    import torch

    from belayer_rl.services.trainer import group_faults as chaos
    from belayer_rl.services.trainer.actor import ActorSettings
    from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
    from belayer_rl.services.trainer.grpo import GrpoConfig
    from belayer_rl.services.trainer.plot import plot_rewards
    from belayer_rl.services.trainer.tasks import workload
    from belayer_rl.services.trainer.trainer import GroupBackend, StepResult, Trainer, TrainSettings
    from belayer_rl.shared.client import Client
    from belayer_rl.shared.config import TrainerGroupConfig
    from belayer_rl.shared.protocol import encode

    torch.set_num_threads(1)  # repeatable updates; the engine has the other cores
    planned = chaos.schedule(args.chaos, args.chaos_seed)
    task = workload(args.workload, length=args.length)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = TrainSettings(
        run=args.run_id or f"train-{args.seed}",
        steps=args.steps,
        prompts_per_step=args.prompts,
        group_size=args.group_size,
        seed=args.seed,
        off_policy=args.off_policy,
        checkpoint_every=args.checkpoint_every,
        checkpoint_dir=args.out / "checkpoints" if args.checkpoint_every else None,
        actor=ActorSettings(lr=args.lr, ppo_epochs=args.ppo_epochs),
        grpo=GrpoConfig(kl_beta=args.kl_beta),
    )
    steps: list[TrainerStep] = []
    progress = Bar(args.steps, enabled=not args.no_progress and sys.stderr.isatty())
    target = resolve_target(args, role="trainer")
    async with (
        serving_metrics(args.metrics_host, args.metrics_port) as metrics,
        await Client.connect(target, "trainer") as client,
    ):
        group = None
        if args.backend != "inline":
            faults = FaultManagerConfig(
                enable_retry=not args.no_retry,
                max_task_retries=args.max_task_retries,
                max_restarts=args.max_restarts,
                actor_max_rebuild_times=args.actor_max_rebuild_times,
                rollout_max_rebuild_times=args.rollout_max_rebuild_times,
                max_reschedule_times=args.max_reschedule_times,
                call_timeout_s=args.call_timeout,
                hang_timeout_s=args.hang_timeout,
                rollout_timeout_s=args.rollout_timeout,
                warm_start=not args.cold_start,
            )
            worker = TrainerGroupConfig(
                nats_url=target.url,
                cluster_id=target.subjects.cluster_id,
                nats_creds=target.access.creds,
                nats_ca=target.access.ca,
                nats_cert=target.access.cert,
                nats_key=target.access.key,
                metrics_port=-1,
                run=settings.run,
                world=args.world,
                rendezvous=args.out / "actor" / "rendezvous",
                seed=args.seed,
                lr=args.lr,
                ppo_epochs=args.ppo_epochs,
                kl_beta=args.kl_beta,
                workload=args.workload,
                length=args.length,
                allowed=",".join(map(str, task.allowed_tokens)),
                fault_points=chaos.armed(planned, args.world),
            )
            if args.backend == "ray":
                import ray

                # ray.init annotates these narrower than it takes (a level's name, fractional CPUs).
                options: dict[str, Any]
                if args.ray_address:
                    options = {"address": args.ray_address, "logging_level": "WARNING"}
                else:  # capped, so that it fits beside the cluster on a laptop
                    from belayer_rl.services.trainer.ray_groups import cpus_for

                    cpus = max(2.0, cpus_for(args.world, with_reference=args.kl_beta > 0))
                    options = {
                        "num_cpus": cpus,
                        "object_store_memory": 200_000_000,
                        "include_dashboard": False,
                    }
                ray.init(**options)
            group = GroupBackend.create(args.backend, client, worker, args.out / "actor", faults, metrics)
        trainer = Trainer(client, task, settings, group, metrics)
        for skipped in await trainer.resume():
            print(f"skipped a damaged checkpoint: {skipped}", file=sys.stderr)
        if not trainer.version:
            await trainer.publish()
        before = await trainer.accuracy(task.held_out)
        progress.advance(trainer.step)
        log = (args.out / "steps.jsonl").open("ab")

        def on_step(result: StepResult) -> None:
            e = result.event
            steps.append(e)
            log.write(encode(e) + b"\n")
            log.flush()
            print(
                f"step {e.step:4d}  reward {e.reward_mean:.3f}  loss {e.loss:+.4f}  kl {e.kl:.4f}"
                f"  clipped {e.clipped_fraction:.1%}  {e.tokens_per_s:7.0f} tok/s  recoveries {e.resumes}"
                f"  ({e.rollout_s:.2f} s rollout, {e.update_s:.2f} s update)",
                flush=True,
            )
            progress.advance(1)

        for fault in planned:
            print(f"chaos (seed {args.chaos_seed}): {fault}", flush=True)
        timed = [f for f in planned if not f.point]
        injected: list[str] = []
        injector = asyncio.create_task(chaos.inject(trainer, timed, injected)) if timed else None
        try:
            await trainer.run(on_step)
        finally:
            log.close()
            progress.close()
            if injector is not None:
                injector.cancel()
                await asyncio.gather(injector, return_exceptions=True)
        for line in injected:
            print(f"chaos: {line}", flush=True)
        for fault in timed[len(injected) :]:
            print(f"chaos: not carried out (the run ended first): {fault}", flush=True)
        for fault in (f for f in planned if f.point):
            done = chaos.fired(fault, args.out / "actor", args.world)
            print(f"chaos: {fault}: {'fired' if done else 'not reached'}", flush=True)
        after = await trainer.accuracy(task.held_out)
    if steps:
        plot_rewards(steps, args.out / "reward.png", f"{task.name}, seed {args.seed}")
    summary = {
        "run": settings.run,
        "workload": task.name,
        "steps": trainer.step,
        "weight_version": trainer.version,
        "held_out_accuracy_before": before,
        "held_out_accuracy_after": after,
        "chance": task.chance,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{task.name}: held-out exact match {before:.0%} -> {after:.0%} (chance {task.chance:.0%}) after"
        f" {trainer.step} steps; weights {trainer.version}; see {args.out}"
    )
    return 0


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
