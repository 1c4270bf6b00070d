"""The actor as a 2-rank gloo group of real processes under the fault manager, on a real cluster.

Faults are real: SIGKILL of a rank at a seeded point of a step, SIGSTOP of a rank (a hang), a step
slower than the hang timeout that keeps working (not a hang), and kills that outlast every bound.
The oracle: a run that suffers a fault ends with its state file (weights, AdamW state, versions)
bitwise equal to its failure-free twin's. Mutation: a twin that skips one sample differs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from belayer_rl.services.trainer import group_faults as chaos
from belayer_rl.services.trainer import oracle
from belayer_rl.services.trainer.fault_manager import FaultBoundExceeded, FaultManagerConfig
from belayer_rl.services.trainer.tasks import DIGIT_TOKENS, ReverseDigits
from belayer_rl.services.trainer.trainer import NO_METRICS, GroupBackend, Trainer, TrainSettings
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.metrics import Metrics, MetricsServer, TrainerMetrics
from tests.handover.test_handover import engines
from tests.metrics.scrape import Scrape, http_get
from tests.support import Cluster, EventLog, NatsServer, kill, running_cluster

pytestmark = pytest.mark.timeout(600)

TASK = ReverseDigits(length=2)
STEPS = 4
FAULTY_STEP = 2


def settings(run: str, **changes: object) -> TrainSettings:
    base = TrainSettings(run=run, steps=STEPS, prompts_per_step=8, group_size=4, seed=11)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def group_trainer(
    cluster: Cluster,
    folder: Path,
    train: TrainSettings,
    faults: FaultManagerConfig,
    step_delay_s: float = 0.0,
    kl_beta: float = 0.0,
    fault_points: str = "",
    metrics: TrainerMetrics = NO_METRICS,
) -> Trainer:
    worker = TrainerGroupConfig(
        nats_url=cluster.nats.url,
        metrics_port=-1,
        run=train.run,
        world=2,
        rendezvous=folder / "rendezvous",  # the group gives each build a new one
        preset=train.preset,
        seed=train.seed,
        lr=train.actor.lr,
        ppo_epochs=train.actor.ppo_epochs,
        allowed=",".join(map(str, DIGIT_TOKENS)),
        heartbeat_s=0.2,
        step_delay_s=step_delay_s,
        kl_beta=kl_beta,
        fault_points=fault_points,
    )
    backend = GroupBackend.create("local", cluster.client, worker, folder, faults, metrics)
    return Trainer(cluster.client, TASK, train, backend, metrics)


def final_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    assert trainer.group is not None
    return oracle.state_of(trainer.group.actor.state_file)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The printed, seeded schedule: every group killed at each of its named points, and a hang. Each
# point fires once; the step is then run again on the rebuilt group. Steps 0-4 of a 5-step run.
SCHEDULE = (
    "reward@0:kill@forward,actor@0:kill@forward,reference@1:kill@forward,actor@1:kill@backward,"
    "actor@2:kill@publish,actor@3:kill@state-write,actor@4:stop@backward"
)
SCHEDULE_SEED = 5
SCHEDULE_STEPS = 5
# What it takes: the actor (with the reference) rebuilt six times, the reward restarted once.
SCHEDULE_FAULTS = dataclasses.replace(
    FaultManagerConfig(hang_timeout_s=3.0, call_timeout_s=60.0, start_timeout_s=120.0),
    actor_max_rebuild_times=6,
)


def printed_schedule() -> list[chaos.Fault]:
    faults = chaos.schedule(SCHEDULE, SCHEDULE_SEED)
    for fault in faults:
        print(f"chaos (seed {SCHEDULE_SEED}): {fault}")
    return faults


async def run_the_schedule(
    cluster: Cluster, tmp_path: Path, make: Callable[..., Trainer], run: str
) -> tuple[Trainer, list[tuple[str, str, int]]]:
    """The printed schedule against a run with a KL term (`make`: group_trainer or its Ray twin).
    Every point fired, no half-written state file was left, and the run ends bitwise equal to
    its failure-free twin; returns the run and its group failures (group, kind, step)."""
    train = settings(f"{run}twin", steps=SCHEDULE_STEPS)
    twin = make(cluster, tmp_path / "twin", train, SCHEDULE_FAULTS, kl_beta=0.1)
    await twin.run()
    faults = printed_schedule()
    failed = await EventLog.start(cluster.client, "group_failed")
    folder = tmp_path / "faulty"
    points = chaos.armed(faults, 2)
    trainer = make(
        cluster,
        folder,
        settings(run, steps=SCHEDULE_STEPS),
        SCHEDULE_FAULTS,
        kl_beta=0.1,
        fault_points=points,
    )
    await trainer.run()
    assert [str(f) for f in faults if not chaos.fired(f, folder, 2)] == []
    assert list(folder.glob(".tmp-*")) == []
    assert same(final_state(trainer), final_state(twin))
    return trainer, [(e.group, e.kind, e.step) for e in failed.events]


FAST = FaultManagerConfig(hang_timeout_s=3.0, call_timeout_s=60.0, start_timeout_s=90.0)


@pytest.fixture(scope="module")
def twins() -> dict[str, dict[str, torch.Tensor]]:
    """The fault-free twin's final state, run once for the module's tests: a run is a function of
    its settings alone (the oracle's premise), and every test here compares with the same one."""
    return {}


@pytest.fixture
async def twin(
    train_cluster: Cluster, tmp_path: Path, twins: dict[str, dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    if "twin" not in twins:
        trainer = group_trainer(train_cluster, tmp_path / "twin", settings("twin"), FAST)
        await trainer.run()
        twins["twin"] = final_state(trainer)
    return twins["twin"]


async def fault_during(
    trainer: Trainer, step: int, delay_s: float, sig: signal.Signals, rank: int, group: str = "actor"
) -> str:
    """Send `sig` to `group`'s `rank` `delay_s` after step `step`'s rollout began (polling the trainer)."""
    while trainer.step < step:  # noqa: ASYNC110 (the trainer has no event for it)
        await asyncio.sleep(0.01)
    await asyncio.sleep(delay_s)
    assert trainer.group is not None
    target = {g.name: g for g in trainer.group.groups}[group]
    pid = target.pids[rank]
    os.kill(pid, sig)
    return f"{sig.name} to rank {rank} (pid {pid}) {delay_s:.3f} s into step {step}"


@pytest.mark.parametrize(("seed", "warm_start"), [(1, True), (2, False)])
async def test_a_rank_killed_mid_step_is_rebuilt_and_the_run_matches_its_twin(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor], seed: int, warm_start: bool
) -> None:
    """Ranks forked by the fork server (warm) or started as new processes (cold), against a twin
    whose ranks were forked. The new ranks start while the joint grace (here 3 s) waits for a
    rollout-side failure, not after it."""
    rng = random.Random(seed)
    delay, rank = rng.uniform(0.0, 1.2), rng.randrange(2)
    print(f"seed {seed}: kill rank {rank} {delay:.3f} s into step {FAULTY_STEP}")
    failed = await EventLog.start(train_cluster.client, "group_failed")
    rebuilt = await EventLog.start(train_cluster.client, "group_rebuilt")
    faults = dataclasses.replace(FAST, warm_start=warm_start, joint_grace_s=3.0)
    trainer = group_trainer(train_cluster, tmp_path / "faulty", settings("faulty"), faults, step_delay_s=0.3)
    assert trainer.group is not None and (trainer.group.forks is not None) == warm_start
    chaos = asyncio.create_task(fault_during(trainer, FAULTY_STEP, delay, signal.SIGKILL, rank))
    await trainer.run()
    print(await chaos)
    assert [e.kind for e in failed.events] == ["exit"] and "SIGKILL" in failed.events[0].cause
    assert len(rebuilt.events) == 1 and rebuilt.events[0].total_s > 0
    # Serially (the grace, then the rebuild) the announcement would come grace + total_s after
    # the failure's; overlapped, after the longer of the two.
    announced_after = rebuilt.times[0] - failed.times[0]
    assert announced_after < faults.joint_grace_s + rebuilt.events[0].total_s, (
        announced_after,
        rebuilt.events,
    )
    assert trainer.group is not None and trainer.group.actor.rebuilds == 1
    assert same(final_state(trainer), twin)


async def test_the_printed_schedule_hits_every_group_at_every_point_and_the_run_matches_its_twin(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    """On the local backend: the reward killed mid-forward is restarted in place; the actor killed
    mid-forward, mid-backward, mid-publish and mid-state-write, the reference mid-forward and the
    actor stopped mid-backward are each a targeted rebuild of the actor with the reference. The
    run with a KL term ends bitwise equal to its failure-free twin."""
    _, failed = await run_the_schedule(train_cluster, tmp_path, group_trainer, "sched")
    assert failed == [
        ("reward", "exit", 0), ("actor", "exit", 0), ("reference", "exit", 1), ("actor", "exit", 1),
        ("actor", "exit", 2), ("actor", "exit", 3), ("actor", "hang", 4),
    ]  # fmt: skip


async def test_a_stopped_rank_is_a_hang_and_is_rebuilt(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor]
) -> None:
    failed = await EventLog.start(train_cluster.client, "group_failed")
    trainer = group_trainer(train_cluster, tmp_path / "hung", settings("hung"), FAST, step_delay_s=0.3)
    chaos = asyncio.create_task(fault_during(trainer, FAULTY_STEP, 0.4, signal.SIGSTOP, 1))
    await trainer.run()
    await chaos
    assert [e.kind for e in failed.events] == ["hang"], failed.events
    silent_s = float(failed.events[0].cause.removeprefix("no heartbeat for ").removesuffix(" s"))
    assert silent_s >= FAST.hang_timeout_s  # the stop began before the call, maybe during the rollout
    assert same(final_state(trainer), twin)


async def test_a_slow_step_that_keeps_working_is_not_a_hang(train_cluster: Cluster, tmp_path: Path) -> None:
    """Each forward/backward pass is made to take 2 s of real computation, longer than the 1 s
    hang timeout: the heartbeats show CPU time growing, and nothing is declared failed."""
    failed = await EventLog.start(train_cluster.client, "group_failed")
    faults = dataclasses.replace(FAST, hang_timeout_s=1.0)
    trainer = group_trainer(
        train_cluster, tmp_path / "slow", settings("slow", steps=2), faults, step_delay_s=2.0
    )
    await trainer.run()
    assert trainer.step == 2 and failed.events == []


async def test_past_every_bound_the_error_names_the_group_the_attempts_and_the_cause(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    """Rank 0 is killed whenever a step's update is under way: one rebuild, one reschedule, then
    one clear final error, never an endless loop."""
    faults = dataclasses.replace(FAST, actor_max_rebuild_times=1, max_reschedule_times=1)
    trainer = group_trainer(train_cluster, tmp_path / "doomed", settings("doomed"), faults, step_delay_s=0.3)
    rescheduled = await EventLog.start(train_cluster.client, "reschedule")

    async def keep_killing() -> None:
        assert trainer.group is not None
        group = trainer.group.actor
        while True:
            beat = group.beats.get(0)
            if beat is not None and beat.progress > 0 and group.pids[:1] == [beat.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(beat.pid, signal.SIGKILL)
            await asyncio.sleep(0.05)

    killer = asyncio.create_task(keep_killing())
    try:
        with pytest.raises(FaultBoundExceeded) as final:
            async with asyncio.timeout(300):
                await trainer.run()
    finally:
        killer.cancel()
    message = str(final.value)
    assert "group actor" in message and "attempts" in message and "SIGKILL" in message, message
    assert len(rescheduled.events) == 1


async def test_a_group_past_its_rebuilds_reschedules_from_the_checkpoint_and_matches_its_twin(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor]
) -> None:
    """With no rebuilds allowed, the kill reschedules the whole run from its last checkpoint
    (step 2): it ends bitwise equal to the twin, so nothing was trained twice or skipped."""
    faults = dataclasses.replace(FAST, actor_max_rebuild_times=0, max_reschedule_times=1)
    folder = tmp_path / "resched"
    train = settings("resched", checkpoint_every=1, checkpoint_dir=folder / "checkpoints")
    rescheduled = await EventLog.start(train_cluster.client, "reschedule")
    trainer = group_trainer(train_cluster, folder, train, faults, step_delay_s=0.3)
    chaos = asyncio.create_task(fault_during(trainer, FAULTY_STEP, 0.5, signal.SIGKILL, 1))
    await trainer.run()
    await chaos
    assert [(e.from_step, e.failed_step) for e in rescheduled.events] == [(FAULTY_STEP, FAULTY_STEP)]
    assert same(final_state(trainer), twin)


async def test_the_actor_and_the_rollout_side_killed_at_once_reschedule_and_match_the_twin(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor]
) -> None:
    """SIGKILL of an actor rank and of the engine's serving worker together, at a seeded point of
    step 2: the shadow takes over the rollout, and the actor's failure, with the rollout's inside
    the joint window, reschedules the run from its checkpoint instead of a targeted rebuild,
    although rebuilds are left. The run ends bitwise equal to its twin."""
    rng = random.Random(7)
    delay, rank = rng.uniform(0.2, 1.0), rng.randrange(2)
    print(f"seed 7: SIGKILL actor rank {rank} and worker e0's main {delay:.3f} s into step {FAULTY_STEP}")
    folder = tmp_path / "joint"
    train = settings("joint", checkpoint_every=1, checkpoint_dir=folder / "checkpoints")
    rescheduled = await EventLog.start(train_cluster.client, "reschedule")
    rebuilt = await EventLog.start(train_cluster.client, "group_rebuilt")
    handovers = await EventLog.start(train_cluster.client, "handover")
    # The handover is reported once the shadow serves: on a busy machine, more than a second later.
    faults = dataclasses.replace(FAST, joint_grace_s=5.0)
    trainer = group_trainer(train_cluster, folder, train, faults, step_delay_s=0.3)

    async def both() -> str:
        while trainer.step < FAULTY_STEP:  # noqa: ASYNC110 (the trainer has no event for it)
            await asyncio.sleep(0.01)
        await asyncio.sleep(delay)
        worker = await train_cluster.engine_pid("e0")
        assert trainer.group is not None
        actor = trainer.group.actor.pids[rank]
        os.kill(worker, signal.SIGKILL)
        os.kill(actor, signal.SIGKILL)
        return f"killed worker {worker} and actor rank {rank} ({actor})"

    chaos = asyncio.create_task(both())
    await trainer.run()
    print(await chaos)
    assert len(rescheduled.events) == 1, rescheduled.events
    assert "with the rollout side: engine e0" in rescheduled.events[0].cause, rescheduled.events[0]
    assert rebuilt.events == []  # no targeted rebuild: the joint failure went straight to the reschedule
    assert [h.engine_id for h in handovers.events] == ["e0"]
    assert same(final_state(trainer), twin)


async def stop_the_rollout_side(cluster: Cluster, trainer: Trainer, step: int) -> dict[str, int]:
    """SIGSTOP engine e0's shadow, then its main, as step `step` begins: the rollout stands still
    and no one on the rollout side notices. Returns the stopped pids."""
    while trainer.step < step:  # noqa: ASYNC110 (the trainer has no event for it)
        await asyncio.sleep(0.01)
    pids = engines(cluster)["e0"]
    kill(pids["shadow"], signal.SIGSTOP)
    kill(pids["main"], signal.SIGSTOP)
    return pids


async def test_a_stopped_rollout_side_is_rebuilt_by_the_cold_path_and_the_run_matches_its_twin(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor]
) -> None:
    """Engine e0's main and shadow SIGSTOPped as step 2 starts: no generation finishes for the
    rollout timeout, the rollout side is rebuilt (the supervisor restarts e0 by the cold path, the
    trainer publishes its versions again), the rollout runs again, and the run ends bitwise equal
    to its twin."""
    failed = await EventLog.start(train_cluster.client, "group_failed")
    rebuilt = await EventLog.start(train_cluster.client, "group_rebuilt")
    handovers = await EventLog.start(train_cluster.client, "handover")
    faults = dataclasses.replace(FAST, rollout_timeout_s=4.0)
    trainer = group_trainer(train_cluster, tmp_path / "rollout", settings("rollout"), faults)
    chaos = asyncio.create_task(stop_the_rollout_side(train_cluster, trainer, FAULTY_STEP))
    await trainer.run()
    stopped = await chaos
    print(f"stopped e0's shadow {stopped['shadow']} and main {stopped['main']} at step {FAULTY_STEP}")
    assert [(e.group, e.kind) for e in failed.events] == [("rollout", "hang")], failed.events
    assert failed.events[0].step >= FAULTY_STEP
    assert [(e.group, e.rebuild) for e in rebuilt.events] == [("rollout", 1)]
    assert [(e.reason, e.path, e.old_pid) for e in handovers.events] == [("restart", "cold", stopped["main"])]
    assert same(final_state(trainer), twin)


async def test_a_rollout_side_rebuilt_after_the_router_gave_its_requests_up_still_matches_the_twin(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The same stop, where the router gives a request up (`no-workers`) after 1 s without an
    engine, well before the 4 s rollout timeout: those ids end in an error for good. The trainer
    generates such a sample again under a fresh id, and after the rebuild every id is new, so the
    run still ends bitwise equal to its twin. Before: the ids the router had given up kept failing
    and the run ended with the rollout side's final error."""
    async with running_cluster(
        nats_server, tmp_path / "cluster", engines=1, shadows=True, preset="tiny", no_worker_deadline_s=1.0
    ) as cluster:
        twin = group_trainer(cluster, tmp_path / "twin", settings("gaveuptwin"), FAST)
        await twin.run()
        rebuilt = await EventLog.start(cluster.client, "group_rebuilt")
        faults = dataclasses.replace(FAST, rollout_timeout_s=4.0)
        trainer = group_trainer(cluster, tmp_path / "gaveup", settings("gaveup"), faults)
        chaos = asyncio.create_task(stop_the_rollout_side(cluster, trainer, FAULTY_STEP))
        await trainer.run()
        await chaos
    assert [(e.group, e.rebuild) for e in rebuilt.events] == [("rollout", 1)]
    assert same(final_state(trainer), final_state(twin))


async def test_a_rollout_side_past_its_rebuilds_reschedules_then_ends_the_run_naming_it(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    """No rollout rebuild allowed: the stopped rollout side reschedules the run once; stopped
    still, it then ends the run with the final error naming the rollout group."""
    faults = dataclasses.replace(FAST, rollout_timeout_s=3.0, rollout_max_rebuild_times=0)
    folder = tmp_path / "stuck"
    train = settings("stuck", checkpoint_every=1, checkpoint_dir=folder / "checkpoints")
    rescheduled = await EventLog.start(train_cluster.client, "reschedule")
    trainer = group_trainer(train_cluster, folder, train, faults)
    chaos = asyncio.create_task(stop_the_rollout_side(train_cluster, trainer, FAULTY_STEP))
    try:
        with pytest.raises(FaultBoundExceeded) as final:
            async with asyncio.timeout(300):
                await trainer.run()
    finally:
        stopped = await chaos
        for pid in (stopped["main"], stopped["shadow"]):  # the cluster's stop kills them
            kill(pid, signal.SIGCONT)
    message = str(final.value)
    assert "group rollout" in message and "no generation of step" in message, message
    assert len(rescheduled.events) == 1


async def test_the_oracle_catches_a_skipped_sample(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor]
) -> None:
    """The mutation: a failure-free run that drops one sample's advantage at step 2 ends with
    other weights than the twin, so the comparisons above can fail."""

    class SkipsOne(Trainer):
        async def apply(self, samples):  # type: ignore[no-untyped-def]
            if self.step == FAULTY_STEP:
                samples = [dataclasses.replace(samples[0], reward=1.0 - samples[0].reward), *samples[1:]]
            return await super().apply(samples)

    base = group_trainer(train_cluster, tmp_path / "mutant", settings("mutant"), FAST)
    mutant = SkipsOne(base.client, TASK, base.settings, base.group)
    await mutant.run()
    assert not same(final_state(mutant), twin)


async def test_a_killed_reward_worker_is_restarted_in_place_and_the_metrics_count_it(
    train_cluster: Cluster, tmp_path: Path, twin: dict[str, torch.Tensor]
) -> None:
    failed = await EventLog.start(train_cluster.client, "group_failed")
    rebuilt = await EventLog.start(train_cluster.client, "group_rebuilt")
    registry = Metrics(enabled=True)
    assert registry.registry is not None
    server = MetricsServer(registry.registry, lambda: (True, "training"))
    port = await server.start("127.0.0.1", 0)
    trainer = group_trainer(
        train_cluster, tmp_path / "reward", settings("rewardkill"), FAST, metrics=TrainerMetrics(registry)
    )
    chaos = asyncio.create_task(fault_during(trainer, FAULTY_STEP, 0.05, signal.SIGKILL, 0, group="reward"))
    try:
        await trainer.run()
        print(await chaos)
        status, text = await http_get(port, "/metrics")
    finally:
        await server.close()
    assert [(e.group, e.kind) for e in failed.events] == [("reward", "exit")], failed.events
    assert [e.group for e in rebuilt.events] == ["reward"]  # the actor kept running
    assert same(final_state(trainer), twin)
    # What a Prometheus scrape of `belayer train --metrics-port` shows, read by its own parser.
    assert status == 200
    scraped = Scrape.parse(text)
    assert scraped.get("belayer_trainer_steps_total") == STEPS
    assert scraped.get("belayer_trainer_samples_total") == STEPS * 8 * 4
    assert scraped.get("belayer_trainer_group_failures_total", group="reward", kind="exit") == 1
    assert scraped.get("belayer_trainer_group_failures_total") == 1
    assert scraped.get("belayer_trainer_group_rebuilds_total", group="reward") == 1
    assert scraped.get("belayer_trainer_group_rebuild_seconds_count", group="reward") == 1
    assert scraped.get("belayer_trainer_phase_seconds_count", phase="update") == STEPS
    assert "belayer_trainer_reward_mean" in scraped.names()
    assert 0.0 <= scraped.get("belayer_trainer_reward_mean") <= 1.0


async def test_a_killed_reference_is_rebuilt_with_the_actor_and_the_kl_run_matches_its_twin(
    train_cluster: Cluster, tmp_path: Path
) -> None:
    twin = group_trainer(train_cluster, tmp_path / "kltwin", settings("kltwin"), FAST, kl_beta=0.1)
    await twin.run()
    failed = await EventLog.start(train_cluster.client, "group_failed")
    rebuilt = await EventLog.start(train_cluster.client, "group_rebuilt")
    trainer = group_trainer(train_cluster, tmp_path / "klfaulty", settings("klfaulty"), FAST, kl_beta=0.1)
    assert trainer.group is not None and trainer.group.reference is not None
    chaos = asyncio.create_task(
        fault_during(trainer, FAULTY_STEP, 0.05, signal.SIGKILL, 0, group="reference")
    )
    await trainer.run()
    print(await chaos)
    assert [(e.group, e.kind) for e in failed.events] == [("reference", "exit")], failed.events
    assert [e.group for e in rebuilt.events] == ["actor"]  # the actor's rebuild, the reference with it
    assert trainer.group.actor.builds == 2 and trainer.group.reference.builds == 2
    assert same(final_state(trainer), final_state(twin))
    # The KL term was really in the loss: the run without it ends elsewhere.
    plain = group_trainer(train_cluster, tmp_path / "plain", settings("klplain"), FAST)
    await plain.run()
    assert not same(final_state(plain), final_state(twin))
