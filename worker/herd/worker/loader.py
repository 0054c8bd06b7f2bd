"""Loads a HF-format folder (``config.json`` plus ``*.safetensors``, sharded or not) into a model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from herd.worker.layers.attention import AttentionBackend
from herd.worker.layers.linear import Linear, Narrow
from herd.worker.layers.moe import FusedExperts
from herd.worker.models import LlamaForCausalLM, ModelArgs, UnsupportedModelError, build_model
from herd.worker.models.bert import ENCODER_ARCHITECTURES, BertArgs, BertModel
from herd.worker.parallel import TensorParallel

__all__ = [
    "is_encoder",
    "load_encoder",
    "load_model",
    "read_encoder_args",
    "read_model_args",
    "safetensors_files",
]

M = TypeVar("M", bound=nn.Module)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_model_args(folder: Path) -> ModelArgs:
    """The model's shape; ``UnsupportedModelError`` names what herd cannot run exactly."""
    try:
        return ModelArgs.from_hf_config(_config(folder))
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"{folder} holds {error}") from None


def is_encoder(folder: Path) -> bool:
    """Whether the checkpoint is an encoder herd runs as an embedding model (``ENCODER_ARCHITECTURES``)."""
    return _architecture(_config(folder)) in ENCODER_ARCHITECTURES


def read_encoder_args(folder: Path) -> BertArgs:
    try:
        return BertArgs.from_hf_config(_config(folder))
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"{folder} holds {error}") from None


def _config(folder: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return config


def _architecture(config: dict[str, Any]) -> str:
    return str((config.get("architectures") or ["LlamaForCausalLM"])[0])


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those named by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files: save the checkpoint with safetensors")
    return files


def load_model(
    folder: Path,
    args: ModelArgs,
    backend: AttentionBackend,
    *,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    parallel: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Build the model without initializing it (``parallel``: this rank's slice of it), fill every
    parameter from the checkpoint, then pack the linear layers for the device (``Linear.pack``)."""
    with torch.device("meta"):
        model = build_model(args, backend, max_positions, parallel)
    targets, loaded = _fill(model, folder, dtype, device, lambda name: name.endswith(_IGNORED_SUFFIXES))
    if args.tie_word_embeddings or "lm_head.weight" not in loaded:
        model.tie_weights()
        loaded.add("lm_head.weight")
    return _finish(model, folder, targets, loaded)


def load_encoder(folder: Path, args: BertArgs, *, dtype: torch.dtype, device: torch.device) -> BertModel:
    """``load_model`` for an encoder (an embedding model)."""
    with torch.device("meta"):
        model = BertModel(args)
    targets, loaded = _fill(model, folder, dtype, device, BertModel.IGNORED_TENSORS.__contains__)
    return _finish(model, folder, targets, loaded)


def _fill(
    model: M, folder: Path, dtype: torch.dtype, device: torch.device, is_ignored: Callable[[str], bool]
) -> tuple[dict[str, Target], set[str]]:
    """Allocate ``model`` (built on the meta device) on ``device`` and copy the checkpoint into it;
    the tensors to fill by name, and those filled."""
    model.to_empty(device=device).to(dtype)
    targets = _checkpoint_targets(model)
    return targets, _copy_weights(targets, safetensors_files(folder), is_ignored)


def _finish(model: M, folder: Path, targets: dict[str, Target], loaded: set[str]) -> M:
    missing = set(targets) - loaded
    if missing:
        raise ValueError(
            f"{folder} lacks weights {sorted(missing)[:5]}: the checkpoint does not match its config"
        )
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
    return model.eval()


Target = tuple[torch.Tensor, Narrow | None]
"""Where a checkpoint tensor goes, and the slice of it this rank loads (None: all of it)."""


def _checkpoint_targets(model: nn.Module) -> dict[str, Target]:
    """Each checkpoint tensor's name -> the parameter (or the rows of a stacked one) it loads into."""
    targets: dict[str, Target] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, Linear):
            parent = module_name.rpartition(".")[0]
            shards = module.checkpoint_shards(f"{parent}." if parent else "")
            targets.update((name, (rows, narrow)) for name, rows, narrow in shards)
            continue
        if isinstance(module, FusedExperts):
            targets.update((name, (rows, None)) for name, rows in module.checkpoint_shards(prefix))
            continue
        params = module.named_parameters(recurse=False)
        targets.update((prefix + name, (param, None)) for name, param in params)
    return targets


def _copy_weights(
    targets: dict[str, Target], files: list[Path], is_ignored: Callable[[str], bool]
) -> set[str]:
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if is_ignored(name):
                    continue
                if name not in targets:
                    raise ValueError(f"{file.name} has an unexpected tensor {name!r}: is config.json right?")
                target, narrow = targets[name]
                tensor = shard.get_tensor(name)
                with torch.no_grad():
                    target.copy_(tensor if narrow is None else tensor.narrow(*narrow))
                loaded.add(name)
    return loaded
