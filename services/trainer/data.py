"""Where the trainer is in its data: an (epoch, index) position over a seeded order per epoch.

Taking a batch is a pure function of the items, the seed and the position, so a trainer that
resumes from a checkpoint's position takes exactly the prompts it would have taken: none trained
twice, none skipped, across epoch boundaries too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec


class DataPosition(msgspec.Struct, frozen=True):
    epoch: int = 0
    index: int = 0  # items of this epoch's order already taken


def epoch_order(items: Sequence[str], seed: int, epoch: int) -> list[str]:
    order = list(items)
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def take(items: Sequence[str], seed: int, position: DataPosition, n: int) -> tuple[list[str], DataPosition]:
    """The next `n` items from `position` and the position after them."""
    if not items:
        raise ValueError("no items to train on")
    taken: list[str] = []
    epoch, index = position.epoch, position.index
    while len(taken) < n:
        order = epoch_order(items, seed, epoch)
        chunk = order[index : index + n - len(taken)]
        taken += chunk
        index += len(chunk)
        if index >= len(order):
            epoch, index = epoch + 1, 0
    return taken, DataPosition(epoch, index)
