"""Training workloads: prompts, the token set answers are drawn from, and the reward.

A workload the tiny preset can learn on a CPU in minutes, so that a test can tell learning from
its absence: `reverse` asks for a short digit string reversed ("37>" -> "73"), rewarded 1 for
an exact match and 0 otherwise. Answers are sampled from the ten digits alone (the engine's
`allowed_tokens`), so chance is 10^-length; the trainer's policy is the softmax over the same set.

The strings are split once, by a seeded permutation, into training and held-out prompts: accuracy
is measured on strings the trainer never saw. Pure Python: no torch, no bus.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from belayer_rl.shared import tokenizer

DIGITS = "0123456789"
DIGIT_TOKENS = tuple(tokenizer.encode(DIGITS))
SEPARATOR = ">"


@dataclass(frozen=True)
class ReverseDigits:
    length: int = 2
    held_out_fraction: float = 0.2
    split_seed: int = 0
    train: tuple[str, ...] = field(init=False)
    held_out: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.length <= 6:
            raise ValueError(f"reverse: length must be 1..6, got {self.length}")
        strings = ["".join(p) for p in itertools.product(DIGITS, repeat=self.length)]
        random.Random(self.split_seed).shuffle(strings)
        cut = max(1, int(len(strings) * self.held_out_fraction))
        object.__setattr__(self, "held_out", tuple(sorted(strings[:cut])))
        object.__setattr__(self, "train", tuple(sorted(strings[cut:])))

    @property
    def name(self) -> str:
        return f"reverse-{self.length}"

    @property
    def allowed_tokens(self) -> tuple[int, ...]:
        return DIGIT_TOKENS

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


WORKLOADS = {"reverse": ReverseDigits}


def workload(name: str, **options: int) -> ReverseDigits:
    if name not in WORKLOADS:
        raise ValueError(f"--workload {name!r} unknown; one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](**options)
