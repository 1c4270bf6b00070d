"""Scheduler behaviour: admission, rejection, batch invariance, resume exactness, finishing."""

import pytest
import torch
from engine_helpers import drain

from belayer_rl.services.worker.engine import (
    Engine,
    EngineConfig,
    EngineRejected,
    SeqSpec,
)
from belayer_rl.services.worker.kv_cache import allocate_arena
from belayer_rl.shared.model import sequence_logits
from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.tokenizer import EOS_TOKEN, VOCAB_SIZE, decode_bytes


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _spec(key, prompt, budget, *, prefix=(), seed=11, temperature=0.8, stop=()):
    return SeqSpec(key, list(prompt), list(prefix), budget, seed, temperature, tuple(stop))


# ---------------------------------------------------------------------------- config, rejection


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"preset": "huge"}, "preset"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"max_running": 0}, "max_running"),
        ({"max_step_tokens": 0}, "max_step_tokens"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        EngineConfig(**kwargs)
    assert field in str(err.value)


def test_rejects_context_longer_than_max_seq_len(tiny_params):
    engine = Engine(EngineConfig(), tiny_params)
    max_len = PRESETS["tiny"].max_seq_len
    with pytest.raises(EngineRejected) as err:
        engine.submit(_spec("long", _prompt(0, max_len - 10), 11))
    assert "max_seq_len" in str(err.value)
    engine.submit(_spec("fits", _prompt(0, max_len - 10), 10))  # exactly max_seq_len is fine
    assert engine.load()[1] == 1


def test_rejects_what_the_whole_arena_cannot_hold(tiny_params):
    engine = Engine(EngineConfig(num_blocks=4, block_size=16), tiny_params)
    with pytest.raises(EngineRejected) as err:
        engine.submit(_spec("big", _prompt(0, 60), 5))  # 65 tokens > 64 slots
    assert "arena" in str(err.value)
    assert not engine.has_work()


@pytest.mark.parametrize(
    "spec",
    [
        _spec("empty", [], 5),
        _spec("badtok", [1, 300], 5),
        _spec("budget", [1, 2], 0),
        _spec("prefix", [1, 2], 2, prefix=[3, 4, 5]),
        _spec("temp", [1, 2], 5, temperature=-1.0),
        _spec("eosmid", [1, 2], 5, prefix=[3, EOS_TOKEN, 4]),
    ],
)
def test_rejects_malformed_specs(tiny_params, spec):
    engine = Engine(EngineConfig(), tiny_params)
    with pytest.raises(EngineRejected):
        engine.submit(spec)
    assert not engine.has_work()


def test_rejects_duplicate_key(tiny_params):
    engine = Engine(EngineConfig(), tiny_params)
    engine.submit(_spec("a", [1, 2], 5))
    with pytest.raises(EngineRejected):
        engine.submit(_spec("a", [1, 2], 5))
    assert engine.load()[1] == 1


def test_foreign_arena_is_used_and_checked(tiny_params):
    arena = allocate_arena(PRESETS["tiny"], num_blocks=8, block_size=16)
    engine = Engine(EngineConfig(num_blocks=8), tiny_params, arena)
    engine.submit(_spec("a", _prompt(1, 20), 10))
    drain(engine)
    assert arena.abs().sum() > 0  # K/V went into the arena we handed in
    with pytest.raises(ValueError):
        Engine(EngineConfig(num_blocks=16), tiny_params, arena)


def test_weights_on_another_device_than_the_arena_are_refused(tiny_params):
    # The forward pass runs where the arena is; `meta` stands in for a GPU this machine may lack.
    elsewhere = {name: t.to("meta") for name, t in tiny_params.items()}
    arena = allocate_arena(PRESETS["tiny"], num_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="weights are on meta, the KV arena on cpu"):
        Engine(EngineConfig(num_blocks=8), elsewhere, arena)
    engine = Engine(EngineConfig(num_blocks=8), tiny_params, arena)
    with pytest.raises(ValueError, match="weights are on meta"):
        engine.add_weights("v2", elsewhere)


# ---------------------------------------------------------------------------- admission control


def test_arena_too_small_for_all_queues_and_everyone_finishes(no_eos_params):
    # 8 blocks of 16 slots; each request reserves 30 + 20 = 50 slots = 4 blocks: 2 fit at once.
    engine = Engine(EngineConfig(num_blocks=8, block_size=16), no_eos_params)
    for i in range(7):
        engine.submit(_spec(i, _prompt(i, 30), 20, seed=i))
    assert engine.load() == (0, 7, 140)
    max_running = 0
    results = {}
    while engine.has_work():
        for ev in engine.step():
            results.setdefault(ev.key, []).extend(ev.new_tokens)
        running, _, _ = engine.load()
        max_running = max(max_running, running)
        assert engine.blocks.num_free >= 0
    assert max_running == 2
    assert sorted(results) == list(range(7))
    assert all(len(toks) == 20 for toks in results.values())
    assert engine.blocks.num_free == 8
    assert engine.load() == (0, 0, 0)


def test_max_running_caps_admission(no_eos_params):
    engine = Engine(EngineConfig(max_running=3, max_step_tokens=16), no_eos_params)
    for i in range(5):
        engine.submit(_spec(i, _prompt(i, 5), 8, seed=i))
    engine.step()
    assert engine.load()[:2] == (3, 2)
    assert len(drain(engine)) == 5


# ---------------------------------------------------------------------------- exactness


def test_batch_invariance_alone_vs_with_seven_others(no_eos_params):
    prompt = _prompt(100, 37)
    alone = Engine(EngineConfig(max_step_tokens=24), no_eos_params)
    alone.submit(_spec("me", prompt, 40))
    ref = drain(alone)["me"]

    crowd = Engine(EngineConfig(max_step_tokens=24), no_eos_params)
    for i in range(7):  # different lengths, so prefill chunks and decodes interleave with "me"
        crowd.submit(_spec(i, _prompt(i, 5 + 9 * i), 30 + i, seed=i))
    crowd.step()
    crowd.submit(_spec("me", prompt, 40))
    got = drain(crowd)
    assert got["me"] == ref
    assert len(ref[0]) == 40


def _uninterrupted(params, prompt, budget):
    engine = Engine(EngineConfig(max_step_tokens=128), params)
    engine.submit(_spec("r", prompt, budget))
    return drain(engine)["r"]


@pytest.mark.parametrize("max_step_tokens", [9, 40])
def test_resume_with_prefix_continues_exactly(no_eos_params, max_step_tokens):
    prompt, budget = _prompt(5, 45), 60
    full, reason = _uninterrupted(no_eos_params, prompt, budget)
    assert reason == "length"
    assert len(set(full)) > 10  # a varied, context-driven sample, not one repeated token
    engine = Engine(EngineConfig(max_step_tokens=max_step_tokens), no_eos_params)
    splits = [1, 7, 16, 33, 59]
    for s in splits:
        engine.submit(_spec(("r", s), prompt, budget, prefix=full[:s]))
    engine.submit(_spec("noise", _prompt(6, 70), 30, seed=99))  # shares every batch
    got = drain(engine)
    for s in splits:
        assert got[("r", s)] == (full[s:], "length"), f"split {s}"


def test_resume_mutation_changes_the_continuation(no_eos_params):
    """Proves the resume test can fail: a wrong prefix must give a different continuation."""
    prompt, budget = _prompt(5, 45), 60
    full, _ = _uninterrupted(no_eos_params, prompt, budget)
    engine = Engine(EngineConfig(max_step_tokens=40), no_eos_params)
    for s in (7, 33):
        for where in (0, s - 1):
            bad = list(full[:s])
            bad[where] = (bad[where] + 1) % 256
            engine.submit(_spec((s, where), prompt, budget, prefix=bad))
    got = drain(engine)
    for key, (toks, _) in got.items():
        s = key[0]
        assert toks != full[s:], f"mutated prefix {key} gave the same continuation"


def test_resume_with_full_prefix_finishes_at_once(no_eos_params):
    prompt = _prompt(5, 10)
    full, _ = _uninterrupted(no_eos_params, prompt, 12)
    engine = Engine(EngineConfig(), no_eos_params)
    engine.submit(_spec("done", prompt, 12, prefix=full))
    events = engine.step()
    assert [(e.key, e.position, e.new_tokens, e.finished) for e in events] == [("done", 12, [], "length")]
    assert not engine.has_work()


# ---------------------------------------------------------------------------- finishing, cancel


def test_length_finish_reports_once(no_eos_params):
    engine = Engine(EngineConfig(), no_eos_params)
    engine.submit(_spec("a", _prompt(1, 8), 5))
    finishes = []
    while engine.has_work():
        finishes += [ev.finished for ev in engine.step()]
    assert finishes == [None, None, None, None, "length"]


def _first_eos_run(params):
    """(prompt, seed, tokens) of a run with natural weights that samples EOS before budget."""
    for seed in range(40):
        engine = Engine(EngineConfig(), params)
        prompt = _prompt(seed, 12)
        engine.submit(_spec("e", prompt, 200, seed=seed))
        toks, reason = drain(engine)["e"]
        if reason == "eos":
            return prompt, seed, toks
    raise AssertionError("no seed produced EOS")


def test_eos_finishes_and_resume_after_eos_is_immediate(tiny_params):
    prompt, seed, toks = _first_eos_run(tiny_params)
    assert toks[-1] == EOS_TOKEN
    assert EOS_TOKEN not in toks[:-1]
    assert len(toks) < 200
    engine = Engine(EngineConfig(), tiny_params)
    engine.submit(_spec("again", prompt, 200, seed=seed, prefix=toks))
    assert drain(engine)["again"] == ([], "eos")


def test_stop_string_finishes_where_it_first_appears(no_eos_params):
    prompt = _prompt(8, 20)
    full, _ = _uninterrupted(no_eos_params, prompt, 120)
    raw = bytes(full)
    # A two-byte ASCII stop taken from late in the output; it ends at its first occurrence.
    i = next(i for i in range(10, len(full)) if full[i - 1] < 128 and full[i] < 128)
    stop = raw[i - 1 : i + 1].decode()
    end = raw.index(raw[i - 1 : i + 1]) + 2
    engine = Engine(EngineConfig(), no_eos_params)
    engine.submit(_spec("s", prompt, 120, stop=("\x00never", stop)))
    toks, reason = drain(engine)["s"]
    assert reason == "stop"
    assert toks == full[:end]
    assert decode_bytes(toks).endswith(stop.encode())
    # A resumed attempt whose prefix already holds the stop ends at once.
    engine.submit(_spec("s2", prompt, 120, stop=(stop,), prefix=full[:end]))
    assert drain(engine)["s2"] == ([], "stop")


def test_cancel_running_and_waiting(no_eos_params):
    engine = Engine(EngineConfig(max_running=2, max_step_tokens=16), no_eos_params)
    for key in ("a", "b", "c"):
        engine.submit(_spec(key, _prompt(2, 10), 30))
    engine.step()
    engine.step()
    assert engine.load()[:2] == (2, 1)
    assert engine.cancel("a")  # running
    assert engine.cancel("c")  # waiting
    assert not engine.cancel("c")
    assert not engine.cancel("zzz")
    got = drain(engine)
    assert set(got) == {"b"}
    assert got["b"][1] == "length"
    assert engine.blocks.num_free == engine.config.num_blocks


# ---------------------------------------------------------------------------- weight versions


def test_each_sequence_runs_on_its_own_weight_version(tiny_params):
    """One engine holding two versions, sequences of both in every step, gives each sequence
    exactly what an engine holding only its version gives it."""
    other = init_params(PRESETS["tiny"], seed=1)
    mixed = Engine(EngineConfig(), tiny_params, weight_version="v0")
    mixed.add_weights("v1", other)
    specs = [
        SeqSpec(i, _prompt(i, 5 + 3 * i), [], 40, seed=i, temperature=0.8, weight_version=f"v{i % 2}")
        for i in range(6)
    ]
    for spec in specs:
        mixed.submit(spec)
    together = drain(mixed)

    alone = {}
    for version, params in (("v0", tiny_params), ("v1", other)):
        engine = Engine(EngineConfig(), params, weight_version=version)
        for spec in specs:
            if spec.weight_version == version:
                engine.submit(spec)
        alone |= drain(engine)
    assert together == alone
    # The version matters: the same request on the other weights is another sequence.
    v0_engine = Engine(EngineConfig(), tiny_params, weight_version="v0")
    v0_engine.submit(SeqSpec(1, specs[1].prompt_tokens, [], 40, seed=1, temperature=0.8))
    assert drain(v0_engine)[1] != together[1]


def test_weight_versions_are_held_while_used_and_refused_when_unknown(tiny_params):
    engine = Engine(EngineConfig(), tiny_params, weight_version="v0")
    with pytest.raises(EngineRejected, match="not held"):
        engine.submit(SeqSpec("x", [1, 2], [], 4, seed=0, temperature=0.8, weight_version="v9"))
    engine.add_weights("v1", init_params(PRESETS["tiny"], seed=1))
    engine.submit(SeqSpec("a", [1, 2], [], 4, seed=0, temperature=0.8, weight_version="v1"))
    assert engine.unused_versions() == []
    with pytest.raises(ValueError, match="in use"):
        engine.drop_weights("v1")
    drain(engine)
    assert engine.unused_versions() == ["v1"]
    engine.drop_weights("v1")
    assert list(engine.weights) == ["v0"]
    with pytest.raises(ValueError, match="current"):
        engine.drop_weights("v0")


def test_min_new_tokens_masks_eos_until_reached_and_resumes_exactly(tiny_params):
    """A prompt and seed whose free run ends with EOS early: with min_new_tokens the run goes on
    to the budget, EOS nowhere before the minimum, and a resume from any prefix is exact."""
    free = Engine(EngineConfig(), tiny_params)
    found = None
    for seed in range(200):
        free.submit(_spec(("free", seed), _prompt(seed, 8), 200, seed=seed))
        tokens, reason = drain(free)[("free", seed)]
        if reason == "eos" and len(tokens) < 60:
            found = seed, len(tokens)
            break
    assert found is not None, "no seed in 200 reached EOS within 60 tokens"
    seed, eos_at = found
    engine = Engine(EngineConfig(), tiny_params)
    engine.submit(SeqSpec("held", _prompt(seed, 8), [], 120, seed, 0.8, (), None, 100))
    held, reason = drain(engine)["held"]
    assert EOS_TOKEN not in held[:100] and len(held) >= 100
    assert len(held) > eos_at  # the mask changed the run: without it, it ended at the EOS
    cut = 37
    resumed = Engine(EngineConfig(), tiny_params)
    resumed.submit(SeqSpec("resumed", _prompt(seed, 8), held[:cut], 120, seed, 0.8, (), None, 100))
    rest, reason_after = drain(resumed)["resumed"]
    assert held[:cut] + rest == held and reason_after == reason


DIGITS = tuple(range(ord("0"), ord("9") + 1))


def test_allowed_tokens_confine_sampling_and_resume_exactly(tiny_params):
    """Only allowed ids are drawn, at any temperature; a resume inside the run is exact. The
    control: the same request without the mask draws ids outside the set."""
    free = Engine(EngineConfig(), tiny_params)
    free.submit(SeqSpec("free", _prompt(5, 8), [], 40, 5, 1.5))
    unmasked, _ = drain(free)["free"]
    assert set(unmasked) - set(DIGITS)

    engine = Engine(EngineConfig(), tiny_params)
    engine.submit(SeqSpec("digits", _prompt(5, 8), [], 40, 5, 1.5, allowed_tokens=DIGITS))
    engine.submit(SeqSpec("greedy", _prompt(6, 8), [], 10, 6, 0.0, allowed_tokens=DIGITS[:3]))
    done = drain(engine)
    digits, reason = done["digits"]
    assert len(digits) == 40 and reason == "length" and set(digits) <= set(DIGITS)
    assert len(set(digits)) > 3  # sampled, not stuck on one id
    assert set(done["greedy"][0]) <= set(DIGITS[:3])

    resumed = Engine(EngineConfig(), tiny_params)
    resumed.submit(SeqSpec("r", _prompt(5, 8), digits[:13], 40, 5, 1.5, allowed_tokens=DIGITS))
    assert digits[:13] + drain(resumed)["r"][0] == digits
    with pytest.raises(EngineRejected, match="allowed_tokens outside"):
        engine.submit(SeqSpec("bad", [1], [], 4, 0, 1.0, allowed_tokens=(VOCAB_SIZE,)))


def test_sequence_logits_match_the_engine_forward(tiny_params):
    """The trainer's differentiable forward computes the network the engine samples from: its
    greedy continuation is the engine's, and its logits agree to float32 rounding."""
    engine = Engine(EngineConfig(), tiny_params)
    prompt = _prompt(3, 12)
    engine.submit(SeqSpec("g", prompt, [], 24, 0, 0.0))
    greedy, _ = drain(engine)["g"]
    tokens = torch.tensor([prompt + greedy[:-1]])  # [1, T]
    logits = sequence_logits(tiny_params, PRESETS["tiny"], tokens)  # [1, T, vocab]
    predicted = logits[0, len(prompt) - 1 :, :VOCAB_SIZE].argmax(-1).tolist()
    assert predicted == greedy
    # A mutation: shifting the positions by one changes the prediction.
    shifted = dict(tiny_params, pos_emb=torch.roll(tiny_params["pos_emb"], 1, dims=0))
    wrong = sequence_logits(shifted, PRESETS["tiny"], tokens)[0, len(prompt) - 1 :, :VOCAB_SIZE]
    assert wrong.argmax(-1).tolist() != greedy
