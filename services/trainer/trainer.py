"""The GRPO training loop: rollout through the router, reward, update, publish, checkpoint.

Each step takes the next prompts from the data position, generates G samples of each through the
router on a named weight version, rewards them, updates the actor on the group-normalised
advantages and publishes the new weights to the weight server over the bus. A sample of an agentic
workload is a whole trajectory (services/rollout/agent.py): its turns through the router, its
actions in a sandbox of the checkpointer (or a scratch folder without Docker), its reward from the
sandbox's check; its observation tokens are in the sample but out of the loss. Every sample keeps the
version that generated it and its recovery record (the router's resumes), and its old log-probs
are recomputed with that version's weights, which the trainer keeps while a sample may need them.

With `off_policy` (one step), the samples of step n+1 are generated on the weights before step n
while step n trains: the staleness is bounded by one version, and the clipped ratio does its work.

Sampling seeds are keyed by (run seed, step, sample), the engine is deterministic and the update is
single-threaded torch, so a run resumed from a checkpoint repeats its failure-free twin.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
from nats.aio.subscription import Subscription

from belayer_rl.services.rollout.agent import RolloutSettings, Services, Trajectory, TrajectoryResult
from belayer_rl.services.rollout.local_sandbox import LocalSandboxes
from belayer_rl.services.trainer import checkpoint
from belayer_rl.services.trainer.actor import (
    Actor,
    ActorSettings,
    Rollouts,
    UpdateStats,
    initial_weights,
    padded,
)
from belayer_rl.services.trainer.data import DataPosition, take
from belayer_rl.services.trainer.fault_manager import (
    FaultBoundExceeded,
    FaultManager,
    FaultManagerConfig,
    GroupFault,
    RescheduleNeeded,
)
from belayer_rl.services.trainer.groups import ForkServer, LocalGroup
from belayer_rl.services.trainer.grpo import GrpoConfig, group_advantages
from belayer_rl.services.trainer.oracle import TrainedSample, TrainedStep
from belayer_rl.services.trainer.ray_groups import RayGroup
from belayer_rl.services.trainer.rollout_side import RolloutSide
from belayer_rl.services.trainer.tasks import Lookup, TrainTask
from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared import bus
from belayer_rl.shared.client import Client, Generation, GenerationError
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.metrics import Metrics, TrainerMetrics
from belayer_rl.shared.params import Params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import (
    ActorUpdate,
    GroupFailed,
    GroupRebuilt,
    Handover,
    RefLogprobs,
    RefLogprobsRequest,
    Reschedule,
    RewardRequest,
    Rewards,
    TrainerStep,
    WorkerFailed,
)

log = logging.getLogger("belayer.trainer")

WorkerGroup = LocalGroup | RayGroup
NO_METRICS = TrainerMetrics(Metrics(enabled=False))  # every metric NULL: stateless, safe to share

RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,24}")  # it prefixes request ids (64 characters at most)
GENERATION_TRIES = 3
MAX_BATCH = 4096  # samples a step (ActorUpdate's bound)


@dataclass(frozen=True)
class TrainSettings:
    run: str
    steps: int
    prompts_per_step: int = 16
    group_size: int = 16
    seed: int = 0  # initial weights, data order and sampling seeds derive from it
    preset: str = "tiny"
    temperature: float = 1.0
    off_policy: bool = False
    checkpoint_every: int = 0  # 0: no checkpoints
    checkpoint_dir: Path | None = None
    concurrency: int = 64  # generations in flight at once (trajectories, in an agentic workload)
    actor: ActorSettings = field(default_factory=ActorSettings)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    # An agentic workload's trajectories: the checkpointer's host, the policy, the timeouts.
    rollout: RolloutSettings | None = None
    # With local folders for the actions: this many of each step's trajectories (its first ones)
    # run in the checkpointer's Docker sandboxes all the same (a real sandbox under every step for
    # the price of a few).
    in_docker: int = 0
    record: Path | None = None  # each step's trained samples are appended here (services/trainer/oracle.py)

    def __post_init__(self) -> None:
        if not RUN_ID.fullmatch(self.run):
            raise ValueError(f"run id {self.run!r} must match {RUN_ID.pattern} (it prefixes request ids)")
        if self.steps < 0 or self.prompts_per_step < 1 or self.group_size < 2:
            raise ValueError("need steps >= 0, prompts_per_step >= 1 and group_size >= 2")
        if self.prompts_per_step * self.group_size > MAX_BATCH:
            raise ValueError(f"prompts_per_step x group_size must be <= {MAX_BATCH} samples a step")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs a checkpoint_dir")


@dataclass(frozen=True)
class Sample:
    item: str
    prompt: list[int]
    answer: list[int]  # every token after the prompt: the response, or a trajectory's turns and observations
    loss_mask: list[int]  # over `answer`: 1 on the model's tokens, 0 on observations
    token_sets: list[int]  # over `answer`: the task's allowed set each token was drawn from (1-based)
    reward: float
    weight_version: str  # the version that generated it
    resumes: int  # its recovery record: times the router resumed it after a fault
    trajectory: TrajectoryResult | None = None  # an agentic sample's whole record


class AnotherRun(Exception):
    """The checkpoint folder holds a run with other settings: resuming it would mix two runs."""


def differences(there: dict[str, str], here: dict[str, str]) -> list[str]:
    """'KEY X there, Y here' for each setting two run identities do not share."""

    def shown(identity: dict[str, str], key: str) -> str:
        return repr(identity[key]) if key in identity else "(none)"

    keys = sorted(set(there) | set(here))
    return [
        f"{k} {shown(there, k)} there, {shown(here, k)} here"
        for k in keys
        if shown(there, k) != shown(here, k)
    ]


class TrajectoryFailed(Exception):
    """A trajectory of the step ended as an infrastructure error: the step is not trained on."""


@dataclass(frozen=True)
class StepResult:
    event: TrainerStep
    samples: list[Sample]
    stats: UpdateStats


def group_events(
    client: Client, run: str, metrics: TrainerMetrics
) -> Callable[[GroupFailed | GroupRebuilt], Awaitable[None]]:
    """How the fault manager's events reach the bus, each kind onto its own subject, and the
    metrics."""

    async def publish(event: GroupFailed | GroupRebuilt) -> None:
        if isinstance(event, GroupFailed):
            subject = client.subjects.event("group_failed", run)
            metrics.group_failures.labels(event.group, event.kind).inc()
        else:
            subject = client.subjects.event("group_rebuilt", run)
            metrics.group_rebuilds.labels(event.group).inc()
            metrics.rebuild_seconds.labels(event.group).observe(event.total_s)
        await bus.publish(client.nc, subject, event)

    return publish


@dataclass
class GroupBackend:
    """The worker groups behind the fault manager: local processes (services/trainer/groups.py)
    or Ray actors (services/trainer/ray_groups.py)."""

    actor: WorkerGroup
    faults: FaultManager
    reference: WorkerGroup | None = None  # with a KL term; else no reference is consulted
    reward: WorkerGroup | None = None  # None: rewards computed in the trainer
    forks: ForkServer | None = None  # the local groups' warm starts, closed with them

    @property
    def groups(self) -> list[WorkerGroup]:
        return [g for g in (self.actor, self.reference, self.reward) if g is not None]

    @property
    def with_actor(self) -> tuple[WorkerGroup, ...]:
        """What a rebuild of the actor or of the reference restarts: both, on the actor's count."""
        return (self.actor, self.reference) if self.reference is not None else (self.actor,)

    async def start(self) -> None:
        for group in self.groups:
            await group.start()

    async def stop(self) -> None:
        for group in self.groups:
            await group.stop()

    async def close(self) -> None:
        try:
            for group in self.groups:
                await group.close()
        finally:
            if self.forks is not None:
                await self.forks.close()

    @classmethod
    def create(
        cls,
        backend: Literal["local", "ray"],
        client: Client,
        worker: TrainerGroupConfig,
        folder: Path,
        config: FaultManagerConfig,
        metrics: TrainerMetrics = NO_METRICS,
    ) -> GroupBackend:
        """The groups on `backend`: local processes driven over `client`'s bus, or Ray actors on
        the Ray cluster this process has joined (`ray.init`), rank 0's weights published by the
        trainer over `client`'s bus. `worker` holds every rank's settings."""
        weights = WeightClient(client.nc, subjects=client.subjects)

        async def publish_weights(params: Params) -> str:
            return (await weights.publish_params(params)).version

        forks = (
            ForkServer(folder, config.start_timeout_s) if backend == "local" and config.warm_start else None
        )

        def make(group: TrainerGroupConfig) -> WorkerGroup:
            if backend == "local":
                return LocalGroup(client.nc, client.subjects, group, folder, config, forks)
            return RayGroup(group, folder, config, publish_weights)

        faults = FaultManager(config, worker.run, group_events(client, worker.run, metrics))
        return replace(cls.of(make, worker, faults), forks=forks)

    @classmethod
    def of(
        cls,
        make: Callable[[TrainerGroupConfig], WorkerGroup],
        worker: TrainerGroupConfig,
        faults: FaultManager,
    ) -> GroupBackend:
        """The actor on `worker`'s settings, the reward (and, with a KL term, the reference) as
        single processes on the same ones."""
        single = replace(worker, world=1, rendezvous=None)
        reference = make(replace(single, group="reference")) if worker.kl_beta > 0 else None
        return cls(make(worker), faults, reference, make(replace(single, group="reward")))

    @property
    def config(self) -> FaultManagerConfig:
        return self.faults.config


