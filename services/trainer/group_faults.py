"""Chaos for a training run: a printed, seeded schedule of real faults, in every layer.

A spec is a comma-separated list of `GROUP@STEP:ACTION[@POINT]`, for example `actor@3:kill,
reward@5:kill,actor@7:stop,actor@4:kill@backward,worker@2:stop,sandbox@1:pause`, each struck during
step STEP (the step that starts once the trainer has finished STEP steps).

The trainer's groups (`actor`, `reference`, `reward`) take `kill` (SIGKILL) or `stop` (SIGSTOP, a
hang), aimed at a seeded rank of the group:

- without a POINT, the trainer sends the signal a seeded delay into the step;
- with one, the rank sends it to itself when its work reaches that point of the step: `forward`
  (the first forward pass of the call), `backward` (inside the first backward pass), `publish`
  (the new state saved, the weights not yet at the weight server) or `state-write` (the group's
  state file half-written); the last two are rank 0's, which alone saves and publishes. The
  reference and the reward have only `forward`.

A point fires once: the rank leaves a mark beside the group's state file before it signals, so the
rebuilt group, or a step replayed after a reschedule, runs through it. The same seed gives the
same delays and ranks, so a schedule is repeatable and its printout says all.

The rollout side's faults (ROLLOUT_ACTIONS) are struck by cli/chaos/training.py at
whatever the step has in flight: `worker` (kill, stop: a serving engine's main), `router` (kill,
stop: the lease holder), `sandbox` (kill, pause: a running trajectory's container), `checkpointer`
(kill) and `nats` (restart: the nats-server killed and started again).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

POINTS = {"actor": ("forward", "backward", "publish", "state-write"), "reference": ("forward",),
          "reward": ("forward",)}  # fmt: skip
ROLLOUT_ACTIONS = {"worker": ("kill", "stop"), "router": ("kill", "stop"), "sandbox": ("kill", "pause"),
                   "checkpointer": ("kill",), "nats": ("restart",)}  # fmt: skip
ROLLOUT_MAX_DELAY_S = 0.2
SPEC = re.compile(r"([a-z]+)@(\d+):([a-z]+)(?:@([a-z-]+))?")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
RANK_ZERO_POINTS = ("publish", "state-write")  # rank 0 alone saves and publishes


@dataclass(frozen=True)
class Fault:
    group: str
    step: int
    action: str
    delay_s: float  # after the trainer reached `step` (no point); unused with a point
    rank_draw: float  # in [0, 1): which rank, once the group's size is known
    point: str = ""  # a named point of the rank's work, or "" for a timed signal from the trainer

    @property
    def rollout(self) -> bool:
        return self.group in ROLLOUT_ACTIONS

    def rank(self, world: int) -> int:
        return 0 if self.point in RANK_ZERO_POINTS else int(self.rank_draw * world)

    def __str__(self) -> str:
        if self.rollout:
            return f"{self.action} {self.group} {self.delay_s:.3f} s into step {self.step}, at work in flight"
        if self.point:
            return f"{self.action} {self.group} at {self.point} of step {self.step} (rank draw {self.rank_draw:.3f})"
        return f"{self.action} {self.group} {self.delay_s:.3f} s into step {self.step} (rank draw {self.rank_draw:.3f})"


def schedule(spec: str, seed: int, max_delay_s: float = 1.0) -> list[Fault]:
    rng = random.Random(seed)
    faults = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        match = SPEC.fullmatch(part)
        if match is None:
            raise ValueError(f"--chaos: {part!r} is not GROUP@STEP:ACTION[@POINT]")
        group, step, action, point = match.group(1), int(match.group(2)), match.group(3), match.group(4) or ""
        actions = ROLLOUT_ACTIONS.get(group) or (("kill", "stop") if group in POINTS else None)
        if actions is None:
            raise ValueError(
                f"--chaos: {part!r}: no group {group!r}; choose from {', '.join([*POINTS, *ROLLOUT_ACTIONS])}"
            )
        if action not in actions:
            raise ValueError(f"--chaos: {part!r}: {group} takes {', '.join(actions)}")
        if point and point not in POINTS.get(group, ()):
            raise ValueError(
                f"--chaos: {part!r}: {group} has the points {', '.join(POINTS.get(group, ())) or '(none)'}"
            )
        # The rollout side's faults come sooner: a step's generations may all end within a second.
        delay_s = rng.uniform(0, ROLLOUT_MAX_DELAY_S if group in ROLLOUT_ACTIONS else max_delay_s)
        faults.append(Fault(group, step, action, delay_s, rng.random(), point))
    return sorted(faults, key=lambda f: (f.step, f.delay_s))


def world_of(group: str, actor_world: int) -> int:
    return actor_world if group == "actor" else 1  # the reference and the reward: one process


def armed(faults: list[Fault], actor_world: int) -> str:
    """The groups' `fault_points` setting: GROUP:RANK:STEP:POINT:ACTION, comma-separated."""
    return ",".join(
        f"{f.group}:{f.rank(world_of(f.group, actor_world))}:{f.step}:{f.point}:{f.action}"
        for f in faults
        if f.point
    )


def mark(folder: Path, group: str, rank: int, step: int, point: str) -> Path:
    return folder / f"chaos-fired-{group}-{rank}-{step}-{point}"


def fired(fault: Fault, folder: Path, actor_world: int) -> Path | None:
    """The mark the rank left when it reached `fault`'s point and signalled itself (its time is
    when), or None; `folder` holds the groups' state files."""
    rank = fault.rank(world_of(fault.group, actor_world))
    path = mark(folder, fault.group, rank, fault.step, fault.point)
    return path if path.exists() else None


class FaultPoints:
    """A rank's armed points (its side of the schedule): `reached` signals the process itself."""

    def __init__(self, spec: str, group: str, rank: int, folder: Path | None) -> None:
        self.group, self.rank, self.folder = group, rank, folder
        self.armed: dict[tuple[int, str], str] = {}
        for entry in filter(None, spec.split(",")):
            at_group, at_rank, step, point, action = entry.split(":")
            if at_group == group and int(at_rank) == rank:
                self.armed[(int(step), point)] = action

    def reached(self, step: int, point: str) -> None:
        action = self.armed.get((step, point))
        if action is None or self.folder is None:
            return
        marker = mark(self.folder, self.group, self.rank, step, point)
        if marker.exists():
            return
        with marker.open("w") as f:  # durable before the signal: the rebuilt rank must see it
            f.write(f"{action} pid {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), SIGNALS[action])


class Target(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def pids(self) -> list[int]: ...


class Running(Protocol):
    step: int

    def groups_by_name(self) -> Mapping[str, Target]: ...


async def inject(trainer: Running, faults: list[Fault], report: Callable[[str], None]) -> None:
    """Carry out the timed `faults` (those without a point) against `trainer`'s groups; `report` is
    told of each as it is done."""
    for fault in (f for f in faults if not f.point and not f.rollout):
        while trainer.step < fault.step:  # noqa: ASYNC110 (the trainer has no event for it)
            await asyncio.sleep(0.01)
        await asyncio.sleep(fault.delay_s)
        group = trainer.groups_by_name().get(fault.group)
        if group is None or not group.pids:
            report(f"skipped ({fault.group} is not running): {fault}")
            continue
        rank = fault.rank(len(group.pids))
        pid = group.pids[rank]
        try:
            os.kill(pid, SIGNALS[fault.action])
            report(f"{fault}: rank {rank}, pid {pid}")
        except ProcessLookupError:
            report(f"missed (pid {pid} already gone): {fault}")
