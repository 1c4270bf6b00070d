"""`belayer bench env-recovery`: what sandbox failures cost a rollout batch, per checkpoint policy.

Real runs, on a local cluster (router, one tiny-4k worker, the checkpointer on the local Docker
engine with CRIU, the policy service), with the scripted agent on the "shell" workload: for each
seed, a failure-free batch without checkpoints (the baseline of that seed), then a batch per
failure rate and policy, its sandbox containers killed by the seeded chaos injector (the same
schedule for every policy of a seed). Reports, per rate and policy, the rollout time added against
the seed's failure-free batch (paired, median and spread over seeds), total and exposed checkpoint
time, checkpoints, failures and recoveries.

Then the simulator (services/rollout/simulator.py), driven by the durations measured in these
runs: first on the real runs' own configuration (its spread against theirs: "validated" when its
medians fall within the real runs' range), then at the paper's scale (64 prompts × 8 samples, 20
rounds). Writes report.json, measured.json (the distributions, for `--sim-only`) and plot.png
into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import uvloop

from belayer_rl.cli.bench_report import Report, emit
from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings, local_cluster
from belayer_rl.services.policy.decision import Guards, Interval, Slowdown, TimedResponse, fit_slowdown
from belayer_rl.services.rollout.agent import RolloutSettings, Services, TimelineEntry, TrajectoryResult
from belayer_rl.services.rollout.driver import Batch, BatchSummary, mean_step_wall_s, run_batch
from belayer_rl.services.rollout.plot import read_timelines
from belayer_rl.services.rollout.sandbox_faults import KillSchedule, SandboxChaos
from belayer_rl.services.rollout.simulator import Measured, SimConfig, simulate
from belayer_rl.services.rollout.workloads import RESPONSE_TOKENS, shell_tasks
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.client import Client
from belayer_rl.shared.config import hostname_id
from belayer_rl.shared.protocol import PolicyDecide

POLICIES = ("never", "always", "every-3", "adaptive")
FAILURE_FREE = "-ff"  # the run id's end for a seed's failure-free batch


def add_parser(kinds: argparse._SubParsersAction) -> None:
    bench = kinds.add_parser(
        "env-recovery", help="sandbox failures: rollout time added, per checkpoint policy"
    )
    bench.add_argument("--seeds", type=int, default=5, help="paired seeds of the real runs")
    bench.add_argument("--trajectories", type=int, default=8, help="trajectories per real batch")
    bench.add_argument("--turns", type=int, default=8, help="LLM turns per trajectory")
    bench.add_argument("--action-s", type=float, default=0.3, help="seconds each scripted action takes")
    bench.add_argument("--rates", default="0.01,0.05", help="failure probabilities per step")
    bench.add_argument("--policies", default=",".join(POLICIES))
    bench.add_argument("--sim-seeds", type=int, default=5, help="seeds of the simulator at the paper's scale")
    bench.add_argument(
        "--sim-min-step",
        type=int,
        default=Guards().min_step,
        help="the adaptive policy's min-step guard in the simulator at the paper's scale (the real runs and their simulated configuration keep the policy service's)",
    )
    bench.add_argument(
        "--sim-only",
        type=Path,
        help="skip the real runs: simulate from this measured.json (validated against the report.json beside it)",
    )
    bench.add_argument(
        "--remeasure",
        action="store_true",
        help="with --sim-only: derive that measured.json again from the real runs' timelines beside it (after a change to what the simulator takes)",
    )
    bench.add_argument("--out", type=Path, default=Path("env-recovery"), help="folder for report, plot, data")
    bench.add_argument("--quick", action="store_true", help="1 seed, 2 trajectories, 3 turns (a smoke run)")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.seeds, args.trajectories, args.turns, args.sim_seeds = 1, 2, 3, 1
    args.out.mkdir(parents=True, exist_ok=True)
    rates = [float(r) for r in args.rates.split(",")]
    policies = args.policies.split(",")
    if len(set(rates)) < len(rates) or len(set(policies)) < len(policies):
        raise SystemExit("belayer bench env-recovery: --rates and --policies name each value once")
    if args.remeasure and not args.sim_only:
        raise SystemExit("belayer bench env-recovery: --remeasure needs --sim-only DIR/measured.json")
    if args.sim_only:
        if args.remeasure:
            _, remeasured = measure_batches(read_batches(args.sim_only.parent))
            args.sim_only.write_text(json.dumps(dataclasses.asdict(remeasured)))
        measured = Measured(**json.loads(args.sim_only.read_text()))
        earlier = args.sim_only.parent / "report.json"
        real = json.loads(earlier.read_text())["real"] if earlier.exists() else None
        report: Report = {"real": real}
    else:
        report, measured = uvloop.run(real_runs(args, rates, policies))
        (args.out / "measured.json").write_text(json.dumps(dataclasses.asdict(measured)))
    report["machine"] = {"cpus": os.cpu_count(), "host": "this machine"}
    report["agent"] = f"scripted agent: responses of U{RESPONSE_TOKENS} tokens, EOS masked until then"
    report["simulator"] = simulations(args, rates, policies, measured, report.get("real"))
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "plot.png")
    return emit(report, args.json, print_table)


async def real_runs(
    args: argparse.Namespace, rates: list[float], policies: list[str]
) -> tuple[Report, Measured]:
    tasks = shell_tasks(args.trajectories, turns=args.turns, action_s=args.action_s)
    cells: dict[str, list[dict[str, float]]] = {}
    batches: dict[str, list[TrajectoryResult]] = {}  # run id -> its trajectories, for the simulator
    baselines: list[float] = []
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as state:
        config = ClusterConfig(
            state_dir=Path(state), engines=1, shadows=False, sandboxes=True,
            services=UpSettings(preset="tiny-4k", num_blocks=2048),
        )  # fmt: skip
        async with local_cluster(config) as supervisor:
            if "checkpointer" not in supervisor.children:
                raise SystemExit("belayer bench env-recovery: no checkpointer (is Docker with CRIU up?)")
            async with await Client.connect(supervisor.target("admin"), "bench") as client:
                await client.wait_for_engines(1, 600)
                host_id = hostname_id()
                services = Services.on(client, host_id)
                # A first batch, not counted: the engine's first steps and the image's first
                # containers are slower, and would flatter every batch after the baseline.
                warm_up = Batch(tasks[:2], seed=10_000, concurrency=2, run_id="warm-up")
                _, warmed = await run_batch(
                    services, warm_up, RolloutSettings(host_id=host_id, policy="always")
                )
                refuse_broken("warm-up", warmed)
                for seed in range(args.seeds):
                    batch = Batch(
                        tasks, seed=seed, concurrency=args.trajectories, run_id=f"s{seed}{FAILURE_FREE}"
                    )
                    settings = RolloutSettings(host_id=host_id, policy="never")
                    baseline, ff_results = await run_batch(
                        services, batch, settings, out_dir=args.out / batch.run_id
                    )
                    refuse_broken(batch.run_id, ff_results)  # no baseline to measure against
                    batches[batch.run_id] = ff_results
                    baselines.append(baseline.wall_s)
                    step_wall = baseline.mean_step_wall_s
                    print(
                        f"seed {seed}: failure-free {baseline.wall_s:.1f} s, step {step_wall:.2f} s",
                        flush=True,
                    )
                    for rate in rates:
                        for policy in policies:
                            chaos = SandboxChaos(
                                KillSchedule(1000 + seed, rate, step_wall),
                                host_id=host_id,
                                nc=client.nc,
                                subjects=client.subjects,
                            )
                            batch = Batch(
                                tasks,
                                seed=seed,
                                concurrency=args.trajectories,
                                run_id=f"s{seed}-{policy}-{rate:g}".replace(".", "_"),
                            )
                            await fresh_policy(supervisor, services)  # learns from this batch alone
                            try:
                                summary, run_results = await run_batch(
                                    services,
                                    batch,
                                    RolloutSettings(host_id=host_id, policy=policy),
                                    chaos=chaos,
                                    out_dir=args.out / batch.run_id,
                                )
                            finally:
                                await chaos.close()
                            batches[batch.run_id] = run_results
                            cells.setdefault(f"{rate:g}/{policy}", []).append(cell(summary, baseline))
                            print(
                                f"  p={rate:g} {policy}: {summary.wall_s:.1f} s, {summary.failures} failures, {summary.checkpoints} checkpoints",
                                flush=True,
                            )
    report: Report = {"real": {"config": {"seeds": args.seeds, "trajectories": args.trajectories, "turns": args.turns, "action_s": args.action_s},
                       "failure_free_s": baselines, "cells": {k: aggregate(v) for k, v in cells.items()}}}  # fmt: skip
    slowdown, measured = measure_batches(batches)
    report["real"]["slowdown"] = dataclasses.asdict(slowdown) if slowdown else None
    return report, measured


def read_batches(folder: Path) -> dict[str, list[TrajectoryResult]]:
    """The real runs' batches as `run_batch` wrote them into --out: <run id>/results.jsonl and
    <run id>/timelines/<trajectory>.jsonl."""
    decoder = msgspec.json.Decoder(TrajectoryResult)
    batches = {}
    for results in sorted(folder.glob("*/results.jsonl")):
        timelines = read_timelines(results.parent / "timelines")
        batches[results.parent.name] = [
            msgspec.structs.replace(result, timeline=timelines[result.trajectory])
            for result in map(decoder.decode, results.read_bytes().splitlines())
        ]
    if not any(run_id.endswith(FAILURE_FREE) for run_id in batches):
        raise SystemExit(
            f"belayer bench env-recovery: no failure-free batch (*{FAILURE_FREE}/results.jsonl) in {folder}"
        )
    return batches


def measure_batches(batches: dict[str, list[TrajectoryResult]]) -> tuple[Slowdown | None, Measured]:
    """What the simulator takes from the real runs' batches (keyed by run id; the failure-free
    ones end in -ff), and the slowdown fit behind its κ. The batches are taken in run-id order,
    whatever order they come in: the simulator draws a sample by its place in a list, so the runs
    and a later --remeasure of them must list the samples alike."""
    batches = dict(sorted(batches.items()))
    undisturbed = [batch for run_id, batch in batches.items() if run_id.endswith(FAILURE_FREE)]
    slowdown = fit_slowdown(r for batch in batches.values() for r in timed_responses(batch))
    # The simulator slows responses only by a slowdown the data show.
    kappa = slowdown.kappa if slowdown is not None and slowdown.shown else 0.0
    step_wall = statistics.fmean(mean_step_wall_s(batch) for batch in undisturbed)
    return slowdown, measure(list(batches.values()), undisturbed, step_wall, kappa)


def refuse_broken(run_id: str, results: Sequence[TrajectoryResult]) -> None:
    """A batch without failures injected must end every trajectory normally: an infrastructure
    error there (no sandbox image, no engine) would fail every batch after it the same way."""
    broken = [r for r in results if r.status != "done"]
    if broken:
        raise SystemExit(
            f"belayer bench env-recovery: {len(broken)} of {len(results)} trajectories of batch "
            f"{run_id} ended on an infrastructure error, with no failure injected: {broken[0].error}"
        )


async def fresh_policy(supervisor: Supervisor, services: Services) -> None:
    """Restart the policy service (the local cluster starts it again) and wait until the new one
    answers: its estimates then come from the batch about to run, not from earlier cells."""
    old_pid = supervisor.children["policy"].pid
    os.kill(old_pid, signal.SIGTERM)
    probe = PolicyDecide(
        trajectory="probe",
        host_id="probe",
        step=0,
        step_duration_s=0.0,
        exposure_s=0.0,
        env_work_s=0.0,
        elapsed_s=0.0,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if supervisor.children["policy"].pid not in (old_pid, 0, None):
            with contextlib.suppress(ServiceError):
                await services.policy.decide(probe)
                return
        await asyncio.sleep(0.2)
    raise SystemExit("belayer bench env-recovery: the policy service did not come back within 120 s")


def cell(summary: BatchSummary, baseline: BatchSummary) -> dict[str, float]:
    return {
        "added": summary.wall_s / baseline.wall_s - 1.0,
        "wall_s": summary.wall_s,
        "checkpoint_s": summary.checkpoint_s,
        "exposed_checkpoint_s": summary.exposed_checkpoint_s,
        "hidden_fraction": summary.hidden_fraction,
        "checkpoints": summary.checkpoints,
        "failures": summary.failures,
        "recoveries": summary.recoveries,
        "restores_from_base": summary.restores_from_base,
        "infra_errors": summary.infra_errors,
        "fallback_decisions": summary.fallback_decisions,
    }


def aggregate(rows: list[dict[str, float]]) -> Report:
    """Per figure: median, min and max over seeds; counts summed."""
    out: Report = {}
    for name in rows[0]:
        values = [row[name] for row in rows]
        if name in (
            "checkpoints",
            "failures",
            "recoveries",
            "restores_from_base",
            "infra_errors",
            "fallback_decisions",
        ):
            out[name] = sum(values)
        else:
            out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def timed_responses(batch: Sequence[TrajectoryResult]) -> list[TimedResponse]:
    """One batch's responses (its trajectories share one clock), each with the seconds of any
    trajectory's checkpoints that ran beside it."""
    entries = [e for r in batch for e in r.timeline]
    # A checkpoint that failed took CPU as well; a turn that failed is no sample of a response.
    checkpoints = [
        Interval(e.start_s, e.end_s) for e in entries if e.kind in ("checkpoint", "checkpoint-failed")
    ]
    turns = [(Interval(e.start_s, e.end_s), e.tokens) for e in entries if e.kind == "turn" and e.tokens > 0]
    return [TimedResponse(when, tokens, sum(when.overlap(c) for c in checkpoints)) for when, tokens in turns]


