"""Token sampling keyed only by (request seed, absolute position).

The random draw for a position comes from a generator seeded with a mix of the request's seed
and the position, never from shared state, so a token does not depend on batch order, on
which step it was computed in, or on whether the request was resumed on another worker.
Knows nothing about models or scheduling.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from belayer_rl.shared.tokenizer import VOCAB_SIZE

_MASK64 = (1 << 64) - 1
LOGPROB_FLOOR = -1e30  # protocol.Logprob's bound: NaN or -inf would not cross the wire


def _splitmix64(x: int) -> int:
    """One splitmix64 round: spreads nearby (seed, position) pairs over the whole 64-bit range."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for (request seed, position); 63 bits so any torch accepts it."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


class Draw(NamedTuple):
    token: int
    # log p(token) under the distribution it was drawn from: softmax(logits / T) over the ids the
    # caller left finite (its mask). At T = 0 the draw is an argmax, and the log-probability is
    # that of softmax(logits), T = 1: a point mass would say 0 for every token.
    logprob: float


def sample(
    logits_row: torch.Tensor, seed: int, position: int, temperature: float, vocab_size: int = VOCAB_SIZE
) -> Draw:
    """Pick the token for `position` from logits_row [vocab] (padded vocab allowed).

    Ids >= vocab_size are padding and never chosen. temperature 0 is argmax; otherwise the
    exponential race argmax(p_i / E_i), E_i ~ Exp(1), which draws from softmax(logits / T).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits_row[:vocab_size].float()  # [vocab]: padding ids dropped, not just masked
    if temperature == 0:
        token = int(torch.argmax(logits))
    else:
        gen = torch.Generator().manual_seed(draw_seed(seed, position))
        noise = torch.empty(vocab_size).exponential_(generator=gen)  # [vocab], E_i ~ Exp(1)
        # log p_i - log E_i, with log p_i = logits / T up to a constant.
        token = int(torch.argmax(logits / temperature - noise.log()))
    # In float64, where logits / T stays finite even for a tiny temperature; a value below the
    # floor (or NaN, from a temperature so small that it overflows even there) is the floor.
    scaled = logits.double() / (temperature or 1.0)  # [vocab]
    logprob = float(torch.log_softmax(scaled, dim=0)[token])
    return Draw(token, logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR)
