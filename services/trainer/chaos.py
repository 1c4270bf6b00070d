"""Chaos for trainer groups: a printed, seeded schedule of real signals to group workers.

A spec is a comma-separated list of `GROUP@STEP:ACTION`, for example `actor@3:kill,reward@5:kill,
actor@7:stop`: at step STEP (once the trainer has finished STEP steps), after a seeded delay into
the step, SIGKILL (`kill`) or SIGSTOP (`stop`, a hang) goes to a seeded rank of GROUP. The same
seed gives the same delays and ranks, so a schedule is repeatable and its printout says all.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
from dataclasses import dataclass
from typing import Protocol

SPEC = re.compile(r"(actor|reference|reward)@(\d+):(kill|stop)")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    group: str
    step: int
    action: str
    delay_s: float  # after the trainer reached `step`
    rank_draw: float  # in [0, 1): which rank, once the group's size is known

    def __str__(self) -> str:
        return f"{self.action} {self.group} {self.delay_s:.3f} s into step {self.step} (rank draw {self.rank_draw:.3f})"


def schedule(spec: str, seed: int, max_delay_s: float = 1.0) -> list[Fault]:
    rng = random.Random(seed)
    faults = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        match = SPEC.fullmatch(part)
        if match is None:
            raise ValueError(
                f"--chaos: {part!r} is not GROUP@STEP:ACTION (actor|reference|reward, kill|stop)"
            )
        group, step, action = match.group(1), int(match.group(2)), match.group(3)
        faults.append(Fault(group, step, action, rng.uniform(0, max_delay_s), rng.random()))
    return sorted(faults, key=lambda f: (f.step, f.delay_s))


class Target(Protocol):
    name: str
    pids: list[int]


class Running(Protocol):
    step: int

    def groups_by_name(self) -> dict[str, Target]: ...


async def inject(trainer: Running, faults: list[Fault], log: list[str]) -> None:
    """Carry out `faults` against `trainer`'s groups; each one done is appended to `log`."""
    for fault in faults:
        while trainer.step < fault.step:  # noqa: ASYNC110 (the trainer has no event for it)
            await asyncio.sleep(0.01)
        await asyncio.sleep(fault.delay_s)
        group = trainer.groups_by_name().get(fault.group)
        if group is None or not group.pids:
            log.append(f"skipped ({fault.group} is not running): {fault}")
            continue
        rank = int(fault.rank_draw * len(group.pids))
        pid = group.pids[rank]
        try:
            os.kill(pid, SIGNALS[fault.action])
            log.append(f"{fault}: rank {rank}, pid {pid}")
        except ProcessLookupError:
            log.append(f"missed (pid {pid} already gone): {fault}")
