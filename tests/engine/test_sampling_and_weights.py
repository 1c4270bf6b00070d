import math

import torch
from engine_helpers import drain

from belayer_rl.services.worker.engine import Engine, EngineConfig, SeqSpec
from belayer_rl.services.worker.sampling import sample
from belayer_rl.shared.params import init_params, load_params, save_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.tokenizer import VOCAB_SIZE


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(320, generator=torch.Generator().manual_seed(seed))


def test_sample_is_keyed_by_seed_and_position_only():
    logits = _logits(0)
    draws = [sample(logits, seed=5, position=p, temperature=0.8).token for p in range(50)]
    # Same keys in another order (as in a different batch) give the same tokens.
    again = [sample(logits, seed=5, position=p, temperature=0.8).token for p in reversed(range(50))]
    assert draws == again[::-1]
    other_seed = [sample(logits, seed=6, position=p, temperature=0.8).token for p in range(50)]
    assert draws != other_seed
    assert len(set(draws)) > 3  # positions really get different draws


def test_temperature_zero_is_argmax_and_padding_is_never_sampled():
    logits = _logits(1)
    logits[VOCAB_SIZE:] = 1e6  # padding ids look best, yet must never come out
    assert sample(logits, seed=0, position=0, temperature=0.0).token == int(logits[:VOCAB_SIZE].argmax())
    draws = {sample(logits, seed=0, position=p, temperature=5.0).token for p in range(200)}
    assert max(draws) < VOCAB_SIZE


def test_save_load_round_trip_and_versions(tmp_path):
    params = init_params(PRESETS["tiny"], seed=4)
    path = tmp_path / "w.pt"
    version = save_params(params, path)
    loaded, loaded_version = load_params(path)
    assert loaded_version == version
    assert version.startswith("sha256:")
    assert all(torch.equal(loaded[k], params[k]) for k in params)

    spec = SeqSpec("a", [1, 2, 3], [], 10, seed=1, temperature=0.8)
    from_file = Engine(EngineConfig(weights_path=path))
    seeded = Engine(EngineConfig(weights_seed=4))
    assert from_file.weight_version == version
    assert seeded.weight_version == "seed:4:tiny"
    from_file.submit(spec)
    seeded.submit(spec)
    assert drain(from_file) == drain(seeded)


def test_init_params_is_seeded():
    a = init_params(PRESETS["tiny"], seed=1)
    b = init_params(PRESETS["tiny"], seed=1)
    c = init_params(PRESETS["tiny"], seed=2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head"], c["lm_head"])


def test_a_logprob_is_that_of_the_distribution_the_token_was_drawn_from():
    """Over many positions of one logits row, masked to five ids at temperature 0.5, each id comes
    out as often as exp(its logprob) says. Mutation check: logprobs reported at temperature 1 (the
    unscaled distribution) give id 40 a probability of 0.231 where it is drawn 0.201 of the time."""
    logits = _logits(2)
    allowed = [3, 40, 41, 200, 256]
    masked = torch.full_like(logits, -math.inf)
    masked[allowed] = logits[allowed]
    draws = [sample(masked, seed=9, position=p, temperature=0.5) for p in range(4000)]
    logprob = {d.token: d.logprob for d in draws}
    assert logprob.keys() <= set(allowed)
    assert math.isclose(sum(math.exp(x) for x in logprob.values()), 1.0, abs_tol=1e-3)  # all likely ids drawn
    for token, x in logprob.items():
        p, seen = math.exp(x), sum(d.token == token for d in draws) / len(draws)
        assert abs(seen - p) < 4 * math.sqrt(p * (1 - p) / len(draws)), (token, seen, p)
    # Greedy: the argmax, with its log-probability under softmax(logits) over the allowed ids.
    greedy = sample(masked, seed=9, position=0, temperature=0.0)
    assert greedy.token == allowed[int(logits[allowed].argmax())]
    assert math.isclose(greedy.logprob, float(torch.log_softmax(logits[allowed], dim=0).max()), rel_tol=1e-6)


def test_engine_logprobs_equal_the_trainers_old_logp_and_survive_a_resume(tiny_params):
    """The engine's logprob of each token is the quantity the trainer computes as old_logp (the
    softmax at temperature 1 over the allowed ids), to float32 rounding: the trainer's forward
    pass is the batched one. A resumed sequence gives the same logprobs bitwise."""
    from belayer_rl.services.trainer.actor import token_logprobs

    allowed = tuple(range(48, 58))  # the digits
    prompt = list(b"3 + 4 = ")
    spec = SeqSpec("a", prompt, [], 12, seed=4, temperature=1.0, allowed_tokens=allowed)
    engine = Engine(EngineConfig(preset="tiny"), tiny_params)
    engine.submit(spec)
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_work():
        for event in engine.step():
            tokens += event.new_tokens
            logprobs += event.new_logprobs
    assert len(logprobs) == len(tokens) == 12

    sequence = torch.tensor([prompt + tokens])  # [1, S]
    token_sets = torch.zeros(1, sequence.shape[1] - 1, dtype=torch.long)
    token_sets[0, len(prompt) - 1 :] = 1  # positions that predict a generated token use the set
    trainer = token_logprobs(tiny_params, PRESETS["tiny"], sequence, (allowed,), token_sets)[
        0, len(prompt) - 1 :
    ]
    assert torch.allclose(torch.tensor(logprobs), trainer, atol=1e-5), (logprobs, trainer.tolist())

    resumed = Engine(EngineConfig(preset="tiny"), tiny_params)
    resumed.submit(SeqSpec("a", prompt, tokens[:5], 12, seed=4, temperature=1.0, allowed_tokens=allowed))
    tail: list[float] = []
    while resumed.has_work():
        for event in resumed.step():
            tail += event.new_logprobs
    assert tail == logprobs[5:]


def test_a_logprob_is_always_one_the_wire_carries():
    """A temperature so small that logits / T overflows in float32, and a row whose every logit is
    masked: the logprob is finite and within the wire's bound, never NaN (which would cost a
    worker's whole frame at the router). Mutation check: without the floor, the masked row's -inf
    is refused by the frame's decoder."""
    from belayer_rl.shared import protocol

    logits = _logits(3)
    masked = torch.full_like(logits, -math.inf)
    for row, temperature in ((logits, 1e-39), (logits, 1e-300), (masked, 0.7), (masked, 0.0)):
        draw = sample(row, seed=1, position=2, temperature=temperature)
        frame = protocol.FrameSeq("r", 1, 0, [draw.token], [draw.logprob])
        again = protocol.decode(protocol.decoder_for(protocol.WorkerFrame),
                                protocol.encode(protocol.WorkerFrame(epoch=1, engine_id="e0", seqs=[frame])))  # fmt: skip
        assert math.isfinite(draw.logprob) and again.seqs[0].logprobs == [draw.logprob], (temperature, draw)
