"""`belayer bench train-recovery`: what one trainer-group failure costs, against a failure-free run
and against rescheduling the whole workflow, all in one run of the bench.

    belayer bench train-recovery [--workload reverse|lookup] [--minutes 10] [--faults 5]
        [--kinds actor,reference,reward,hang,rollout] [--plot rewards.png] [--json]

Every run starts a local cluster of its own (router, weight and KV servers, shadow supervisor, one
tiny worker) and stops it after. A failure-free GRPO run (actor of 2 gloo ranks, a reference for
the KL term, a reward group) trains for --minutes, and its steps set the length of every other run.
The workload is `reverse` (one turn, no tool) or `lookup` (agentic trajectories, their actions in
local folders, trained with the demo's recipe so that it learns; cli/demo/training.py). The bench then runs the same steps again once per failure kind, with --faults
faults of that kind evenly spaced, far enough apart that no fault's measuring window holds another
one (so each run's faults give a median and a spread, not one noisy window): SIGKILL of an actor
rank, of the reference or of the reward worker, SIGSTOP of an actor rank (a hang), or SIGSTOP of
the engine's shadow and main (the rollout side hung whole, which no one on that side notices). Each is recovered by a targeted rebuild (the reward: a restart in
place; the rollout side: the engine restarted by the cold path). Ranks are forked from the
trainer's fork server (a warm start); `actor-cold` is the actor kill with every rank started as a
new process instead; `none` is the failure-free run again, which shows how much two runs differ
with no fault at all. A last run takes the actor kill with no rebuilds allowed, so the fault
manager reschedules from the last checkpoint: the cold baseline. Every bound of the fault manager
is set to the number of faults, so each fault is recovered by its own rung. Reported per kind:
seconds and percent added to the failure-free run; the local cost of each fault (the steps around
it against the run's own pace before it, which two runs' paces cannot blur), with their median and
range; detection and rebuild seconds from the events; and the targeted rebuild against the
reschedule.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from belayer_rl.cli.bench_report import Report, emit
from belayer_rl.cli.cluster import ClusterConfig, UpSettings, local_cluster
from belayer_rl.cli.demo.training import RECIPE
from belayer_rl.services.rollout.agent import RolloutSettings
from belayer_rl.services.rollout.local_sandbox import LocalSandboxes
from belayer_rl.services.trainer import group_faults as chaos_faults
from belayer_rl.services.trainer.actor import ActorSettings
from belayer_rl.services.trainer.fault_manager import FaultManagerConfig
from belayer_rl.services.trainer.grpo import GrpoConfig
from belayer_rl.services.trainer.plot import plot_reward_curves
from belayer_rl.services.trainer.tasks import Lookup, TrainTask, workload
from belayer_rl.services.trainer.trainer import GroupBackend, StepResult, Trainer, TrainSettings
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import TrainerGroupConfig, hostname_id
from belayer_rl.shared.protocol import EVENT_TYPES, ShadowState, TrainerStep, decode, decoder_for
from belayer_rl.shared.subjects import event_kind

KINDS: dict[str, tuple[str, str] | None] = {  # kind -> (group, chaos action)
    "actor": ("actor", "kill"),
    "reference": ("reference", "kill"),
    "reward": ("reward", "kill"),
    "hang": ("actor", "stop"),
    "rollout": ("rollout", "stop"),  # the engine's shadow and main, not a trainer group
    "actor-cold": ("actor", "kill"),  # as "actor", every rank started cold (no fork server)
    "none": None,  # the failure-free run again: what two runs differ by with no fault at all
}
KL_BETA = 0.05  # so that the reference group exists in every run (reverse)
CHECKPOINT_EVERY = 10
UNBOUNDED_STEPS = 10**6  # the failure-free run's bound: it stops at --minutes
LOCAL_BEFORE, LOCAL_AFTER = 55, 20  # steps that set the pace before a fault, and that it may slow
LOCAL_EARLY = 2  # steps before the fault's own that its window also holds, should it come early
# The fewest steps between two faults: the second's pace-setting steps must all come after the
# first's window.
FAULT_SPACING = LOCAL_BEFORE + LOCAL_EARLY + 1 + LOCAL_AFTER + 1
# Every sample is a request in the token log, about 1.6 KB: the default 1 GiB fills after about
# 2,300 steps, some 40 minutes of this workload. Each run has a cluster, so a log, of its own.
LOG_MAX_MB = 4096


def add_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "train-recovery", help="trainer group failures: time added, rebuild vs reschedule"
    )
    bench.add_argument(
        "--workload", choices=("reverse", "lookup"), default="reverse",
        help="reverse: one turn, no tool; lookup: agentic trajectories, actions in local folders",
    )  # fmt: skip
    bench.add_argument("--minutes", type=float, default=10.0, help="length of the failure-free run")
    bench.add_argument("--kinds", default=",".join(KINDS), help="failure kinds, one run each")
    bench.add_argument(
        "--faults", type=int, default=5, help="faults in each run, evenly spaced (fewer if the run is short)"
    )
    bench.add_argument("--hang-timeout", type=float, default=30.0, help="the fault manager's hang timeout")
    bench.add_argument(
        "--rollout-timeout", type=float, default=30.0, help="the fault manager's rollout timeout"
    )
    bench.add_argument("--no-reschedule", action="store_true", help="skip the reschedule baseline run")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--plot", type=Path, help="draw every run's reward curve on one plot, in this PNG")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(
            f"belayer bench train-recovery: unknown kinds {sorted(unknown)}; one of {list(KINDS)}"
        )
    if args.faults < 1:
        raise SystemExit("belayer bench train-recovery: --faults must be at least 1")
    report = uvloop.run(measure(args, kinds))
    report["machine"] = {"cpus": os.cpu_count()}
    return emit(report, args.json, print_table)


class Events:
    """group_failed, group_rebuilt and reschedule events of one run."""

    def __init__(self) -> None:
        self.seen: list[Report] = []

    async def follow(self, client: Client, run: str) -> None:
        names = client.subjects
        for subject in (
            names.event("group_failed", run),
            names.event("group_rebuilt", run),
            names.event("reschedule", run),
        ):
            kind = event_kind(subject)
            decoder = decoder_for(EVENT_TYPES[kind])

            async def on_message(msg, kind=kind, decoder=decoder) -> None:
                event = decode(decoder, msg.data)
                self.seen.append({**{f: getattr(event, f) for f in event.__struct_fields__}, "event": kind})

            await client.nc.subscribe(subject, cb=on_message)


async def measure(args: argparse.Namespace, kinds: list[str]) -> Report:
    task = workload(args.workload, length=RECIPE.length if args.workload == "lookup" else 2)
    with tempfile.TemporaryDirectory(prefix="belayer-bench-train-") as state:
        root = Path(state)
        bench = BenchRuns(args, task, root)
        # The failure-free run trains for --minutes and sets the steps of every other run: sized
        # from a short calibration instead, it came out 9.0 and 13.6 minutes long for 10 asked
        # (a pace of 16 steps at a run's start foretold a long run's by no better than 25%).
        clean = await bench.one("clean", UNBOUNDED_STEPS, None, [], until_s=args.minutes * 60)
        steps = len(clean.marks)
        at = fault_steps(steps, args.faults)
        print(
            f"failure-free: {clean.wall:.1f} s, {steps} steps; faults after steps {at}",
            file=sys.stderr,
            flush=True,
        )
        results: Report = {}
        for kind in kinds:
            changes = {"warm_start": False} if kind.endswith("-cold") else {}
            faulted = await bench.one(f"fault-{kind}", steps, KINDS[kind], at, **changes)
            results[kind] = summarise(faulted, clean, at)
            print(
                f"{kind}: {faulted.wall:.1f} s ({faulted.wall - clean.wall:+.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        reschedule = None
        if not args.no_reschedule:
            rescheduled = await bench.one("reschedule", steps, KINDS["actor"], at, actor_max_rebuild_times=0)
            reschedule = summarise(rescheduled, clean, at)
            print(
                f"reschedule: {rescheduled.wall:.1f} s ({rescheduled.wall - clean.wall:+.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    curves = {"failure-free": rewards(clean)} | {kind: r["rewards"] for kind, r in results.items()}
    if reschedule is not None:
        curves["reschedule"] = reschedule["rewards"]
    if args.plot is not None:
        title = f"belayer bench train-recovery --workload {args.workload}: mean reward by step"
        await asyncio.to_thread(plot_reward_curves, curves, args.plot, title)
    return {
        "workload": f"{task.name}, GRPO, 16 prompts x 16 samples a step, actor of 2 gloo ranks + reference + reward",
        "rewards_by_step": curves,  # each run's mean reward of each step, in the order trained
        "steps": steps,
        "step_s": clean.wall / steps,
        "failure_free_s": clean.wall,
        "fault_steps": at,  # each fault strikes 0.2 s into the step after these
        # the local cost's windows measured on the failure-free run: what the measure reads with no fault
        "failure_free_local_s": [local_cost(clean, fault) for fault in at],
        "failure_free_pace_s": by_tenth(step_times(clean.marks)[1:]),
        # where the pace goes: each phase's median of each tenth, and the tokens it generated
        "failure_free_phases_by_tenth": {
            phase: by_tenth([getattr(e, phase) for e in clean.steps[1:]])
            for phase in ("rollout_s", "update_s", "publish_s", "response_tokens")
        },
        "hang_timeout_s": args.hang_timeout,
        "rollout_timeout_s": args.rollout_timeout,
        "checkpoint_every": CHECKPOINT_EVERY,
        "faults": results,
        "reschedule": reschedule,
    }


class LengthReached(Exception):
    """The failure-free run has trained for its length: raised out of the trainer's step callback."""


