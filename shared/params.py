"""Model weights as data: the `Params` dict, checking it against a preset, seeded initialisation,
weight-version names and the weights file format.

Part of the contract: the weight server creates, loads and checks the weights it serves, a trainer
saves the files it publishes, and a worker that owns its weights does the same as the server, so
a version name means the same tensors everywhere. Tensors, but no model code: the forward pass
that reads these weights is shared/model.py; the shapes come from shared/presets.py.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from belayer_rl.shared.presets import ModelConfig, param_shapes

Params = dict[str, torch.Tensor]


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
    """The version name of `init_params(PRESETS[preset], seed)`."""
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