def loaded_turns(batch: Sequence[TrajectoryResult]) -> list[tuple[TimelineEntry, int]]:
    """A batch's responses (turns that generated tokens), each with the number of its
    trajectories alive when it started: those past their first timeline entry, before their last."""
    lives = [Interval(r.timeline[0].start_s, max(e.end_s for e in r.timeline)) for r in batch if r.timeline]
    return [
        (e, sum(life.start <= e.start_s < life.end for life in lives))
        for r in batch
        for e in r.timeline
        if e.kind == "turn" and e.tokens > 0 and "failed" not in e.detail
    ]


def fit_engine_load(turns: Sequence[tuple[TimelineEntry, int]]) -> tuple[float, float]:
    """Seconds per token as a + b·alive, least squares over the responses; a is kept >= 0 (the fit
    goes through the origin when it would be negative). (0, 0) when the data show no load: fewer
    than two distinct counts, or b <= 0."""
    points = [(alive, (e.end_s - e.start_s) / e.tokens) for e, alive in turns]
    if len({alive for alive, _ in points}) < 2:
        return 0.0, 0.0
    mean_n = statistics.fmean(n for n, _ in points)
    mean_s = statistics.fmean(s for _, s in points)
    b = sum((n - mean_n) * (s - mean_s) for n, s in points) / sum((n - mean_n) ** 2 for n, _ in points)
    a = mean_s - b * mean_n
    if a < 0:
        a, b = 0.0, sum(n * s for n, s in points) / sum(n * n for n, _ in points)
    return (a, b) if b > 0 else (0.0, 0.0)


