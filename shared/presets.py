"""The model shapes every service agrees on: `ModelConfig`, the named presets, the name -> shape
table of the weights and the shape of an engine's KV arena.

Part of the contract: the weight server checks weights against a preset, the KV server sizes
arenas from one, and the worker builds its engine from one, so the description lives here and not
with any of them. Pure description: no tensors and no torch. The weights as tensors (checking,
initialisation, files) are shared/params.py; the forward pass is shared/model.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# 257 real tokens (256 bytes + EOS), padded to a multiple of 64 for friendlier GEMM shapes.
PADDED_VOCAB = 320


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = PADDED_VOCAB
    n_layers: int = 2
    n_heads: int = 2
    d_model: int = 64
    d_ff: int = 256
    max_seq_len: int = 512

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "n_heads", "d_model", "d_ff", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # ~0.2M params: unit tests.
    "tiny": ModelConfig(n_layers=2, n_heads=2, d_model=64, d_ff=256, max_seq_len=512),
    # tiny's shape with 4,096 positions: multi-turn agent contexts (the "shell" workload). A preset of
    # its own, so tiny's weights and the figures measured on it stay as they are.
    "tiny-4k": ModelConfig(n_layers=2, n_heads=2, d_model=64, d_ff=256, max_seq_len=4096),
    # ~6.4M params.
    "small": ModelConfig(n_layers=6, n_heads=4, d_model=288, d_ff=1152, max_seq_len=1024),
    # ~25M params.
    "medium": ModelConfig(n_layers=8, n_heads=8, d_model=512, d_ff=2048, max_seq_len=1024),
    # ~87M params (GPT-2 small shape).
    "base": ModelConfig(n_layers=12, n_heads=12, d_model=768, d_ff=3072, max_seq_len=2048),
}


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the model reads. Linear weights are stored [d_in, d_out]."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "tok_emb": (v, d),
        "pos_emb": (config.max_seq_len, d),
    }
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "ln1.weight": (d,),
            p + "ln1.bias": (d,),
            p + "attn.wqkv": (d, 3 * d),
            p + "attn.wo": (d, d),
            p + "ln2.weight": (d,),
            p + "ln2.bias": (d,),
            p + "mlp.w1": (d, f),
            p + "mlp.w2": (f, d),
        }
    shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head": (d, v)}
    return shapes


def count_params(config: ModelConfig) -> int:
    return sum(math.prod(s) for s in param_shapes(config).values())


def arena_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The KV arena of an engine: [n_layers, 2 (K, V), num_blocks, block_size, n_heads, head_dim],
    float32. The KV server allocates it, the worker's paged cache reads and writes it."""
    return (config.n_layers, 2, num_blocks, block_size, config.n_heads, config.head_dim)
