"""Helpers for engine tests: seeded random weights, never a context-blind mock."""

import pytest

from belayer_rl.shared.params import init_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.tokenizer import EOS_TOKEN


@pytest.fixture(scope="session")
def tiny_params():
    return init_params(PRESETS["tiny"], seed=0)


@pytest.fixture(scope="session")
def no_eos_params():
    """Seeded random weights whose EOS logit is 0 among logits of std ~3: EOS is practically
    never sampled, so long runs exercise many positions."""
    params = init_params(PRESETS["tiny"], seed=7)
    params["lm_head"] = params["lm_head"].clone()
    params["lm_head"][:, EOS_TOKEN] = 0.0
    return params
