"""A small decoder-only transformer written as plain functions over a flat params dict.

Pre-norm blocks, learned absolute positions, GELU MLP, no biases in the linears. The weights
are a `dict[str, Tensor]` that this module only reads, so a caller can hand in tensors mapped
read-only from shared memory without a copy. Knows nothing about tokenization, scheduling or
sampling: `forward` runs whatever rows the caller packed into a `ForwardBatch` and returns
logits for the rows it asks for.

Deterministic mode: every matmul whose row count depends on the batch is done as a `bmm` of
per-row `[1, d_in] @ [d_in, d_out]` products, and attention runs per query over exactly
`keys[0:pos+1]`, so a position's logits are bitwise the same whatever it is batched with and
whether it is reached by decode or by a (chunked) prefill. tests/engine checks this.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from belayer_rl.services.worker.kv_cache import PagedKVCache

Params = dict[str, torch.Tensor]

# ---------------------------------------------------------------------------- config

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


def check_params(config: ModelConfig, params: Params) -> None:
    """Raise ValueError naming the first missing, extra or misshapen tensor."""
    shapes = param_shapes(config)
    extra = sorted(set(params) - set(shapes))
    if extra:
        raise ValueError(f"unexpected tensors in params: {extra[:5]}")
    for name, shape in shapes.items():
        if name not in params:
            raise ValueError(f"params lack {name!r}")
        t = params[name]
        if tuple(t.shape) != shape or t.dtype != torch.float32:
            raise ValueError(f"params[{name!r}] is {t.dtype}{tuple(t.shape)}, expected float32{shape}")


# ---------------------------------------------------------------------------- weights


def init_params(config: ModelConfig, seed: int) -> Params:
    """Seeded random weights.

    Scaled (1/sqrt(fan_in), residual branches by 1/sqrt(2 * n_layers)) rather than a flat
    0.02, so that attention scores and logits are far from uniform even in the tiny preset:
    exactness tests need outputs that really depend on every context token.
    """
    gen = torch.Generator().manual_seed(seed)
    resid_scale = 1.0 / math.sqrt(2 * config.n_layers)
    params: Params = {}
    for name, shape in param_shapes(config).items():
        if name.endswith(".weight"):  # layer-norm gains
            params[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            params[name] = torch.zeros(shape)
        elif name in ("tok_emb", "pos_emb"):
            params[name] = torch.randn(shape, generator=gen)
        else:
            std = 1.0 / math.sqrt(shape[0])
            if name.endswith(("attn.wo", "mlp.w2")):
                std *= resid_scale
            elif name == "lm_head":
                std *= 3.0  # logits with std ~3: peaked enough that sampling follows context
            params[name] = torch.randn(shape, generator=gen) * std
    return params


def seed_version(seed: int, preset: str) -> str:
    return f"seed:{seed}:{preset}"


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()[:16]}"


def save_params(params: Params, path: Path | str) -> str:
    """Write `params` to `path`; returns the weight version a later `load_params` will report."""
    path = Path(path)
    torch.save({k: v.contiguous() for k, v in params.items()}, path)
    return _file_sha256(path)


def load_params(path: Path | str) -> tuple[Params, str]:
    """Read weights saved by `save_params`; version is the sha256 of the file content."""
    path = Path(path)
    version = _file_sha256(path)
    params = torch.load(path, map_location="cpu", weights_only=True)
    return params, version


# ---------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class SeqRows:
    """One sequence's slice of a ForwardBatch: rows [row, row + n) at positions [pos, pos + n)."""

    row: int
    n: int
    pos: int
    block_table: torch.Tensor  # [n_blocks] int64, covers at least pos + n token slots


@dataclass(frozen=True)
class ForwardBatch:
    """The tokens of one engine step, all sequences packed row after row."""

    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute position of each row in its sequence
    slots: torch.Tensor  # [N] int64, flat KV slot (block * block_size + offset) of each row
    seqs: list[SeqRows]
    logit_rows: torch.Tensor  # [M] int64, rows whose next-token logits are wanted


