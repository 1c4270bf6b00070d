"""The ranks of the trainer groups. The actor: its copy of the weights and optimizer, its shard of every batch,
and the group's state file. Blocking torch code: the service runs it in a thread.

Every rank holds the whole model (data parallel) and takes rows rank, rank + world, ... of each
batch; gradients are summed over the gloo process group, so all ranks stay identical. After every
step rank 0 writes the group's state (weights, AdamW state, the versions old log-probs may still
need, the step's result) to the state file, atomically: a rebuilt group loads it, and a call
re-run after a fault finds its step already applied and answers it again instead of training it
twice.
"""

from __future__ import annotations

import datetime
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from belayer_rl.services.trainer import checkpoint
from belayer_rl.services.trainer.actor import (
    Actor,
    ActorSettings,
    Rollouts,
    initial_weights,
    padded,
    token_logprobs,
)
from belayer_rl.services.trainer.group_faults import FaultPoints
from belayer_rl.services.trainer.grpo import GrpoConfig
from belayer_rl.shared.config import TrainerGroupConfig
from belayer_rl.shared.params import Params, save_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import (
    ActorUpdate,
    ActorUpdated,
    RefLogprobs,
    RefLogprobsRequest,
    RewardRequest,
    Rewards,
)


class StateBehind(Exception):
    """The call is for a later step than the state holds: an update went missing."""


def version_of(weights: Params) -> str:
    """The version name the weight server gives these weights (the digest of their file)."""
    with tempfile.TemporaryDirectory(prefix="belayer-version-") as folder:
        return save_params(weights, Path(folder) / "weights.pt")


class GlooGroup:
    """The DataParallel of an actor update over torch.distributed (gloo)."""

    def __init__(self, on_pass: Callable[[], None]) -> None:
        self.on_pass = on_pass

    def sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def passed(self) -> None:
        self.on_pass()


class RewardRank:
    """The reward group's one process: the workload's reward of each answer. Stateless, so a
    restart in place loses nothing."""

    def __init__(self, config: TrainerGroupConfig) -> None:
        from belayer_rl.services.trainer.tasks import workload

        self.task = workload(config.workload, length=config.length)
        self.points = fault_points(config)
        self.work = WorkClock()
        self.progress = 0
        self.step = 0

    def reward(self, call: RewardRequest) -> Rewards:
        self.work.enter()
        if len(call.items) != len(call.answers):
            raise ValueError(f"{len(call.items)} items but {len(call.answers)} answers")
        rewards = []
        for index, (item, answer) in enumerate(zip(call.items, call.answers, strict=True)):
            if index == len(call.items) // 2:
                self.points.reached(call.step, "forward")
            rewards.append(self.task.reward(item, answer))
        self.progress += 1
        self.step = call.step
        return Rewards(rewards=rewards)


class ReferenceRank:
    """The reference policy: the initial weights, frozen. Its log-probs feed the KL term."""

    def __init__(self, config: TrainerGroupConfig) -> None:
        self.config = config
        self.params = initial_weights(config.preset, config.seed)
        self.points = fault_points(config)
        self.work = WorkClock()
        self.progress = 0
        self.step = 0

    def logprobs(self, call: RefLogprobsRequest) -> RefLogprobs:
        self.work.enter()
        rows = list(range(len(call.tokens)))
        fake = ActorUpdate(
            step=call.step, tokens=call.tokens, prompt_lens=call.prompt_lens, loss_masks=call.loss_masks,
            token_sets=call.token_sets, advantages=[0.0] * len(rows), versions=["ref"] * len(rows),
        )  # fmt: skip
        batch, _ = shard(fake, rows)
        self.points.reached(call.step, "forward")
        with torch.no_grad():
            logp = token_logprobs(
                self.params,
                PRESETS[self.config.preset],
                batch.tokens,
                self.config.allowed_sets,
                batch.token_sets,
            )
        self.progress += 1
        self.step = call.step
        return RefLogprobs(logp=[logp[r][batch.response_mask[r]].tolist() for r in rows])


class WorkClock:
    """CPU seconds of the threads that did a rank's work. The process's CPU time would not do as
    a hang signal: the heartbeats themselves spend it, so a deadlocked worker thread would look busy."""

    def __init__(self) -> None:
        self.clocks: set[int] = set()

    def enter(self) -> None:
        """Called on the thread about to work."""
        self.clocks.add(time.pthread_getcpuclockid(threading.get_ident()))

    def seconds(self) -> float:
        total = 0.0
        for clock in list(self.clocks):
            try:
                total += time.clock_gettime(clock)
            except OSError:  # that pool thread is gone; its seconds no longer move
                self.clocks.discard(clock)
        return total