@dataclasses.dataclass
class Run:
    wall: float  # the training alone, not the cluster's start
    seen: list[Report]  # its recovery events
    marks: list[float]  # when each step ended (perf_counter)
    steps: list[TrainerStep]  # each step's event, as the trainer published it


@dataclasses.dataclass
class BenchRuns:
    """Each run on a cluster of its own, started for it and stopped after it: runs on one cluster
    were slower the later they came, before their fault, by as much as a fault adds (the router,
    the token log and the bus carry every earlier run's requests)."""

    args: argparse.Namespace
    task: TrainTask
    root: Path

    async def one(
        self,
        run: str,
        steps: int,
        fault: tuple[str, str] | None,
        at: list[int],
        until_s: float | None = None,
        **changes: Any,
    ) -> Run:
        """Run `steps` GRPO steps named `run` with a `fault` after each step of `at`, or with no
        fault until the first step that ends `until_s` seconds or more after the training started."""
        folder = self.root / run
        config = ClusterConfig(
            state_dir=folder / "cluster", engines=1, shadows=True, sandboxes=False,
            services=UpSettings(preset="tiny", log_max_mb=LOG_MAX_MB),
        )  # fmt: skip
        async with local_cluster(config) as supervisor:
            async with await Client.connect(supervisor.target("admin"), "bench") as client:
                await client.wait_for_engines(1, 600)
                return await self.train(supervisor, client, config, run, steps, fault, at, until_s, **changes)

    async def train(
        self, supervisor, client: Client, config: ClusterConfig, run: str, steps: int,
        fault: tuple[str, str] | None, at: list[int], until_s: float | None, **changes: Any,
    ) -> Run:  # fmt: skip
        args, folder = self.args, self.root / run
        agentic = isinstance(self.task, Lookup)
        # lookup learns only with the demo's recipe; reverse keeps the settings of earlier figures
        actor = ActorSettings(lr=RECIPE.lr, ppo_epochs=RECIPE.ppo_epochs) if agentic else ActorSettings()
        kl_beta = RECIPE.kl_beta if agentic else KL_BETA
        train = TrainSettings(
            run=run, steps=steps, seed=args.seed, actor=actor, grpo=GrpoConfig(kl_beta=kl_beta),
            rollout=RolloutSettings(host_id=hostname_id(), scripted=False) if agentic else None,
            checkpoint_every=CHECKPOINT_EVERY, checkpoint_dir=folder / "ckpt",
        )  # fmt: skip
        worker = TrainerGroupConfig(
            nats_url=supervisor.nats_url, nats_creds=supervisor.access("trainer").creds, metrics_port=-1,
            run=run, world=2, rendezvous=folder / "rendezvous", seed=args.seed, kl_beta=kl_beta,
            lr=actor.lr, ppo_epochs=actor.ppo_epochs, workload=args.workload, length=self.task.length,
            allowed=TrainerGroupConfig.allowed_of(self.task.allowed_sets),
        )  # fmt: skip
        # Every rung may recover every fault of the run: each fault is then recovered alike.
        bounds = dict.fromkeys(
            ("max_restarts", "max_task_retries", "actor_max_rebuild_times", "rollout_max_rebuild_times",
             "max_reschedule_times"),
            max(1, len(at)),
        )  # fmt: skip
        faults = FaultManagerConfig(
            hang_timeout_s=args.hang_timeout, rollout_timeout_s=args.rollout_timeout, **{**bounds, **changes}
        )
        sandboxes = LocalSandboxes(folder / "sandboxes") if agentic else None
        trainer = Trainer(
            client, self.task, train, GroupBackend.create("local", client, worker, folder, faults),
            sandboxes=sandboxes,
        )  # fmt: skip
        events = Events()
        await events.follow(client, run)
        chaos = None
        if fault == KINDS["rollout"]:
            engines_file = config.state_dir / "workers" / "engines.json"
            chaos = asyncio.create_task(stop_rollout_side(trainer, at, engines_file))
        elif fault is not None:
            group, action = fault
            # Rank 0, 0.2 s into the step's rollout or update.
            planned = [chaos_faults.Fault(group, step, action, delay_s=0.2, rank_draw=0.0) for step in at]
            chaos = asyncio.create_task(chaos_faults.inject(trainer, planned, lambda line: None))
        started = time.perf_counter()
        marks: list[float] = []
        step_events: list[TrainerStep] = []

        def on_step(result: StepResult) -> None:
            marks.append(time.perf_counter())
            step_events.append(result.event)
            if until_s is not None and marks[-1] - started >= until_s:
                raise LengthReached

        try:
            await trainer.run(on_step)
        except LengthReached:  # the trainer stopped its groups on the way out, as at its last step
            pass
        finally:
            if chaos is not None and not chaos.done():
                chaos.cancel()
            if sandboxes is not None:
                await sandboxes.close()
        wall = time.perf_counter() - started
        if chaos is not None:
            await asyncio.gather(chaos, return_exceptions=True)
        return Run(wall, events.seen, marks, step_events)


