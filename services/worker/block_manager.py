"""Paged KV-cache block allocator: which arena blocks belong to which sequence.

Pure bookkeeping over block ids; knows nothing about tensors, models or scheduling policy.
A sequence gets all the blocks it will ever need in one `allocate` call (the engine reserves
prompt + budget at admission), so a running sequence never has to grow or be preempted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockManager:
    """Fixed pool of `num_blocks` blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO free list: freed blocks go to the back, so recently freed blocks are reused
        # last, which keeps stale-KV bugs from hiding behind a lucky reuse of the same block.
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[Hashable, list[int]] = {}

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that hold `n_tokens` token slots (ceil division)."""
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_tokens: int) -> bool:
        return self.blocks_needed(n_tokens) <= len(self._free)

    def fits_at_all(self, n_tokens: int) -> bool:
        """Whether `n_tokens` could ever be allocated, i.e. fits in the whole, empty pool."""
        return self.blocks_needed(n_tokens) <= self.num_blocks

    def block_table(self, key: Hashable) -> list[int]:
        """The blocks of sequence `key`, in token order (slot i lives in table[i // block_size])."""
        return self._tables[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._tables

    # ------------------------------------------------------------------ changes

    def allocate(self, key: Hashable, n_tokens: int) -> list[int]:
        """Reserve blocks for `n_tokens` slots for a new sequence `key`; returns its block table."""
        if key in self._tables:
            raise ValueError(f"sequence {key!r} already holds blocks")
        need = self.blocks_needed(n_tokens)
        if need > len(self._free):
            raise MemoryError(
                f"sequence {key!r} needs {need} blocks, only {len(self._free)} of {self.num_blocks} are free"
            )
        table = [self._free.popleft() for _ in range(need)]
        self._tables[key] = table
        return table

    def free(self, key: Hashable) -> None:
        """Return all blocks of `key` to the pool. Freeing an unknown key is an error."""
        table = self._tables.pop(key)  # KeyError on double free: a scheduler bug, fail loudly
        self._free.extend(table)