class ActorRank:
    def __init__(self, config: TrainerGroupConfig) -> None:
        self.config = config
        self.progress = 0  # forward/backward passes done: the hang detector's signal
        self.work = WorkClock()
        self.points = fault_points(config)
        self.step = 0
        self.saved_step = -1  # the step the state file holds (rank 0)
        self.version = ""
        self.kept: dict[str, Params] = {}
        self.last: ActorUpdated | None = None
        if config.world > 1:
            assert config.rendezvous is not None
            dist.init_process_group(
                "gloo",
                init_method=config.rendezvous.as_uri(),  # absolute (groups.py): file://relative/x names a host
                rank=config.rank,
                world_size=config.world,
                timeout=datetime.timedelta(seconds=config.init_timeout_s),
            )
        settings = ActorSettings(lr=config.lr, ppo_epochs=config.ppo_epochs)
        grpo = GrpoConfig(eps_low=config.eps_low, eps_high=config.eps_high, kl_beta=config.kl_beta)
        self.actor = Actor(
            PRESETS[config.preset],
            initial_weights(config.preset, config.seed),
            settings,
            grpo,
            config.allowed_sets,
        )
        if config.rank == 0 and config.state_file is not None:  # the writer before us is dead
            checkpoint.remove_leftovers(config.state_file)
        if config.state_file is not None and config.state_file.exists():
            self.load(checkpoint.read(config.state_file))
            self.saved_step = self.step
        else:
            self.version = version_of(self.actor.weights())
            self.kept = {self.version: self.actor.weights()}
        self.dp = GlooGroup(self.passed) if config.world > 1 else None

    def passed(self) -> None:
        self.progress += 1
        if self.config.step_delay_s:  # tests: a slow step that still works (CPU time grows)
            deadline = time.monotonic() + self.config.step_delay_s
            x = torch.ones(64, 64)
            while time.monotonic() < deadline:
                x = (x @ x).clamp(-1, 1)

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, object]:
        return {
            "step": self.step,
            "version": self.version,
            "actor": self.actor.state(),
            "kept": self.kept,
            "last": msgspec.to_builtins(self.last) if self.last is not None else None,
        }

    def load(self, state: dict) -> None:
        self.step = int(state["step"])
        self.version = str(state["version"])
        self.actor.load_state(state["actor"])
        self.kept = dict(state["kept"])
        self.last = msgspec.convert(state["last"], ActorUpdated) if state["last"] is not None else None

    def save(self) -> None:
        """Rank 0 writes the group's state file, when it holds an older step than the ranks."""
        if self.config.rank == 0 and self.config.state_file is not None and self.saved_step < self.step:
            step = self.step - 1  # the call that made this state
            midway = lambda: self.points.reached(step, "state-write")  # noqa: E731
            checkpoint.write_file(self.config.state_file, self.state(), midway)
            self.saved_step = self.step

    # ------------------------------------------------------------------ the update

    def update(self, call: ActorUpdate) -> tuple[ActorUpdated, bool]:
        """The step's result, and whether it was computed now (False: it was already applied)."""
        self.work.enter()
        if call.step == self.step - 1 and self.last is not None and self.last.step == self.step:
            return self.last, False
        if call.step != self.step:
            raise StateBehind(f"update for step {call.step}, but the state has {self.step} steps applied")
        rows = list(range(self.config.rank, len(call.tokens), self.config.world))
        batch, versions = shard(call, rows)
        ref_logp = None
        if call.ref_logp:
            ref_logp = torch.zeros(batch.response_mask.shape)  # [b, S-1], response positions filled
            for r, i in enumerate(rows):
                ref_logp[r][batch.response_mask[r]] = torch.tensor(call.ref_logp[i])
        old_logp = torch.empty(batch.response_mask.shape)
        for version in sorted(set(versions)):
            if version not in self.kept:
                raise StateBehind(f"no weights of version {version} (have {sorted(self.kept)})")
            picked = torch.tensor([i for i, v in enumerate(versions) if v == version])
            old_logp[picked] = self.actor.logprobs(
                self.kept[version], batch.tokens[picked], batch.token_sets[picked]
            )
        at = lambda point: self.points.reached(call.step, point)  # noqa: E731
        stats = self.actor.update(batch, old_logp, ref_logp, dp=self.dp, at=at)
        if self.dp is None:
            self.passed()
        self.step += 1
        weights = self.actor.weights()
        before, self.version = self.version, version_of(weights)
        # The new version and the one before it: the next batch was generated on one of them.
        self.kept = {v: w for v, w in self.kept.items() if v == before} | {self.version: weights}
        self.last = ActorUpdated(
            step=self.step,
            weight_version=self.version,
            loss=stats.loss,
            kl=stats.kl,
            clipped_fraction=stats.clipped_fraction,
            grad_norm=stats.grad_norm,
            ratio_max=stats.ratio_max,
            tokens=stats.tokens,
        )
        return self.last, True

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def fault_points(config: TrainerGroupConfig) -> FaultPoints:
    """The rank's chaos points; their marks live beside the group's state file."""
    folder = config.state_file.parent if config.state_file is not None else None
    return FaultPoints(config.fault_points, config.group, config.rank, folder)


def shard(call: ActorUpdate, rows: list[int]) -> tuple[Rollouts, list[str]]:
    """This rank's rows of the call as padded tensors, and their generating versions."""
    return padded(
        [call.tokens[i] for i in rows],
        [call.prompt_lens[i] for i in rows],
        [call.loss_masks[i] for i in rows],
        [call.token_sets[i] for i in rows],
        torch.tensor([call.advantages[i] for i in rows]),
    ), [call.versions[i] for i in rows]
