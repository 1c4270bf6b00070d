"""A small decoder-only transformer written as plain functions over a flat params dict.

Pre-norm blocks, learned absolute positions, GELU MLP, no biases in the linears. The weights
are a `dict[str, Tensor]` that this module only reads, so a caller can hand in tensors mapped
read-only from shared memory without a copy. Only the forward pass: the config, presets and
parameter shapes are the contract's (shared/presets.py), and so are creating, checking and saving
weights (shared/params.py). Knows nothing about tokenization, scheduling or sampling: `forward`
runs whatever rows the caller packed into a `ForwardBatch` and returns logits for the rows it asks
for.

Two services run it: the worker's engine to generate and the trainer's actor to learn. A sample's
log-probabilities must be the same on both sides, so both take it from here.

Deterministic mode: every matmul whose row count depends on the batch is done as a `bmm` of
per-row `[1, d_in] @ [d_in, d_out]` products, and attention runs per query over exactly
`keys[0:pos+1]`, so a position's logits are bitwise the same whatever it is batched with and
whether it is reached by decode or by a (chunked) prefill. tests/engine checks this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from belayer_rl.shared.params import Params
from belayer_rl.shared.presets import ModelConfig

# ---------------------------------------------------------------------------- cache


class KVCache(Protocol):
    """What `forward` needs of a KV cache: services/worker/kv_cache.py's PagedKVCache is one. A
    protocol here, so that this module does not import the cache and the cache does not import it."""

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, H, hd] at `slots` [N] int64 of `layer`."""
        ...

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, length) of one sequence, each [length, H, hd], contiguous and
        position-major, from block_table [n_blocks] int64."""
        ...


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
    q_pos = torch.arange(pos, pos + n, device=q.device).unsqueeze(1)  # [n, 1]
    mask = torch.arange(pos + n, device=q.device).unsqueeze(0) <= q_pos  # [n, pos+n]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=1.0)
    return out.transpose(0, 1)  # [n, H, hd]


def forward(
    params: Params,
    config: ModelConfig,
    batch: ForwardBatch,
    cache: KVCache,
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
        att = torch.empty(n_rows, H, hd, device=x.device)
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


# ---------------------------------------------------------------------------- training


def sequence_logits(params: Params, config: ModelConfig, tokens: torch.Tensor) -> torch.Tensor:
    """Whole sequences at once, no cache, differentiable: tokens [B, T] int64 -> logits [B, T, vocab].

    The same network as `forward` (what the trainer differentiates is what the engine samples
    from), computed the fast way: one causal attention per layer over the padded batch. Logits
    agree with `forward`'s to float32 rounding, not bitwise; a sample's old log-probabilities are
    recomputed here, never taken from the engine, so the ratio is exact at equal weights.
    """
    B, T = tokens.shape
    H, hd = config.n_heads, config.head_dim
    x = params["tok_emb"][tokens] + params["pos_emb"][:T]  # [B, T, d]
    for layer in range(config.n_layers):
        p = f"layers.{layer}."
        h = F.layer_norm(x, (config.d_model,), params[p + "ln1.weight"], params[p + "ln1.bias"])
        q, k, v = (h @ params[p + "attn.wqkv"]).view(B, T, 3, H, hd).unbind(2)  # each [B, T, H, hd]
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, T, hd]
        x = x + att.transpose(1, 2).reshape(B, T, -1) @ params[p + "attn.wo"]
        h = F.layer_norm(x, (config.d_model,), params[p + "ln2.weight"], params[p + "ln2.bias"])
        x = x + F.gelu(h @ params[p + "mlp.w1"]) @ params[p + "mlp.w2"]
    x = F.layer_norm(x, (config.d_model,), params["ln_f.weight"], params["ln_f.bias"])
    return x @ params["lm_head"]  # [B, T, vocab]