async def stop_rollout_side(trainer: Trainer, at: list[int], engines_file: Path) -> None:
    """SIGSTOP the engine's shadow, then its main, 0.2 s into the step after each step of `at`."""
    for step in at:
        while trainer.step < step:  # noqa: ASYNC110 (the trainer has no event for it)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        workers = msgspec.json.decode(await asyncio.to_thread(engines_file.read_bytes), type=ShadowState)
        for engine in workers.values():
            for pid in (engine.shadow, engine.main):
                if pid > 0:  # 0: none now (a kill of pid 0 would stop this process group)
                    os.kill(pid, signal.SIGSTOP)


def rewards(run: Run) -> list[float]:
    """The run's mean reward of each step, in the order trained (a step done again: twice)."""
    return [event.reward_mean for event in run.steps]


def step_times(marks: list[float]) -> list[float]:
    """Each step's seconds from `marks` (when each step ended), from the second step on."""
    return [b - a for a, b in itertools.pairwise(marks)]


def fault_steps(steps: int, wanted: int) -> list[int]:
    """The steps after which a run's faults strike: `wanted` of them evenly spaced, or as many as
    fit FAULT_SPACING apart, and at least one, half way (its windows then cut short)."""
    fits = min(wanted, steps // FAULT_SPACING - 1)
    if fits < 1:
        return [steps // 2]
    spacing = steps // (fits + 1)
    return [spacing * (i + 1) for i in range(fits)]


def pace_drift(marks: list[float], clean_marks: list[float], steps: int, first_fault: int) -> float:
    """Seconds a whole run differs from the failure-free one by pace alone: the median step time of
    the steps before its first fault (they cannot know of it) against the same steps of the
    failure-free run, times the steps. A machine busier in one run than in the other shows here;
    a rebuilt group that stays slower does not, for it comes after the fault."""

    def median_step(times: list[float]) -> float:
        # times[i]: when step i + 1 ended; from the second on, short of the fault's step
        before = step_times(times[1 : first_fault - 1])
        return statistics.median(before) if before else 0.0

    return (median_step(marks) - median_step(clean_marks)) * steps


def by_tenth(values: list[float]) -> list[float]:
    """The median of each tenth of a run's per-step `values`: whether its pace holds, or changes
    as the run goes (a run's first steps have gone faster than its average, and slower)."""
    tenth = max(1, len(values) // 10)
    return [
        statistics.median(values[i : i + tenth]) for i in range(0, tenth * 10, tenth) if values[i : i + tenth]
    ]


def local_cost(run: Run, fault: int) -> float:
    """Seconds the steps around the fault after step `fault` took beyond the run's own pace just
    before it. The window runs from LOCAL_EARLY steps before the fault's step (should it strike a
    step early) to LOCAL_AFTER after it, and its nominal steps are charged at the median of the
    LOCAL_BEFORE steps before it. Steps are found by number, so the steps that a reschedule does
    again fall in the window, as time beyond its nominal steps. Two failure-free runs of one length
    differed by 50 s of 815 here, so walls of separate runs cannot show a cost of a few seconds;
    this compares no runs."""
    numbers = [event.step for event in run.steps]  # run.marks[i]: when the step numbers[i] ended
    first = max(2, fault + 1 - LOCAL_EARLY)  # step 1 has no start mark
    last = min(max(numbers), fault + 1 + LOCAL_AFTER)
    start = numbers.index(first)  # its first time: before the fault
    end = len(numbers) - 1 - numbers[::-1].index(last)  # its last time: after any step done again
    before = step_times(run.marks[max(0, start - 1 - LOCAL_BEFORE) : start])
    pace = statistics.median(before) if before else 0.0
    return run.marks[end] - run.marks[start - 1] - (last - first + 1) * pace


def summarise(run: Run, clean: Run, at: list[int]) -> Report:
    wall, seen, steps = run.wall, run.seen, len(clean.marks)
    drift = pace_drift(run.marks, clean.marks, steps, at[0])
    local = [local_cost(run, fault) for fault in at]
    mean, median = statistics.fmean(local), statistics.median(local)
    failed = [e for e in seen if e["event"] == "group_failed"]
    rebuilt = [e for e in seen if e["event"] == "group_rebuilt"]
    return {
        "wall_s": wall,
        "added_s": wall - clean.wall,
        "added_pct": 100 * (wall - clean.wall) / clean.wall,
        # what the run's own pace before the fault explains, and what is left to the faults
        "pace_drift_s": drift,
        "added_beyond_drift_s": wall - clean.wall - drift,
        "added_beyond_drift_pct": 100 * (wall - clean.wall - drift) / clean.wall,
        # each fault's cost from the steps around it alone, and one fault's as a share of the
        # failure-free run: the mean (what a fault costs on average), the median and the range
        "local_added_s": local,
        "local_mean_s": mean,
        "local_median_s": median,
        "local_mean_pct": 100 * mean / clean.wall,
        "local_median_pct": 100 * median / clean.wall,
        "local_range_pct": [100 * min(local) / clean.wall, 100 * max(local) / clean.wall],
        "detected_s": [e["detected_s"] for e in failed],
        "rebuild_s": [e["total_s"] for e in rebuilt],
        "rescheduled": sum(e["event"] == "reschedule" for e in seen),
        "rewards": rewards(run),
        "events": seen,
    }


def print_table(report: Report) -> None:
    print(
        f"failure-free: {report['failure_free_s']:.1f} s ({report['steps']} steps of {report['step_s']:.2f} s);"
        f" hang timeout {report['hang_timeout_s']} s; rollout timeout {report['rollout_timeout_s']} s; checkpoint every {report['checkpoint_every']} steps"
    )
    print(
        "failure-free pace, median step of each tenth:",
        " ".join(f"{t:.2f}" for t in report["failure_free_pace_s"]),
    )
    for phase, tenths in report["failure_free_phases_by_tenth"].items():
        print(f"  {phase}:", " ".join(f"{t:.3g}" for t in tenths))
    print("faults after steps", " ".join(map(str, report["fault_steps"])))
    print(
        "the local windows on the failure-free run:",
        " ".join(f"{x:+.1f}" for x in report["failure_free_local_s"]),
        "s",
    )
    print(
        f"{'failure':<12} {'added':>10} {'added %':>9} {'pace drift':>11} {'beyond it':>10} {'%':>8}"
        f" {'local mean':>11} {'%':>7} {'local median [range] %':>26} {'detected':>10} {'rebuild':>9}"
    )
    rows = dict(report["faults"])
    if report["reschedule"] is not None:
        rows["reschedule"] = report["reschedule"]
    for kind, r in rows.items():
        detected = f"{statistics.median(r['detected_s']):.3f}" if r["detected_s"] else "-"
        rebuild = f"{statistics.median(r['rebuild_s']):.2f}" if r["rebuild_s"] else "-"
        low, high = r["local_range_pct"]
        spread = f"{r['local_median_pct']:+.2f} [{low:+.2f}, {high:+.2f}]"
        print(
            f"{kind:<12} {r['added_s']:>+9.1f}s {r['added_pct']:>+8.2f}% {r['pace_drift_s']:>+10.1f}s"
            f" {r['added_beyond_drift_s']:>+9.1f}s {r['added_beyond_drift_pct']:>+7.2f}%"
            f" {r['local_mean_s']:>+10.1f}s {r['local_mean_pct']:>+6.2f}% {spread:>26} {detected:>9}s {rebuild:>8}s"
        )
    if report["reschedule"] is not None and "actor" in report["faults"]:
        targeted = report["faults"]["actor"]["local_mean_s"]
        cold = report["reschedule"]["local_mean_s"]
        ratio = f"{cold / targeted:.1f}x" if targeted > 0 else "the rebuild added nothing measurable"
        print(
            f"actor kill, local mean: targeted rebuild {targeted:+.1f} s vs reschedule {cold:+.1f} s ({ratio})"
        )
    print("added: each run's wall time minus the failure-free run's, same steps, each on a fresh cluster")
    print(
        "pace drift: the run's median step time before its first fault against the failure-free run's, times the steps"
    )
    print(
        f"local: per fault, its step, the {LOCAL_EARLY} before and the {LOCAL_AFTER} after it, less the pace of"
        f" the {LOCAL_BEFORE} before those; % of the failure-free run; detected, rebuild: medians"
    )
