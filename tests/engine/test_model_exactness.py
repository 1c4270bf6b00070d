"""Bitwise decode-vs-prefill and batch invariance of the model's deterministic mode.

Uses seeded random weights (never a context-blind mock): the property only means something
when logits depend on every earlier token.
"""

import pytest
import torch

from belayer_rl.services.worker.block_manager import BlockManager
from belayer_rl.services.worker.kv_cache import PagedKVCache, allocate_arena
from belayer_rl.shared.model import ForwardBatch, SeqRows, forward
from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS

CONFIG = PRESETS["tiny"]
BLOCK = 16


class Runner:
    """Feeds chunks of several sequences through `forward`, collecting logits of every row."""

    def __init__(self, deterministic: bool = True) -> None:
        self.params = init_params(CONFIG, seed=3)
        self.cache = PagedKVCache(CONFIG, allocate_arena(CONFIG, num_blocks=64, block_size=BLOCK))
        self.blocks = BlockManager(64, BLOCK)
        self.n_cached: dict[str, int] = {}
        self.deterministic = deterministic

    def add(self, key: str, max_len: int) -> None:
        self.blocks.allocate(key, max_len)
        self.n_cached[key] = 0

    def run(self, chunks: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """chunks: (key, tokens to append). Returns key -> logits [n, vocab] of those tokens."""
        tokens, positions, slots, rows = [], [], [], []
        for key, toks in chunks:
            start, table = self.n_cached[key], self.blocks.block_table(key)
            rows.append(SeqRows(len(tokens), len(toks), start, torch.tensor(table)))
            tokens += toks
            positions += range(start, start + len(toks))
            slots += self.cache.slots(table, start, len(toks))
            self.n_cached[key] += len(toks)
        batch = ForwardBatch(
            tokens=torch.tensor(tokens),
            positions=torch.tensor(positions),
            slots=torch.tensor(slots),
            seqs=rows,
            logit_rows=torch.arange(len(tokens)),
        )
        with torch.inference_mode():
            logits = forward(self.params, CONFIG, batch, self.cache, self.deterministic)
        return {key: logits[r.row : r.row + r.n] for (key, _), r in zip(chunks, rows, strict=True)}


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode_logits(seq: list[int]) -> torch.Tensor:
    """Reference: the sequence fed one token per step, alone. [len, vocab]."""
    r = Runner()
    r.add("s", len(seq))
    return torch.cat([r.run([("s", [t])])["s"] for t in seq])


SEQ = _tokens(0, 70)


@pytest.mark.parametrize("chunk", [2, 5, 16, 17, 70])
def test_chunked_prefill_logits_bitwise_equal_decode(chunk):
    ref = _decode_logits(SEQ)
    r = Runner()
    r.add("s", len(SEQ))
    got = torch.cat([r.run([("s", SEQ[i : i + chunk])])["s"] for i in range(0, len(SEQ), chunk)])
    assert torch.equal(got, ref)


def test_mixed_prefill_then_decode_bitwise_equal_with_other_sequences_in_batch():
    ref = _decode_logits(SEQ)
    r = Runner()
    for key in ("s", "o1", "o2", "o3"):
        r.add(key, 128)
    others = {k: _tokens(i + 10, 100) for i, k in enumerate(("o1", "o2", "o3"))}
    got = []
    # A prefill of 23 tokens beside other sequences' prefills, then odd chunks, then decode
    # steps where the partners change from step to step.
    got.append(r.run([("o1", others["o1"][:40]), ("s", SEQ[:23]), ("o2", others["o2"][:7])])["s"])
    got.append(r.run([("s", SEQ[23:31]), ("o3", others["o3"][:50])])["s"])
    for i in range(31, len(SEQ)):
        chunks = [("s", [SEQ[i]])]
        if i % 2:
            chunks.insert(0, ("o1", [others["o1"][r.n_cached["o1"]]]))
        if i % 3 == 0:
            chunks.append(("o2", others["o2"][r.n_cached["o2"] : r.n_cached["o2"] + 3]))
        got.append(r.run(chunks)["s"])
    assert torch.equal(torch.cat(got), ref)


def test_logits_depend_on_every_context_token():
    """Guards the tests above against a model that ignores its context."""
    ref = _decode_logits(SEQ)
    mutated = list(SEQ)
    mutated[0] = (mutated[0] + 1) % 257
    other = _decode_logits(mutated)
    diff = (ref - other).abs().amax(dim=-1)  # [len]
    assert bool((diff > 1e-3).all())


def test_non_deterministic_mode_is_close_to_deterministic():
    ref = _decode_logits(SEQ)
    r = Runner(deterministic=False)
    r.add("s", len(SEQ))
    got = torch.cat([r.run([("s", SEQ[i : i + 16])])["s"] for i in range(0, len(SEQ), 16)])
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