def _linear(x: torch.Tensor, w: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """x [N, d_in] @ w [d_in, d_out] -> [N, d_out].

    A plain GEMM rounds a row differently depending on N; a bmm of N independent
    [1, d_in] @ [d_in, d_out] products gives every row the same bits whatever N is.
    """
    if not deterministic:
        return x @ w
    n = x.shape[0]
    return torch.bmm(x.unsqueeze(1), w.expand(n, *w.shape)).squeeze(1)


def _attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """One query at position `pos` over exactly keys[0:pos+1].

    q [H, hd] (already scaled); k, v [L >= pos+1, H, hd] contiguous, position-major, so the
    prefix k[:pos+1] has the same strides and start whatever L is. Returns [H, hd].
    """
    kk = k[: pos + 1].permute(1, 2, 0)  # [H, hd, pos+1]
    vv = v[: pos + 1].permute(1, 0, 2)  # [H, pos+1, hd]
    scores = torch.bmm(q.unsqueeze(1), kk)  # [H, 1, pos+1]
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, vv).squeeze(1)  # [H, hd]


def _attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
    """Queries at positions [pos, pos + n) over keys[0:pos+n], causal. Fast, not bitwise stable.

    q [n, H, hd] (already scaled); k, v [L >= pos+n, H, hd]. Returns [n, H, hd].
    """
    n = q.shape[0]
    kk = k[: pos + n].transpose(0, 1)  # [H, pos+n, hd]
    vv = v[: pos + n].transpose(0, 1)
    q_pos = torch.arange(pos, pos + n).unsqueeze(1)  # [n, 1]
    mask = torch.arange(pos + n).unsqueeze(0) <= q_pos  # [n, pos+n]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=1.0)
    return out.transpose(0, 1)  # [n, H, hd]


def forward(
    params: Params,
    config: ModelConfig,
    batch: ForwardBatch,
    cache: PagedKVCache,
    deterministic: bool = True,
) -> torch.Tensor:
    """Run the batch, writing its K/V into `cache`; returns logits [M, vocab] for logit_rows.

    Every sequence's earlier positions [0, pos) must already be in `cache`.
    """
    H, hd = config.n_heads, config.head_dim
    scale = 1.0 / math.sqrt(hd)
    x = params["tok_emb"][batch.tokens] + params["pos_emb"][batch.positions]  # [N, d]
    n_rows = x.shape[0]
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        h = F.layer_norm(x, (config.d_model,), params[p + "ln1.weight"], params[p + "ln1.bias"])
        qkv = _linear(h, params[p + "attn.wqkv"], deterministic)  # [N, 3d]
        q, k, v = qkv.view(n_rows, 3, H, hd).unbind(1)  # each [N, H, hd]
        cache.write(layer, batch.slots, k, v)
        q = q * scale
        att = torch.empty(n_rows, H, hd)
        for s in batch.seqs:
            keys, values = cache.gather(layer, s.block_table, s.pos + s.n)  # [pos+n, H, hd]
            if deterministic:
                for i in range(s.n):
                    att[s.row + i] = _attention_exact(q[s.row + i], keys, values, s.pos + i)
            else:
                att[s.row : s.row + s.n] = _attention_batched(q[s.row : s.row + s.n], keys, values, s.pos)
        x = x + _linear(att.view(n_rows, -1), params[p + "attn.wo"], deterministic)
        h = F.layer_norm(x, (config.d_model,), params[p + "ln2.weight"], params[p + "ln2.bias"])
        h = F.gelu(_linear(h, params[p + "mlp.w1"], deterministic))  # [N, d_ff]
        x = x + _linear(h, params[p + "mlp.w2"], deterministic)
    x = x[batch.logit_rows]  # [M, d]: only rows that will be sampled pay for the head
    x = F.layer_norm(x, (config.d_model,), params["ln_f.weight"], params["ln_f.bias"])
    return _linear(x, params["lm_head"], deterministic)  # [M, vocab]
