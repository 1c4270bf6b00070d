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
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import uvloop

from belayer_rl.cli.target import resolve_target
from belayer_rl.services.rollout.agent import RolloutSettings
from belayer_rl.services.rollout.driver import Batch, BatchSummary
from belayer_rl.shared import config as flags
from belayer_rl.shared.config import hostname_id, setting


@dataclass(frozen=True, kw_only=True)
class RolloutCommand:
    """`belayer rollout`'s own settings; each trajectory's (RolloutSettings) and the batch's
    (Batch) are their classes' flags."""

    workload: Literal["shell", "math"] = setting("shell", "the workload")
    tasks: int = setting(4, "tasks of the workload")
    turns: int = setting(8, "LLM turns per shell trajectory")
    action_s: float = setting(0.3, "seconds each scripted shell action takes", flag="--action-s")
    model_agent: bool = setting(False, "act on the model's text (default: scripted agent)")
    host_id: str | None = setting(None, "the checkpointer's host (default: this host's name)")
    chaos_p: float = setting(0.0, "chaos: kill probability per step")
    chaos_step_s: float = setting(2.0, "chaos: the step wall time kills spread over", flag="--chaos-step-s")
    chaos_seed: int = setting(0, "chaos: seeds the kills")
    out: Path = setting(Path("rollout"), "folder for results and timelines")
    plot: Path | None = setting(None, "draw DIR's timelines as a PNG instead of running")
    png: Path | None = setting(None, "where --plot writes (default: DIR/timeline.png)")
    json: bool = setting(False, "print the batch summary as JSON")
    no_progress: bool = setting(False, "no progress bar", flag="--no-progress")


def add_parser(commands: argparse._SubParsersAction) -> None:
    rollout = commands.add_parser(
        "rollout", help="run agentic trajectories (LLM turns, sandbox actions, rewards)"
    )
    flags.add_flags(rollout, RolloutCommand)
    flags.add_flags(
        rollout.add_argument_group("each trajectory"), RolloutSettings, skip=("host_id", "scripted")
    )
    flags.add_flags(rollout.add_argument_group("the batch"), Batch)
    rollout.set_defaults(run=cmd_rollout)


def cmd_rollout(args: argparse.Namespace) -> int:
    command = flags.from_args(RolloutCommand, args)
    if command.plot is not None:
        from belayer_rl.services.rollout.plot import plot_timelines

        png = command.png or command.plot / "timeline.png"
        count = plot_timelines(command.plot / "timelines", png)
        print(f"{count} trajectories drawn into {png}")
        return 0
    from belayer_rl.services.rollout.workloads import workload

    host_id = command.host_id or hostname_id()
    options = {"turns": command.turns, "action_s": command.action_s} if command.workload == "shell" else {}
    try:
        settings = flags.from_args(
            RolloutSettings,
            args,
            skip=("host_id", "scripted"),
            host_id=host_id,
            scripted=not command.model_agent,
        )
        batch = flags.from_args(Batch, args, tasks=workload(command.workload, command.tasks, **options))
    except ValueError as exc:  # a policy that is no policy, a count below 1 (ConfigError among them)
        raise SystemExit(f"belayer rollout: {exc}") from None
    summary = uvloop.run(rollout(command, settings, batch, args))
    if command.json:
        print(msgspec.json.encode(summary).decode())
    else:
        print(
            f"{summary.trajectories} trajectories ({'scripted agent' if summary.scripted else 'model agent'},"
            f" policy {summary.policy}) in {summary.wall_s:.1f} s: mean reward {summary.mean_reward:.2f},"
            f" {summary.failures} failures, {summary.recoveries} recoveries ({summary.restores_from_base} from"
            f" the base image), {summary.checkpoints} checkpoints, {summary.hidden_fraction:.1%} of their"
            f" {summary.checkpoint_s:.1f} s hidden, {summary.infra_errors} infrastructure errors; see {command.out}"
        )
    return 1 if summary.infra_errors else 0


async def rollout(
    command: RolloutCommand, settings: RolloutSettings, batch: Batch, args: argparse.Namespace
) -> BatchSummary:
    from belayer_rl.services.rollout.agent import Services
    from belayer_rl.services.rollout.driver import run_batch
    from belayer_rl.services.rollout.sandbox_faults import KillSchedule, SandboxChaos
    from belayer_rl.shared.client import Client

    async with await Client.connect(resolve_target(args), "rollout") as client:
        services = Services.on(client, settings.host_id)
        chaos = None
        if command.chaos_p > 0:
            schedule = KillSchedule(command.chaos_seed, command.chaos_p, command.chaos_step_s)
            chaos = SandboxChaos(schedule, host_id=settings.host_id, nc=client.nc, subjects=client.subjects)
        try:
            summary, _ = await run_batch(
                services,
                batch,
                settings,
                chaos=chaos,
                out_dir=command.out,
                progress=not command.no_progress and sys.stderr.isatty(),
            )
        finally:
            if chaos is not None:
                await chaos.close()
    (command.out / "summary.json").write_text(json.dumps(msgspec.to_builtins(summary), indent=1))
    return summary
