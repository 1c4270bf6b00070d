"""A Hugging Face model folder as the vLLM engine kind serves it: the checks made before vLLM
starts, the weight version that names a folder's weights, and its tensors for an in-place update.
Imports neither vLLM nor transformers: `belayer model publish` names versions with it too."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


class ModelFolderError(ValueError):
    """A model folder vLLM cannot serve (missing, not a Hugging Face folder, wrong tokenizer)."""


def check_model_folder(folder: Path) -> None:
    """Refuse a folder that is plainly not a model before paying for vLLM's start."""
    if not folder.is_dir():
        raise ModelFolderError(f"--model-path {folder} is not a folder")
    missing = [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]
    if missing:
        raise ModelFolderError(f"--model-path {folder} has no {', '.join(missing)}: not a model folder")
    if not any(folder.glob("*.safetensors")):
        raise ModelFolderError(f"--model-path {folder} holds no .safetensors weights")


def folder_version(folder: Path) -> str:
    """A weight version named by the folder's weights: the SHA-256 of its safetensors files, so that
    every worker, and `belayer model publish`, names the same weights the same way."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as weights:
            while block := weights.read(1 << 22):
                digest.update(block)
    return f"hf-{digest.hexdigest()[:16]}"


def load_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by checkpoint name (as vLLM loads them)."""
    from safetensors.torch import load_file

    check_model_folder(folder)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor in the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                shapes[name] = tuple(weights.get_slice(name).get_shape())
    return shapes


def check_same_model(serving: Path, new: Path) -> None:
    """Refuse new weights that are not the served model's tensors: an in-place reload of other
    names or shapes would fail half way, or leave some tensors of the old version."""
    check_model_folder(new)
    have, offered = tensor_shapes(serving), tensor_shapes(new)
    if have != offered:
        missing = sorted(set(have) - set(offered))[:3]
        other = sorted(n for n in set(have) & set(offered) if have[n] != offered[n])[:3]
        extra = sorted(set(offered) - set(have))[:3]
        raise ModelFolderError(
            f"{new} is not the served model's weights: missing {missing}, other shapes {other}, extra {extra}"
        )