def measure(
    batches: Sequence[Sequence[TrajectoryResult]],
    undisturbed: Sequence[Sequence[TrajectoryResult]],
    step_wall_s: float,
    slowdown: float,
) -> Measured:
    """The durations of every batch, for the simulator. Response times come from the failure-free
    batches only: the simulator adds the contention of its own checkpoints (`slowdown`), which the
    other batches' responses already carry; the engine load is fit on every batch's responses. A
    kind never seen (no failure at all, say) borrows its nearest kin, and the report says so
    through `measured.json`."""
    results = [r for batch in batches for r in batch]
    responses = [turn for batch in undisturbed for turn in loaded_turns(batch)]
    token_s_base, token_s_per_alive = fit_engine_load([t for batch in batches for t in loaded_turns(batch)])

    def spans(kind: str, prefix: str = "") -> list[float]:
        return [
            e.end_s - e.start_s
            for r in results
            for e in r.timeline
            if e.kind == kind and e.detail.startswith(prefix) and "failed" not in e.detail
        ]

    restores = spans("recovery", "from checkpoint")
    bases = spans("recovery", "from the base image")
    checkpoints = spans("checkpoint")
    if not checkpoints:
        raise SystemExit(
            "belayer bench env-recovery: no checkpoint completed, nothing to drive the simulator with"
        )
    return Measured(
        response_s=[e.end_s - e.start_s for e, _ in responses],
        response_alive=[alive for _, alive in responses],
        token_s_base=token_s_base,
        token_s_per_alive=token_s_per_alive,
        action_s=spans("action"),
        checkpoint_s=checkpoints,
        restore_s=restores or bases or checkpoints,
        base_restart_s=bases or restores or checkpoints,
        step_wall_s=step_wall_s,
        slowdown=slowdown,
    )


