"""`belayer rollout`: run a batch of agentic trajectories on a running cluster, or plot one.

    belayer rollout --workload shell --tasks 4 --samples 2 [--policy adaptive] [--chaos-p 0.05]
                    [--host-id ID] [--out DIR] [--json] [--no-progress]
    belayer rollout --plot DIR [--png FILE]

The batch runs through the cluster's router, the checkpointer of --host-id and the policy service
(the `belayer up` cluster by default: every service it needs is there). Results go to
DIR/results.jsonl, each trajectory's timeline to DIR/timelines/<id>.jsonl, and `--plot DIR` draws
those timelines as a PNG: a row per trajectory, LLM turns, actions, checkpoints, failures,
recoveries and kills on one time axis. With --chaos-p the chaos injector kills sandbox containers
through the local Docker API at that probability per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec
import uvloop

from belayer_rl.cli.target import resolve_target
from belayer_rl.shared.config import hostname_id


def add_parser(commands: argparse._SubParsersAction) -> None:
    rollout = commands.add_parser(
        "rollout", help="run agentic trajectories (LLM turns, sandbox actions, rewards)"
    )
    rollout.add_argument("--workload", default="shell", choices=("shell", "math"))
    rollout.add_argument("--tasks", type=int, default=4, help="tasks of the workload")
    rollout.add_argument("--samples", type=int, default=1, help="trajectories per task")
    rollout.add_argument("--turns", type=int, default=8, help="LLM turns per shell trajectory")
    rollout.add_argument(
        "--action-s", type=float, default=0.3, help="seconds each scripted shell action takes"
    )
    rollout.add_argument("--policy", default="adaptive", help="adaptive, never, always or every-N")
    rollout.add_argument(
        "--fallback-policy", default="every-3", help="used when the policy service does not answer"
    )
    rollout.add_argument(
        "--model-agent", action="store_true", help="act on the model's text (default: scripted agent)"
    )
    rollout.add_argument("--concurrency", type=int, default=4)
    rollout.add_argument("--seed", type=int, default=0, help="trajectory seeds derive from it")
    rollout.add_argument(
        "--host-id", default=None, help="the checkpointer's host (default: this host's name)"
    )
    rollout.add_argument("--chaos-p", type=float, default=0.0, help="chaos: kill probability per step")
    rollout.add_argument(
        "--chaos-step-s", type=float, default=2.0, help="chaos: the step wall time kills spread over"
    )
    rollout.add_argument("--chaos-seed", type=int, default=0)
    rollout.add_argument("--out", type=Path, default=Path("rollout"), help="folder for results and timelines")
    rollout.add_argument(
        "--plot", type=Path, metavar="DIR", help="draw DIR's timelines as a PNG instead of running"
    )
    rollout.add_argument("--png", type=Path, help="where --plot writes (default: DIR/timeline.png)")
    rollout.add_argument("--json", action="store_true", help="print the batch summary as JSON")
    rollout.add_argument("--no-progress", action="store_true", help="no progress bar")
    rollout.set_defaults(run=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    if args.plot is not None:
        from belayer_rl.services.rollout.plot import plot_timelines

        png = args.png or args.plot / "timeline.png"
        count = plot_timelines(args.plot / "timelines", png)
        print(f"{count} trajectories drawn into {png}")
        return 0
    summary = uvloop.run(rollout(args))
    if args.json:
        print(msgspec.json.encode(summary).decode())
    else:
        print(
            f"{summary.trajectories} trajectories ({'scripted agent' if summary.scripted else 'model agent'},"
            f" policy {summary.policy}) in {summary.wall_s:.1f} s: mean reward {summary.mean_reward:.2f},"
            f" {summary.failures} failures, {summary.recoveries} recoveries ({summary.restores_from_base} from"
            f" the base image), {summary.checkpoints} checkpoints, {summary.hidden_fraction:.1%} of their"
            f" {summary.checkpoint_s:.1f} s hidden, {summary.infra_errors} infrastructure errors; see {args.out}"
        )
    return 1 if summary.infra_errors else 0


async def rollout(args: argparse.Namespace):
    from belayer_rl.services.policy.decision import Policy
    from belayer_rl.services.rollout.agent import RolloutSettings, Services
    from belayer_rl.services.rollout.driver import Batch, run_batch
    from belayer_rl.services.rollout.sandbox_faults import KillSchedule, SandboxChaos
    from belayer_rl.services.rollout.workloads import workload
    from belayer_rl.shared.client import Client

    for name in (args.policy, args.fallback_policy):
        try:
            Policy.parse(name)
        except ValueError as exc:
            raise SystemExit(f"belayer rollout: {exc}") from None
    options = {"turns": args.turns, "action_s": args.action_s} if args.workload == "shell" else {}
    tasks = workload(args.workload, args.tasks, **options)
    host_id = args.host_id or hostname_id()
    settings = RolloutSettings(
        host_id=host_id,
        policy=args.policy,
        fallback_policy=args.fallback_policy,
        scripted=not args.model_agent,
    )
    batch = Batch(tasks, samples=args.samples, seed=args.seed, concurrency=args.concurrency)
    async with await Client.connect(resolve_target(args), "rollout") as client:
        services = Services.on(client, host_id)
        chaos = None
        if args.chaos_p > 0:
            schedule = KillSchedule(args.chaos_seed, args.chaos_p, args.chaos_step_s)
            chaos = SandboxChaos(schedule, host_id=host_id, nc=client.nc, subjects=client.subjects)
        try:
            summary, _ = await run_batch(
                services,
                batch,
                settings,
                chaos=chaos,
                out_dir=args.out,
                progress=not args.no_progress and sys.stderr.isatty(),
            )
        finally:
            if chaos is not None:
                await chaos.close()
    (args.out / "summary.json").write_text(json.dumps(msgspec.to_builtins(summary), indent=1))
    return summary
