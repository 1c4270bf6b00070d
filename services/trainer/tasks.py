"""Training workloads: items, the token sets responses are drawn from, and the reward.

Workloads the tiny preset can learn on a CPU in minutes, so that a test can tell learning from
its absence:
- `reverse`, one turn: a short digit string reversed ("37>" -> "73"), rewarded 1 for an exact
  match and 0 otherwise. Answers are drawn from the ten digits alone (the engine's
  `allowed_tokens`), so chance is 10^-length.
- `lookup`, agentic: each item is a code, and a sample is a trajectory (services/rollout/agent.py)
  whose setup hides the code in a sandbox file. The agent picks one of four actions with one token,
  reads its output, and answers with the digits; the sandbox's check rewards an exact answer. The
  prompt is the same for every code, so only an action that shows the code (one of the four) lets
  the agent answer above chance, 10^-length. `lookup-control` is the same task with every action
  replaced by one that prints a constant: nothing to learn from, so it must stay at chance.

The policy at each response token is the softmax over its turn's allowed set (`allowed_sets`).
The items are split once, by a seeded permutation, into training and held-out items: accuracy is
measured on items the trainer never saw. Pure Python: no torch, no bus.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from belayer_rl.services.rollout.workloads import DIGIT_TOKENS, DIGITS, MENU_TOKENS, Task, lookup_task
from belayer_rl.shared import tokenizer

SEPARATOR = ">"


def digit_strings(
    workload: str, length: int, held_out_fraction: float, seed: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every string of `length` digits, as (train, held out), each sorted: a seeded permutation cut
    once."""
    if not 1 <= length <= 6:
        raise ValueError(f"{workload}: length must be 1..6, got {length}")
    items = ["".join(p) for p in itertools.product(DIGITS, repeat=length)]
    random.Random(seed).shuffle(items)
    cut = max(1, int(len(items) * held_out_fraction))
    return tuple(sorted(items[cut:])), tuple(sorted(items[:cut]))


@dataclass(frozen=True)
class ReverseDigits:
    length: int = 2
    held_out_fraction: float = 0.2
    split_seed: int = 0
    train: tuple[str, ...] = field(init=False)
    held_out: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        train, held_out = digit_strings("reverse", self.length, self.held_out_fraction, self.split_seed)
        object.__setattr__(self, "train", train)
        object.__setattr__(self, "held_out", held_out)

    @property
    def name(self) -> str:
        return f"reverse-{self.length}"

    @property
    def allowed_tokens(self) -> tuple[int, ...]:
        return DIGIT_TOKENS

    @property
    def allowed_sets(self) -> tuple[tuple[int, ...], ...]:
        return (DIGIT_TOKENS,)

    @property
    def answer_tokens(self) -> int:
        return self.length

    @property
    def chance(self) -> float:
        return 10.0**-self.length

    def prompt_tokens(self, item: str) -> list[int]:
        return tokenizer.encode(item + SEPARATOR)

    def reward(self, item: str, answer: list[int]) -> float:
        return 1.0 if tokenizer.decode(answer) == item[::-1] else 0.0


@dataclass(frozen=True)
class Lookup:
    length: int = 3
    control: bool = False  # every action prints the same constant: the agent cannot see the code
    held_out_fraction: float = 0.2
    split_seed: int = 0
    train: tuple[str, ...] = field(init=False)
    held_out: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        train, held_out = digit_strings("lookup", self.length, self.held_out_fraction, self.split_seed)
        object.__setattr__(self, "train", train)
        object.__setattr__(self, "held_out", held_out)

    @property
    def name(self) -> str:
        return f"lookup{'-control' if self.control else ''}-{self.length}"

    @property
    def allowed_sets(self) -> tuple[tuple[int, ...], ...]:
        return (MENU_TOKENS, DIGIT_TOKENS)

    @property
    def chance(self) -> float:
        return 10.0**-self.length

    def rollout_task(self, item: str) -> Task:
        return lookup_task(item, control=self.control)

    def reward(self, item: str, answer: list[int]) -> float:
        """Scored again from a trajectory's tokens after its prompt (the reward group's work),
        without the sandbox: the answer is the `length` digits that end the line before the check's
        score; the reward, the fraction of them right in place, as the check computes it."""
        lines = tokenizer.decode(answer).split("\n")  # ..., "<action output><answer>", "<score>", ""
        given = lines[-3][-self.length :] if len(lines) >= 3 else ""
        if len(given) != self.length or not given.isdigit():
            return 0.0
        return sum(a == b for a, b in zip(given, item, strict=True)) / self.length


TrainTask = ReverseDigits | Lookup
WORKLOADS: dict[str, type[TrainTask]] = {"reverse": ReverseDigits, "lookup": Lookup}


def workload(name: str, length: int | None = None) -> TrainTask:
    """The workload named, with `length` digits per item (None: its own default)."""
    if name == "lookup-control":
        return Lookup(control=True) if length is None else Lookup(length=length, control=True)
    if name not in WORKLOADS:
        raise ValueError(f"--workload {name!r} unknown; one of {sorted([*WORKLOADS, 'lookup-control'])}")
    return WORKLOADS[name]() if length is None else WORKLOADS[name](length=length)
