"""Paged KV cache over one arena tensor.

The arena is a single tensor [n_layers, 2 (K, V), num_blocks, block_size, n_heads, head_dim]
(shared/presets.py `arena_shape`) so that a process other than the worker (the kv-server) can
own it and hand it in. This module only writes and gathers token slots; which blocks belong to
which sequence is the block manager's business, and it knows nothing about scheduling. It
satisfies model.py's `KVCache` protocol without importing model.py.
"""

from __future__ import annotations

import torch

from belayer_rl.shared.presets import ModelConfig, arena_shape


def allocate_arena(config: ModelConfig, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed float32 arena for `config` (zeroed so a stale-slot bug reads zeros, not noise)."""
    return torch.zeros(arena_shape(config, num_blocks, block_size), dtype=torch.float32)


class PagedKVCache:
    """Write and read K/V of token slots; slot = block * block_size + offset in block."""

    def __init__(self, config: ModelConfig, arena: torch.Tensor) -> None:
        if arena.dim() != 6:
            raise ValueError(f"arena must have 6 dims, got shape {tuple(arena.shape)}")
        n_layers, _, num_blocks, block_size, n_heads, head_dim = arena.shape
        expected = arena_shape(config, num_blocks, block_size)
        if tuple(arena.shape) != expected or arena.dtype != torch.float32:
            raise ValueError(
                f"arena is {arena.dtype}{tuple(arena.shape)}, expected float32{expected} "
                "[n_layers, 2, num_blocks, block_size, n_heads, head_dim]"
            )
        if not arena.is_contiguous():
            raise ValueError("arena must be contiguous")
        self.config = config
        self.arena = arena
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Per layer, K and V as flat slot-major views [num_blocks * block_size, H, hd]: a write
        # is then one index_copy_ and a gather one index_select, with no per-token Python.
        self._k = [arena[i, 0].view(-1, n_heads, head_dim) for i in range(n_layers)]
        self._v = [arena[i, 1].view(-1, n_heads, head_dim) for i in range(n_layers)]
        self._blocks = [arena[i].view(2, num_blocks, -1) for i in range(n_layers)]

    def slots(self, block_table: list[int], start: int, n: int) -> list[int]:
        """Flat slots of positions [start, start + n) of a sequence with `block_table`."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, H, hd] at `slots` [N] int64 of `layer`."""
        self._k[layer].index_copy_(0, slots, k)
        self._v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, length) of one sequence, each [length, H, hd], contiguous.

        block_table [n_blocks] int64. Only the blocks that hold those positions are copied.
        """
        n_blocks = -(-length // self.block_size)
        # [2, n_blocks, block_size * H * hd]: K and V of the used blocks in one index_select.
        kv = self._blocks[layer].index_select(1, block_table[:n_blocks])
        kv = kv.view(2, n_blocks * self.block_size, self.config.n_heads, self.config.head_dim)
        # Views into one fresh copy: K starts at the allocation and V at a whole number of
        # blocks after it, so prefixes keys[:p+1] have the same strides and alignment whatever
        # `length` was, which exact attention relies on.
        return kv[0, :length], kv[1, :length]