class Trainer:
    def __init__(
        self,
        client: Client,
        task: TrainTask,
        settings: TrainSettings,
        group: GroupBackend | None = None,
        metrics: TrainerMetrics = NO_METRICS,
        sandboxes: LocalSandboxes | None = None,
    ) -> None:
        """`sandboxes`: an agentic workload's actions run in these folders, not the checkpointer's
        (but for `settings.in_docker` trajectories a step)."""
        self.client = client
        self.metrics = metrics
        self.group = group  # None: the actor runs here, in a thread
        self.weights = WeightClient(client.nc, subjects=client.subjects)
        self.task = task
        self.settings = settings
        self.config = PRESETS[settings.preset]
        initial = initial_weights(settings.preset, settings.seed)
        self.actor = Actor(self.config, initial, settings.actor, settings.grpo, task.allowed_sets)
        # The reference policy of the KL term: the initial weights, held here until the reference
        # worker group exists.
        self.reference = self.actor.weights() if settings.grpo.kl_beta > 0 else None
        self.step = 0
        self.position = DataPosition()
        self.version = ""  # the newest version this trainer published
        # The version the next step's samples are generated on: `version`, or with off_policy the
        # one before it (kept in checkpoints, so a resumed run generates what its twin did).
        self.next_rollout_version = ""
        self.kept: dict[str, Params] = {}  # version -> weights, while a pending sample may need them
        # The engines, as the fault manager rebuilds them (group mode).
        self.rollout_side = RolloutSide(client, self.resync_weights)
        self.services: Services | None = None  # what an agentic workload's trajectories talk to
        self.docker: Services | None = None  # what its `in_docker` trajectories talk to
        if isinstance(task, Lookup):
            if settings.rollout is None:
                raise ValueError(f"{task.name} is agentic: its trajectories need rollout settings")
            self.services = Services.on(client, settings.rollout.host_id, local=sandboxes)
            self.docker = (
                Services.on(client, settings.rollout.host_id) if settings.in_docker else self.services
            )
        # The step's trajectories that ended well, by id: a step run again after a fault keeps
        # them (the same seeds give the same trajectory) and runs only the others.
        self.finished: dict[str, TrajectoryResult] = {}
        self.clock_zero = time.monotonic()

    def groups_by_name(self) -> dict[str, WorkerGroup]:
        """The running worker groups (none with the inline actor): what chaos aims at."""
        return {} if self.group is None else {g.name: g for g in self.group.groups}

    # ------------------------------------------------------------------ versions

    async def publish(self) -> str:
        weights = self.actor.weights()
        handles = await self.weights.publish_params(weights)
        self.version = handles.version
        self.kept[handles.version] = weights
        return handles.version

    def forget_versions_except(self, needed: set[str]) -> None:
        self.kept = {v: w for v, w in self.kept.items() if v in needed}

    async def republish(self, versions: dict[str, Params]) -> None:
        """Publish `versions` again: the weight server may have freed them since, or restarted."""
        for version, params in versions.items():
            again = await self.weights.publish_params(params)
            if again.version != version:
                raise RuntimeError(f"republished {version} came back as {again.version}")

    async def resync_weights(self) -> None:
        """The rollout rebuild's re-sync: every version a step in hand may generate on, published
        again (in group mode, the versions the actor's state file keeps)."""
        kept = self.kept
        if self.group is not None and self.group.actor.state_file.exists():
            state_file = self.group.actor.state_file
            kept = await asyncio.to_thread(lambda: dict(checkpoint.read(state_file)["kept"]))
        await self.republish(kept)

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, object]:
        """Blocking (reads the group's state file in group mode)."""
        actor = self.actor.state() if self.group is None else checkpoint.read(self.group.actor.state_file)
        return {
            "identity": self.identity(),
            "actor": actor,
            "step": self.step,
            "position": [self.position.epoch, self.position.index],
            "version": self.version,
            "next_rollout_version": self.next_rollout_version,
            "kept": self.kept,
            "rng": torch.get_rng_state(),
        }

    def identity(self) -> dict[str, str]:
        """What fixes the run's samples and updates, all but its length: a checkpoint resumes only a
        run that has the same (a rerun with more steps goes on; one with another seed does not)."""
        s = self.settings
        return {
            "run": s.run,
            "task": self.task.name,
            "seed": str(s.seed),
            "preset": s.preset,
            "prompts_per_step": str(s.prompts_per_step),
            "group_size": str(s.group_size),
            "temperature": str(s.temperature),
            "off_policy": str(s.off_policy),
            "actor": repr(s.actor),
            "grpo": repr(s.grpo),
            # The ranks' gradients are summed in another order on another world, and an inline
            # actor keeps its state in another shape: neither resumes the other.
            "world": "inline" if self.group is None else str(self.group.actor.worker.world),
        }

    def load_state(self, state: dict) -> None:
        """Blocking. In group mode the group's state file is rewritten: (re)start the group after."""
        if self.group is None:
            self.actor.load_state(state["actor"])
        else:
            checkpoint.write_file(self.group.actor.state_file, state["actor"])
        self.step = int(state["step"])
        self.position = DataPosition(*state["position"])
        self.version = str(state["version"])
        self.next_rollout_version = str(state["next_rollout_version"])
        self.kept = dict(state["kept"])
        torch.set_rng_state(state["rng"])

    async def resume(self) -> list[str]:
        """Load the newest good checkpoint if there is one; returns what was skipped as corrupt."""
        folder = self.settings.checkpoint_dir
        if folder is None:
            return []
        loaded = await asyncio.to_thread(checkpoint.load_latest, folder)
        if loaded is None:
            return []
        if "identity" not in loaded.state:
            raise AnotherRun(
                f"{loaded.path} records no run identity (an older belayer wrote it), so it cannot be"
                " told from another run's: give this run a folder of its own"
            )
        theirs, ours = loaded.state["identity"], self.identity()
        if theirs != ours:
            raise AnotherRun(
                f"{loaded.path} is another run's checkpoint ({'; '.join(differences(theirs, ours))}):"
                " resuming it would mix two runs; give this one a folder of its own, or the same"
                " settings to resume that one"
            )
        await asyncio.to_thread(self.load_state, loaded.state)
        log.info("resumed from %s at step %d", loaded.path.name, self.step)
        return loaded.skipped

    async def save(self) -> None:
        folder = self.settings.checkpoint_dir
        assert folder is not None
        await asyncio.to_thread(lambda: checkpoint.write(folder, self.step, self.state()))

    # ------------------------------------------------------------------ rollout

    async def rollout(self, step: int, position: DataPosition, version: str) -> tuple[list[Sample], float]:
        """G samples of each of the step's prompts, generated on `version` and rewarded; returns
        them and the seconds it took. In group mode the generation goes through the fault manager,
        with the rollout side as its group."""
        started = time.perf_counter()
        if self.group is None:
            samples = await self.generate(step, position, version)
            return samples, time.perf_counter() - started
        faults, timeout_s = self.group.faults, self.group.config.rollout_timeout_s
        samples = await faults.call(
            self.rollout_side, step, lambda: self.generate_watched(step, position, version, timeout_s)
        )
        if self.group.reward is not None:
            samples = await self.rewarded(step, samples, self.group.reward)
        return samples, time.perf_counter() - started

    async def generate_watched(
        self, step: int, position: DataPosition, version: str, timeout_s: float
    ) -> list[Sample]:
        """`generate`, where no generation finishing for `timeout_s` is a hang of the rollout side
        and an error from the router is its exception (GroupFault)."""
        try:
            async with asyncio.timeout(timeout_s) as deadline:
                loop = asyncio.get_running_loop()

                def finished() -> None:
                    if not deadline.expired():  # (it may expire in the same turn of the loop)
                        deadline.reschedule(loop.time() + timeout_s)

                return await self.generate(step, position, version, finished)
        except TimeoutError as exc:
            why = f"no generation of step {step} finished in {timeout_s:g} s"
            raise GroupFault("hang", -1, why) from exc
        except ExceptionGroup as errors:  # from the generations' task group
            refused, other = errors.split((bus.ServiceError, GenerationError, TrajectoryFailed))
            if refused is None or other is not None:  # a bug among them is no rollout fault
                raise
            raise GroupFault("exception", -1, f"the rollout side: {refused.exceptions[0]}") from errors

    async def generate(
        self,
        step: int,
        position: DataPosition,
        version: str,
        finished: Callable[[], None] = lambda: None,
    ) -> list[Sample]:
        """G samples of each of the step's prompts, generated on `version` through the router and
        scored by the task (the reward group rescores them in group mode). `finished` is called
        as each generation ends."""
        if isinstance(self.task, Lookup):
            return await self.run_trajectories(self.task, step, position, version, finished)
        task = self.task
        s = self.settings
        items, _ = take(task.train, s.seed, position, s.prompts_per_step)
        gate = asyncio.Semaphore(s.concurrency)

        async def one(index: int, item: str) -> Sample:
            prompt = task.prompt_tokens(item)
            seed = sample_seed(s.seed, step, index)
            # The same id for the same request: a step run again after a fault attaches to the
            # generation the router logged (same tokens). The digest keeps another run, or other
            # weights, from ever sharing it. After a rollout rebuild the ids are new ("-b<n>"):
            # the router may have ended the old ones with an error while no engine served.
            digest = hashlib.sha256(f"{version}|{seed}|{item}".encode()).hexdigest()[:10]
            rebuilt = self.rollout_side.rebuilds
            base = f"{s.run}-s{step}-{index}-{digest}" + (f"-b{rebuilt}" if rebuilt else "")
            generation: Generation | None = None
            for attempt in range(GENERATION_TRIES):
                async with gate:
                    try:
                        generation = await self.client.generate_all(
                            prompt,
                            max_tokens=task.answer_tokens,
                            seed=seed,
                            temperature=s.temperature,
                            allowed_tokens=list(task.allowed_tokens),
                            weight_version=version,
                            request_id=base + (f"-r{attempt}" if attempt else ""),
                        )
                    except GenerationError as exc:
                        # Its end, an error (no engine in time, say), is logged for good under
                        # this id: only a fresh one can generate the sample again.
                        if attempt == GENERATION_TRIES - 1:
                            raise
                        log.warning("sample %d of step %d: %s; generating it again", index, step, exc)
                        continue
                # Anything short of a whole answer (a generation cancelled by an earlier, abandoned
                # try) is never trained on; a fresh request regenerates it, token for token.
                finished()
                if generation.finish_reason == "length" and len(generation.tokens) == task.answer_tokens:
                    break
                log.warning("sample %d of step %d ended %s after %d tokens; generating it again",
                            index, step, generation.finish_reason, len(generation.tokens))  # fmt: skip
            else:
                raise RuntimeError(
                    f"sample {index} of step {step}: no whole answer in {GENERATION_TRIES} tries"
                )
            assert generation is not None  # the loop broke on one
            if generation.weight_version != version:
                raise RuntimeError(
                    f"sample {index} came back from {generation.weight_version}, not {version}"
                )
            return Sample(
                item=item,
                prompt=prompt,
                answer=generation.tokens,
                loss_mask=[1] * len(generation.tokens),
                token_sets=[1] * len(generation.tokens),
                reward=task.reward(item, generation.tokens),
                weight_version=version,
                resumes=generation.resumes,
            )

        return await self.each_sample(items, one)

    async def each_sample(
        self, items: list[str], one: Callable[[int, str], Coroutine[Any, Any, Sample]]
    ) -> list[Sample]:
        """`one(index, item)` for the G samples of each item, at once, in group order."""
        g = self.settings.group_size
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(one(p * g + i, item)) for p, item in enumerate(items) for i in range(g)
            ]
        return [t.result() for t in tasks]

    def trajectory(
        self,
        trajectory_id: str,
        task: Lookup,
        item: str,
        seed: int,
        version: str,
        greedy: bool,
        progress: Callable[[], None] = lambda: None,
        in_docker: bool = False,
    ) -> Trajectory:
        """`progress` is called before each of its actions: what the hang detector sees move.
        `in_docker`: in the checkpointer's sandboxes even where the others run in folders."""
        assert self.services is not None and self.docker is not None and self.settings.rollout is not None
        settings = replace(self.settings.rollout, temperature=0.0 if greedy else self.settings.temperature)
        services = self.docker if in_docker else self.services
        if isinstance(services.sandboxes, LocalSandboxes):  # a folder has nothing to checkpoint
            settings = replace(settings, policy="never", fallback_policy="never")
        return Trajectory(
            trajectory_id=trajectory_id,
            task=task.rollout_task(item),
            seed=seed,
            settings=settings,
            services=services,
            clock=lambda: time.monotonic() - self.clock_zero,
            weight_version=version,
            on_action=lambda trajectory, step: progress(),
        )

    async def run_trajectories(
        self, task: Lookup, step: int, position: DataPosition, version: str, finished: Callable[[], None]
    ) -> list[Sample]:
        """G trajectories of each of the step's items, run on `version`; one that ends as an
        infrastructure error fails the step (TrajectoryFailed), never becomes a reward."""
        s = self.settings
        items, _ = take(task.train, s.seed, position, s.prompts_per_step)
        gate = asyncio.Semaphore(s.concurrency)
        this_step = f"{s.run}-s{step}-"
        self.finished = {k: v for k, v in self.finished.items() if k.startswith(this_step)}

        async def one(index: int, item: str) -> Sample:
            seed = sample_seed(s.seed, step, index)
            # The task's name too: a control run beside it, same seed, must not share its sandboxes.
            digest = hashlib.sha256(f"{task.name}|{version}|{seed}|{item}".encode()).hexdigest()[:10]
            trajectory_id = f"{s.run}-s{step}-{index}-{digest}"
            result = self.finished.get(trajectory_id)
            if result is None:
                async with gate:
                    trajectory = self.trajectory(
                        trajectory_id, task, item, seed, version, False, finished, index < s.in_docker
                    )
                    result = await trajectory.run()
                finished()
                if result.status != "done":
                    raise TrajectoryFailed(f"trajectory {trajectory_id}: {result.error}")
                self.finished[trajectory_id] = result
            return self.sample_of(task, item, result, version)

        return await self.each_sample(items, one)

    def sample_of(self, task: Lookup, item: str, result: TrajectoryResult, version: str) -> Sample:
        """A trajectory as a sample: its turn sets renumbered as the task's (`token_sets`)."""
        renumber = [0] + [task.allowed_sets.index(tuple(allowed)) + 1 for allowed in result.turn_sets]
        return Sample(
            item=item,
            prompt=result.context_tokens[: result.prompt_len],
            answer=result.context_tokens[result.prompt_len :],
            loss_mask=result.loss_mask,
            token_sets=[renumber[i] for i in result.token_sets],
            reward=result.reward,
            weight_version=version,
            resumes=0,
            trajectory=result,
        )

    async def rewarded(self, step: int, samples: list[Sample], reward: WorkerGroup) -> list[Sample]:
        """The samples with the reward group's rewards (through the fault manager)."""
        ask = RewardRequest(step=step, items=[x.item for x in samples], answers=[x.answer for x in samples])
        assert self.group is not None

        async def score() -> list[float]:
            scores = (await reward.call("reward", ask, Rewards))[0].rewards
            if len(scores) != len(samples):
                raise GroupFault("exception", 0, f"{len(scores)} rewards for {len(samples)} samples")
            return scores

        scores = await self.group.faults.call(reward, step, score)
        return [replace(x, reward=r) for x, r in zip(samples, scores, strict=True)]

    # ------------------------------------------------------------------ update

    def batch_of(self, samples: list[Sample]) -> tuple[Rollouts, torch.Tensor, torch.Tensor | None]:
        """Padded tokens, the response mask, advantages, the old log-probs of every sample under
        the version that generated it, and the reference log-probs when there is a KL term. Blocking."""
        rewards = torch.tensor([x.reward for x in samples])
        batch = padded(
            [x.prompt + x.answer for x in samples],
            [len(x.prompt) for x in samples],
            [x.loss_mask for x in samples],
            [x.token_sets for x in samples],
            group_advantages(rewards, self.settings.group_size),
        )
        old_logp = torch.empty(batch.response_mask.shape)
        for version in {x.weight_version for x in samples}:
            rows = torch.tensor([i for i, x in enumerate(samples) if x.weight_version == version])
            old_logp[rows] = self.actor.logprobs(
                self.kept[version], batch.tokens[rows], batch.token_sets[rows]
            )
        ref_logp = (
            None
            if self.reference is None
            else self.actor.logprobs(self.reference, batch.tokens, batch.token_sets)
        )
        return batch, old_logp, ref_logp

    def update(self, samples: list[Sample]) -> UpdateStats:
        return self.actor.update(*self.batch_of(samples))

    async def apply(self, samples: list[Sample]) -> tuple[UpdateStats, float]:
        """Update on `samples` and publish the new weights; returns the stats and the seconds the
        publication took (inside the update call in group mode, where rank 0 publishes)."""
        if self.group is None:
            stats = await asyncio.to_thread(self.update, samples)
            started = time.perf_counter()
            await self.publish()
            return stats, time.perf_counter() - started
        rewards = torch.tensor([x.reward for x in samples])
        call = ActorUpdate(
            step=self.step,
            tokens=[x.prompt + x.answer for x in samples],
            prompt_lens=[len(x.prompt) for x in samples],
            loss_masks=[x.loss_mask for x in samples],
            token_sets=[x.token_sets for x in samples],
            advantages=group_advantages(rewards, self.settings.group_size).tolist(),
            versions=[x.weight_version for x in samples],
        )
        actor, reference, faults = self.group.actor, self.group.reference, self.group.faults
        if reference is not None:
            ask = RefLogprobsRequest(
                step=self.step, tokens=call.tokens, prompt_lens=call.prompt_lens,
                loss_masks=call.loss_masks, token_sets=call.token_sets,
            )  # fmt: skip
            answers = await faults.call(
                reference,
                self.step,
                lambda: reference.call("logprobs", ask, RefLogprobs),
                rebuild=self.group.with_actor,
            )
            call = msgspec.structs.replace(call, ref_logp=answers[0].logp)
        updated = await faults.call(
            actor, self.step, lambda: actor.update(call), rebuild=self.group.with_actor
        )
        self.version = updated.weight_version
        if self.settings.off_policy or self.settings.checkpoint_every:
            self.kept = await asyncio.to_thread(lambda: dict(checkpoint.read(actor.state_file)["kept"]))
        stats = UpdateStats(
            loss=updated.loss,
            kl=updated.kl,
            clipped_fraction=updated.clipped_fraction,
            grad_norm=updated.grad_norm,
            ratio_max=updated.ratio_max,
            tokens=updated.tokens,
        )
        return stats, 0.0

    # ------------------------------------------------------------------ the loop

    async def run(self, on_step: Callable[[StepResult], Awaitable[None] | None] | None = None) -> None:
        """Train to `settings.steps`. In group mode the group is started here and stopped at the
        end; a group past its rebuilds reschedules the run from its last checkpoint (the start
        when there is none), at most `max_reschedule_times` times."""
        if self.group is None:
            await self.run_steps(on_step)
            return
        reschedules = 0
        if self.step == 0:  # a fresh run: state files and chaos marks an earlier run left are not ours
            for group in self.group.groups:
                group.state_file.unlink(missing_ok=True)
                for mark in group.state_file.parent.glob("chaos-fired-*"):
                    mark.unlink(missing_ok=True)
        faults = self.group.faults

        async def on_worker_failed(failed: WorkerFailed) -> None:
            cause = f"engine {failed.engine_id} worker {failed.pid}: {failed.reason}"
            faults.note_rollout_failure(time.time(), (failed.engine_id, failed.pid), cause)

        async def on_handover(handover: Handover) -> None:
            if handover.reason == "restart":  # asked for (a rollout rebuild): not a failure
                return
            cause = f"engine {handover.engine_id} worker {handover.old_pid}: {handover.reason}"
            faults.note_rollout_failure(handover.detected_at, (handover.engine_id, handover.old_pid), cause)

        names = self.client.subjects
        rollout_watch: list[Subscription] = []
        try:
            failures = names.event("worker_failed", "*")
            rollout_watch.append(await bus.listen(self.client.nc, failures, WorkerFailed, on_worker_failed))
            handovers = names.event("handover", "*")
            rollout_watch.append(await bus.listen(self.client.nc, handovers, Handover, on_handover))
            await self.group.start()
            while True:
                try:
                    await self.run_steps(on_step)
                    return
                except RescheduleNeeded as exc:
                    reschedules += 1
                    failed_step = self.step
                    if reschedules > self.group.config.max_reschedule_times:
                        # The reference's rebuilds are the actor's: they are rebuilt together.
                        rebuilds = {g.name: g.rebuilds for g in self.group.groups} | {
                            "reference": self.group.actor.rebuilds,
                            "rollout": self.rollout_side.rebuilds,
                        }
                        raise FaultBoundExceeded(
                            f"group {exc.group} failed at step {failed_step} after {exc.attempts} attempts"
                            f" and {rebuilds[exc.group]} {exc.group} rebuilds, with"
                            f" {reschedules - 1} reschedules spent; last cause: {exc.cause}"
                        ) from exc
                    await self.group.stop()
                    await self.restart_from_checkpoint()
                    event = Reschedule(
                        run=self.settings.run, attempt=reschedules, from_step=self.step,
                        failed_step=failed_step, cause=str(exc),
                    )  # fmt: skip
                    await bus.publish(
                        self.client.nc, self.client.subjects.event("reschedule", self.settings.run), event
                    )
                    self.metrics.reschedules.inc()
                    for group in self.group.groups:  # a fresh workflow gets its rebuilds again
                        group.rebuilds = 0
                    self.rollout_side.rebuilds = 0
                    await self.group.start()
        finally:
            for subscription in rollout_watch:
                await subscription.unsubscribe()
            await self.group.close()

    async def restart_from_checkpoint(self) -> None:
        """Back to the newest good checkpoint, or to the very start when there is none."""
        assert self.group is not None
        folder = self.settings.checkpoint_dir
        loaded = None if folder is None else await asyncio.to_thread(checkpoint.load_latest, folder)
        if loaded is not None:
            await asyncio.to_thread(self.load_state, loaded.state)
            return
        self.group.actor.state_file.unlink(missing_ok=True)
        self.step, self.position, self.version, self.next_rollout_version = 0, DataPosition(), "", ""
        self.kept = {}

    async def run_steps(self, on_step: Callable[[StepResult], Awaitable[None] | None] | None = None) -> None:
        s = self.settings
        if not self.version:
            await self.publish()
        else:  # resumed: the weight server may have freed these since, or restarted
            needed = dict.fromkeys(v for v in (self.next_rollout_version, self.version) if v)
            await self.republish({version: self.kept[version] for version in needed})
        pending: asyncio.Task[tuple[list[Sample], float]] | None = None
        pending_version = ""
        try:
            while self.step < s.steps:
                if pending is None:
                    pending_version = self.next_rollout_version or self.version
                    pending = asyncio.create_task(self.rollout(self.step, self.position, pending_version))
                samples, rollout_s = await pending
                pending = None
                _, after = take(self.task.train, s.seed, self.position, s.prompts_per_step)
                if s.off_policy and self.step + 1 < s.steps:  # step n+1 rolls out while step n trains
                    pending_version = self.version
                    pending = asyncio.create_task(self.rollout(self.step + 1, after, pending_version))
                started = time.perf_counter()
                generated_with = sorted({x.weight_version for x in samples})
                stats, publish_s = await self.apply(samples)
                update_s = time.perf_counter() - started - publish_s
                if s.record is not None:
                    await asyncio.to_thread(append_record, s.record, self.step, samples)
                self.step += 1
                self.position = after
                self.next_rollout_version = pending_version if pending else self.version
                # The newest version, and the one the batch in flight is generated on.
                self.forget_versions_except({self.version, self.next_rollout_version})
                event = self.step_event(samples, stats, generated_with, rollout_s, update_s, publish_s)
                self.count(event)
                await bus.publish(self.client.nc, self.client.subjects.event("trainer_step", s.run), event)
                if s.checkpoint_every and self.step % s.checkpoint_every == 0:
                    await self.save()
                if on_step is not None:
                    maybe = on_step(StepResult(event, samples, stats))
                    if maybe is not None:
                        await maybe
        finally:
            if pending is not None:
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)

    def count(self, event: TrainerStep) -> None:
        m = self.metrics
        m.steps.inc()
        m.samples.inc(event.samples)
        m.reward.set(event.reward_mean)
        for phase, seconds in (
            ("rollout", event.rollout_s),
            ("update", event.update_s),
            ("publish", event.publish_s),
        ):
            m.phase_seconds.labels(phase).observe(seconds)

    def step_event(
        self,
        samples: list[Sample],
        stats: UpdateStats,
        generated_with: list[str],
        rollout_s: float,
        update_s: float,
        publish_s: float,
    ) -> TrainerStep:
        response_tokens = sum(sum(x.loss_mask) for x in samples)
        return TrainerStep(
            run=self.settings.run,
            step=self.step,
            weight_version=self.version,
            generated_with=generated_with,
            reward_mean=sum(x.reward for x in samples) / len(samples),
            loss=stats.loss,
            kl=stats.kl,
            clipped_fraction=stats.clipped_fraction,
            samples=len(samples),
            response_tokens=response_tokens,
            tokens_per_s=response_tokens / rollout_s if rollout_s > 0 else 0.0,
            resumes=sum(x.resumes for x in samples),
            rollout_s=rollout_s,
            update_s=update_s,
            publish_s=publish_s,
        )

    # ------------------------------------------------------------------ evaluation

    async def accuracy(self, items: tuple[str, ...] | list[str], version: str | None = None) -> float:
        """Exact-match accuracy of greedy answers on `items` (of greedy trajectories, in an agentic
        workload), generated on `version` (the newest this trainer published by default) through
        the router."""
        version = version or self.version
        if not version:
            raise ValueError("nothing published yet: call publish() first")
        gate = asyncio.Semaphore(self.settings.concurrency)
        task = self.task

        async def one(item: str) -> float:
            if isinstance(task, Lookup):  # a greedy trajectory
                digest = hashlib.sha256(f"{task.name}|{version}".encode()).hexdigest()[:10]
                trajectory_id = f"{self.settings.run}-eval-{digest}-{item}"
                async with gate:
                    result = await self.trajectory(trajectory_id, task, item, 0, version, greedy=True).run()
                if result.status != "done":  # no score: an accuracy with it in would be wrong
                    raise TrajectoryFailed(f"held-out trajectory {trajectory_id}: {result.error}")
                return 1.0 if result.reward == 1.0 else 0.0  # exact: the reward is partial below it
            async with gate:
                generation = await self.client.generate_all(
                    task.prompt_tokens(item),
                    max_tokens=task.answer_tokens,
                    temperature=0.0,
                    allowed_tokens=list(task.allowed_tokens),
                    weight_version=version,
                )
            return task.reward(item, generation.tokens)

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(item)) for item in items]
        return sum(t.result() for t in tasks) / len(tasks)


def append_record(path: Path, step: int, samples: list[Sample]) -> None:
    """Step `step`'s trained samples, one line of the run's record (oracle.TrainedStep)."""
    trained = TrainedStep(
        step=step,
        weight_version=samples[0].weight_version if samples else "",
        samples=[
            TrainedSample(
                item=x.item,
                trajectory=x.trajectory.trajectory if x.trajectory else "",
                tokens=x.prompt + x.answer,
                actions=x.trajectory.actions if x.trajectory else [],
                observations=x.trajectory.observations if x.trajectory else [],
                reward=x.reward,
                error=x.trajectory.error if x.trajectory else "",
            )
            for x in samples
        ],
    )
    with path.open("ab") as f:
        f.write(msgspec.json.encode(trained) + b"\n")


def sample_seed(run_seed: int, step: int, index: int) -> int:
    return (run_seed * 1_000_003 + step) * 65_537 + index
