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
