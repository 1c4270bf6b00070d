"""A batch of trajectories: every task of a workload times `samples`, run `concurrency` at a
time, with an optional chaos injector, a progress bar, and the results and timelines written as
JSON lines. What `belayer rollout` and `belayer bench env-recovery` run."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.sandbox_faults import SandboxChaos
from belayer_rl.services.rollout.workloads import Task, seeded
from belayer_rl.shared.config import positive, setting


class BatchSummary(msgspec.Struct, kw_only=True):
    policy: str
    scripted: bool
    trajectories: int
    infra_errors: int
    wall_s: float  # the batch's rollout time
    mean_reward: float
    failures: int
    recoveries: int
    restores_from_base: int
    kills: int
    checkpoints: int
    checkpoint_s: float
    exposed_checkpoint_s: float
    hidden_fraction: float  # 1 - exposed / total checkpoint time (1 when none was taken)
    fallback_decisions: int  # decided without the policy service: its figures are not the policy's
    mean_step_wall_s: float  # the mean time between two actions, over every trajectory
    response_s: list[float]  # every LLM response time: the measured distribution of T


@dataclass(frozen=True)
class Batch:
    tasks: list[Task]
    samples: int = setting(1, "trajectories per task")
    # The same for every policy compared.
    seed: int = setting(0, "trajectory seeds derive from it")
    concurrency: int = setting(4, "trajectories at once")
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:8])  # prefixes trajectory ids

    def __post_init__(self) -> None:
        positive("--samples", self.samples)
        positive("--concurrency", self.concurrency)

    def trajectories(self) -> list[tuple[str, Task, int]]:
        return [
            (
                f"{self.run_id}-{task.task_id}-{sample}",
                task,
                seeded("trajectory", self.seed, task.task_id, sample).randrange(1 << 40),
            )
            for task in self.tasks
            for sample in range(self.samples)
        ]


class Progress:
    """The progress bar (rich): trajectories done, failures and recoveries so far."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.enabled = enabled
        self.failures = self.recoveries = 0
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as Bar,
        )

        self.bar = Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failures {task.fields[failures]} recoveries {task.fields[recoveries]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),  # stdout stays for the report (--json)
            transient=False,
        )
        self.task = self.bar.add_task(label, total=total, failures=0, recoveries=0)
        self.bar.start()

    def done(self, result: TrajectoryResult) -> None:
        self.failures += result.failures
        self.recoveries += result.recoveries
        if self.enabled:
            self.bar.update(self.task, advance=1, failures=self.failures, recoveries=self.recoveries)

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()


async def run_batch(
    services: Services,
    batch: Batch,
    settings: RolloutSettings,
    *,
    chaos: SandboxChaos | None = None,
    out_dir: Path | None = None,
    progress: bool = False,
    on_trajectory: Callable[[Trajectory], None] | None = None,
) -> tuple[BatchSummary, list[TrajectoryResult]]:
    started = time.monotonic()
    clock = lambda: time.monotonic() - started  # noqa: E731
    gate = asyncio.Semaphore(batch.concurrency)
    plan = batch.trajectories()
    bar = Progress(
        len(plan), f"{settings.policy} ({'scripted agent' if settings.scripted else 'model agent'})", progress
    )

    async def one(trajectory_id: str, task: Task, seed: int) -> TrajectoryResult:
        async with gate:
            trajectory = Trajectory(trajectory_id, task, seed, settings, services, clock)
            if chaos is not None:
                trajectory.on_action = chaos.on_action
            if on_trajectory is not None:
                on_trajectory(trajectory)
            result = await trajectory.run()
            bar.done(result)
            return result

    try:
        # A trajectory ends as a result, never by raising (Trajectory.run); should one raise
        # anyway, the group cancels and awaits the others rather than leave them running.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(*entry)) for entry in plan]
        results = [task.result() for task in tasks]
    finally:
        bar.close()
    wall_s = clock()
    if out_dir is not None:
        await asyncio.to_thread(write_results, out_dir, results)
    return summarize(settings, results, wall_s, chaos.killed if chaos else 0), results


def summarize(
    settings: RolloutSettings, results: list[TrajectoryResult], wall_s: float, kills: int
) -> BatchSummary:
    checkpoint_s = sum(r.checkpoint_s for r in results)
    exposed = sum(r.exposed_checkpoint_s for r in results)
    return BatchSummary(
        policy=settings.policy,
        scripted=settings.scripted,
        trajectories=len(results),
        infra_errors=sum(r.status == "infra-error" for r in results),
        wall_s=wall_s,
        mean_reward=statistics.fmean(r.reward for r in results) if results else 0.0,
        failures=sum(r.failures for r in results),
        recoveries=sum(r.recoveries for r in results),
        restores_from_base=sum(r.restores_from_base for r in results),
        kills=kills,
        checkpoints=sum(r.checkpoints for r in results),
        checkpoint_s=checkpoint_s,
        exposed_checkpoint_s=exposed,
        fallback_decisions=sum(r.fallback_decisions for r in results),
        hidden_fraction=1.0 - exposed / checkpoint_s if checkpoint_s > 0 else 1.0,
        mean_step_wall_s=mean_step_wall_s(results),
        response_s=[e.end_s - e.start_s for r in results for e in r.timeline if e.kind == "turn"],
    )


def mean_step_wall_s(results: Sequence[TrajectoryResult]) -> float:
    """The mean wall time from one action's start to the next's (0 without two actions)."""
    gaps = [
        b.start_s - a.start_s
        for r in results
        for a, b in itertools.pairwise(e for e in r.timeline if e.kind == "action")
    ]
    return statistics.fmean(gaps) if gaps else 0.0


def write_results(out_dir: Path, results: list[TrajectoryResult]) -> None:
    """results.jsonl (one trajectory a line, without its timeline) and timelines/<id>.jsonl."""
    timelines = out_dir / "timelines"
    timelines.mkdir(parents=True, exist_ok=True)
    with (out_dir / "results.jsonl").open("wb") as out:
        for result in results:
            out.write(msgspec.json.encode(msgspec.structs.replace(result, timeline=[])) + b"\n")
            (timelines / f"{result.trajectory}.jsonl").write_bytes(
                b"".join(msgspec.json.encode(entry) + b"\n" for entry in result.timeline)
            )
