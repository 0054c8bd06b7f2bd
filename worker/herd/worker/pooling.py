"""How an embedding model turns a sequence's hidden states into one vector, as its checkpoint says.

A sentence-transformers folder lists its pipeline in ``modules.json``: the transformer, a pooling
module (``1_Pooling/config.json``: mean, CLS or last-token pooling), and optionally ``Normalize``
(unit length). herd runs exactly those three module types and refuses any other (a ``Dense``
projection, a learned ``LayerNorm``) by name, so a model herd cannot reproduce never loads. A folder
without ``modules.json`` pools the CLS token and normalizes, as vLLM does for a bare BERT.
``max_seq_length`` (``sentence_bert_config.json``) caps the input length, as sentence-transformers
does (it truncates there; herd refuses longer inputs instead). A model trained Matryoshka-style
says so in ``config.json`` (``is_matryoshka``, ``matryoshka_dimensions``, vLLM's keys): only then
may a request cut its vectors short (``dimensions``), renormalized when the model normalizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.nn import functional

from herd.worker.models.args import UnsupportedModelError

__all__ = ["PoolingConfig", "PoolingMode", "pool", "read_pooling", "truncate"]

PoolingMode = Literal["mean", "cls", "last"]

_TRANSFORMER, _POOLING, _NORMALIZE = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.Pooling",
    "sentence_transformers.models.Normalize",
)
_MODE_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_MODE_NAMES: dict[str, PoolingMode] = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_UNSUPPORTED_KEYS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


@dataclass(frozen=True)
class PoolingConfig:
    """An embedding model's pooling: ``size`` values per vector, pooled by ``mode``, unit length
    when ``normalize``; inputs of at most ``max_len`` tokens (None: the model's positions)."""

    mode: PoolingMode
    normalize: bool
    size: int
    max_len: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None


def read_pooling(folder: Path, size: int) -> PoolingConfig:
    """The pooling of the model in ``folder`` whose hidden states have ``size`` values."""
    config = _json(folder / "config.json")
    dims = config.get("matryoshka_dimensions")
    mode, normalize = _pipeline(folder)
    max_len = _json(folder / "sentence_bert_config.json").get("max_seq_length")
    return PoolingConfig(
        mode=mode,
        normalize=normalize,
        size=size,
        max_len=None if max_len is None else int(max_len),
        is_matryoshka=bool(config.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=None if dims is None else tuple(int(dim) for dim in dims),
    )


def _pipeline(folder: Path) -> tuple[PoolingMode, bool]:
    """The pooling mode and whether the vectors are normalized, from ``modules.json``."""
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return "cls", True
    mode: PoolingMode | None = None
    normalize = False
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "")
        if kind == _POOLING:
            mode = _mode(_json(folder / module.get("path", "") / "config.json"))
        elif kind == _NORMALIZE:
            normalize = True
        elif kind != _TRANSFORMER:
            raise UnsupportedModelError(
                f"{folder} holds a sentence-transformers module {kind!r}, which herd cannot run: it runs "
                "a transformer, Pooling and Normalize"
            )
    if mode is None:
        raise UnsupportedModelError(f"{folder}'s modules.json has no Pooling module: herd needs one")
    return mode, normalize


def _mode(config: dict[str, Any]) -> PoolingMode:
    if isinstance(name := config.get("pooling_mode"), str):  # sentence-transformers 5 writes the name
        if name not in _MODE_NAMES:
            raise UnsupportedModelError(f"pooling mode {name!r}, which herd cannot run: it pools {_named()}")
        return _MODE_NAMES[name]
    unsupported = [key for key in _UNSUPPORTED_KEYS if config.get(key)]
    modes = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
    if unsupported or len(modes) != 1:
        chosen = unsupported or [key for key in _MODE_KEYS if config.get(key)] or ["none"]
        raise UnsupportedModelError(
            f"pooling {' + '.join(chosen)}, which herd cannot run: it pools one way, {_named()}"
        )
    return modes[0]


def _named() -> str:
    return ", ".join(_MODE_NAMES)


def _json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def pool(hidden: torch.Tensor, lengths: list[int], mode: PoolingMode, *, normalize: bool) -> torch.Tensor:
    """One vector per sequence of ``hidden`` ``[sum(lengths), H]`` (the sequences' rows one after
    the other): the mean of its rows, its first row, or its last; then unit length if ``normalize``."""
    sizes = torch.tensor(lengths, device=hidden.device)
    ends = torch.cumsum(sizes, 0)
    if mode == "mean":
        owners = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), sizes)
        sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, owners, hidden)
        pooled = sums / sizes.unsqueeze(1).to(hidden.dtype)
    else:
        pooled = hidden[ends - sizes if mode == "cls" else ends - 1]
    pooled = pooled.float()
    return functional.normalize(pooled, dim=-1) if normalize else pooled


def truncate(embedding: list[float], dimensions: int, *, normalize: bool) -> list[float]:
    """The first ``dimensions`` values, at unit length again when the model normalizes (a cut
    unit vector is shorter than one)."""
    if dimensions >= len(embedding):
        return embedding
    cut = torch.tensor(embedding[:dimensions])
    values: list[float] = (functional.normalize(cut, dim=0) if normalize else cut).tolist()
    return values