def simulations(
    args: argparse.Namespace, rates: list[float], policies: list[str], measured: Measured, real: object
) -> Report:
    started = time.monotonic()
    out: Report = {}
    shapes = {"paper": (512, 20, args.sim_seeds)}
    share = args.trajectories  # as many trajectories to a machine as in the real runs
    if isinstance(real, dict):
        config = real["config"]  # the real runs' own, also under --sim-only
        share = config["trajectories"]
        shapes["real-config"] = (config["trajectories"], config["turns"], max(config["seeds"], 5))
    for shape, (trajectories, turns, seeds) in shapes.items():
        # The real runs' configuration keeps the real runs' guards, so that it validates.
        min_step = args.sim_min_step if shape == "paper" else Guards().min_step
        shape_config = functools.partial(
            SimConfig,
            trajectories=trajectories,
            turns=turns,
            machine_trajectories=share,
            guards=Guards(min_step=min_step),
        )
        baseline = [simulate(shape_config("never", 0.0, seed=seed), measured) for seed in range(seeds)]
        cells: Report = {}
        for rate in rates:
            for policy in policies:
                rows = []
                for seed in range(seeds):
                    r = simulate(shape_config(policy, rate, seed=seed), measured)
                    rows.append({"added": r.wall_s / baseline[seed].wall_s - 1.0, "mean_added": r.mean_trajectory_s / baseline[seed].mean_trajectory_s - 1.0,
                                 "hidden_fraction": r.hidden_fraction, "checkpoint_s": r.checkpoint_s,
                                 "exposed_checkpoint_s": r.exposed_checkpoint_s, "checkpoints": r.checkpoints,
                                 "failures": r.failures, "recoveries": r.recoveries_from_checkpoint + r.restarts_from_base,
                                 "restores_from_base": r.restarts_from_base, "infra_errors": r.gave_up,
                                 "fallback_decisions": 0})  # fmt: skip
                cells[f"{rate:g}/{policy}"] = aggregate(rows) | {
                    "per_seed_added": [row["added"] for row in rows]
                }
        out[shape] = {"trajectories": trajectories, "turns": turns, "seeds": seeds, "cells": cells}
    if isinstance(real, dict):
        out["validation"] = validation(real["cells"], out["real-config"]["cells"])
    out["slowdown"] = measured.slowdown
    out["min_step"] = args.sim_min_step
    out["seconds"] = time.monotonic() - started
    return out


def validation(real: dict[str, Report], sim: dict[str, Report]) -> Report:
    """Per cell simulated (--rates and --policies may name fewer than the real runs did): does
    the simulator's median added time fall within the real runs' range?"""
    verdicts = {}
    for name, figures in real.items():
        if name not in sim:
            continue
        spread = figures["added"]
        simulated = sim[name]["added"]["median"]
        inside = spread["min"] <= simulated <= spread["max"]
        verdicts[name] = {
            "simulated_median": simulated,
            "real_min": spread["min"],
            "real_max": spread["max"],
            "within": inside,
        }
    return {"cells": verdicts, "validated": all(v["within"] for v in verdicts.values())}


def print_table(report: Report) -> None:
    print(f"{report['agent']}")
    real = report.get("real")
    if isinstance(real, dict):
        print(
            f"\nreal runs {real['config']}, failure-free batches {', '.join(f'{s:.1f}' for s in real['failure_free_s'])} s"
        )
        table(real["cells"])
    sim = report["simulator"]
    for shape in ("real-config", "paper"):
        if shape in sim:
            s = sim[shape]
            print(
                f"\nsimulator, {shape}: {s['trajectories']} trajectories x {s['turns']} rounds, {s['seeds']} seeds"
            )
            table(s["cells"])
    print(
        f"\nslowdown κ the simulator used (seconds a response loses per checkpoint second beside it): {sim['slowdown']:.3f}"
    )
    if "validation" in sim:
        print(f"\nsimulator validated against the real runs: {sim['validation']['validated']}")


def table(cells: dict[str, Report]) -> None:
    print(
        f"{'p/policy':<18}{'added (median [min, max])':>30}{'ckpt s':>9}{'exposed s':>10}{'hidden':>8}{'ckpts':>7}{'fail':>6}{'recov':>6}{'base':>6}"
    )
    for name, c in cells.items():
        added, ck, ex, hidden = c["added"], c["checkpoint_s"], c["exposed_checkpoint_s"], c["hidden_fraction"]
        print(
            f"{name:<18}{added['median']:>+13.1%} [{added['min']:+.1%}, {added['max']:+.1%}]"
            f"{ck['median']:>9.1f}{ex['median']:>10.2f}{hidden['median']:>8.1%}"
            f"{c['checkpoints']:>7}{c['failures']:>6}{c['recoveries']:>6}{c['restores_from_base']:>6}"
        )


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = [(name, cells) for name, cells in (("real", (report.get("real") or {}).get("cells")),
                                                 ("simulator (paper scale)", report["simulator"]["paper"]["cells"]))
               if cells]  # fmt: skip
    figure, axes = plt.subplots(1, len(sources), figsize=(6 * len(sources), 4), squeeze=False)
    for axis, (title, cells) in zip(axes[0], sources, strict=True):
        names = list(cells)
        medians = [100 * cells[n]["added"]["median"] for n in names]
        low = [m - 100 * cells[n]["added"]["min"] for m, n in zip(medians, names, strict=True)]
        high = [100 * cells[n]["added"]["max"] - m for m, n in zip(medians, names, strict=True)]
        axis.bar(range(len(names)), medians, yerr=[low, high], capsize=3, color="tab:blue")
        axis.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        axis.set_ylabel("rollout time added (%)")
        axis.set_title(f"{title} (scripted agent)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
