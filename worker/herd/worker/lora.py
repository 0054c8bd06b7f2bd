"""LoRA adapters in PEFT's format, read into host memory, and the LRU table of device slots.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (what
``peft``'s ``save_pretrained`` writes). Each targeted projection ``W`` gets ``W + s * B @ A`` with
``A: [r, in]``, ``B: [out, r]`` and ``s = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).
``read_adapter`` checks the folder against the model (the projections herd runs, their shapes, the
rank cap), folds ``s`` into ``B`` and keeps the tensors on the host; ``SlotTable`` decides which
adapters occupy the ``maxLoras`` device slots a step may use, evicting the least recently used.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from herd.api.body import BodyError, json_value

__all__ = ["LoraAdapter", "SlotTable", "read_adapter"]

TARGET_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
"""The projections an adapter may target: herd's attention and MLP linear layers."""

_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_REFUSED: dict[str, Any] = {
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "alpha_pattern": {},
    "trainable_token_indices": None,
    "layer_replication": None,
}
"""PEFT settings herd cannot serve, with the value they must have."""


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter on the host: ``weights[module] = (A [r, in], s * B [out, r])`` by checkpoint
    module name (``model.layers.0.self_attn.q_proj``); ``rank`` is its largest ``r``."""

    name: str
    path: Path
    rank: int
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter(
    name: str, path: Path, shapes: Mapping[str, tuple[int, int]], *, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read the PEFT adapter at ``path`` for a model whose projections have ``shapes``
    (checkpoint module name -> ``(in, out)``). Raises ``ValueError`` naming what does not fit."""
    config = _read_config(path)
    alpha, use_rslora = float(config["lora_alpha"]), bool(config.get("use_rslora"))
    tensors = _read_tensors(path)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in sorted(tensors.items()):
        if "A" not in pair or "B" not in pair:
            raise ValueError(
                f"{path / _WEIGHTS} has lora_{'A' if 'A' not in pair else 'B'} missing for {module}"
            )
        lora_a, lora_b = pair["A"], pair["B"]
        _check_module(path, module, lora_a, lora_b, shapes)
        module_rank = lora_a.shape[0]  # PEFT's rank_pattern may give modules ranks other than r
        scaling = alpha / (module_rank**0.5 if use_rslora else module_rank)
        pair_in_dtype = (lora_a.to(dtype), (lora_b.double() * scaling).to(dtype))
        if not all(torch.isfinite(weight).all() for weight in pair_in_dtype):
            raise ValueError(
                f"{path / _WEIGHTS}: {module}'s weights are not finite in {dtype} once scaled by "
                f"lora_alpha / r ({scaling:g}): the adapter would answer NaN; check lora_alpha and the "
                "weights PEFT saved"
            )
        weights[module] = pair_in_dtype
    if not weights:
        raise ValueError(f"{path / _WEIGHTS} holds no LoRA weights: is it a PEFT LoRA adapter?")
    rank = max(lora_a.shape[0] for lora_a, _ in weights.values())
    if rank > max_rank:
        raise ValueError(
            f"adapter {name!r} has rank {rank}, above engine.maxLoraRank {max_rank}: raise maxLoraRank"
        )
    return LoraAdapter(name=name, path=path, rank=rank, weights=weights)


def _read_config(path: Path) -> dict[str, Any]:
    file = path / _CONFIG
    if not file.is_file():
        raise ValueError(f"{path} has no {_CONFIG}: pass a folder written by peft's save_pretrained")
    try:
        config = json_value(file.read_bytes(), what=str(file))
    except BodyError as error:
        raise ValueError(f"{error}: pass a folder written by peft's save_pretrained") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object: pass a folder written by peft's save_pretrained")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise ValueError(
            f"{file} has no lora_alpha number (got {alpha!r}): PEFT writes one for every adapter"
        )
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file} is a {config['peft_type']} adapter; herd serves LoRA adapters only")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file} sets bias {config['bias']!r}; herd serves adapters with bias 'none'")
    for key, allowed in _REFUSED.items():
        if config.get(key, allowed) not in (allowed, None, {}, []):
            raise ValueError(f"{file} sets {key}, which herd does not support: leave it {allowed!r}")
    return config


def _read_tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    file = path / _WEIGHTS
    if not file.is_file():
        raise ValueError(f"{path} has no {_WEIGHTS}: save the adapter with safetensors")
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _KEY.match(key)
                if match is None:
                    raise ValueError(f"{file} has a tensor {key!r} that is not a LoRA A or B weight")
                tensors.setdefault(match["module"], {})[match["which"]] = handle.get_tensor(key)
    except SafetensorError as error:
        raise ValueError(
            f"{file} is not a readable safetensors file ({error}): save the adapter again"
        ) from None
    return tensors


def _check_module(
    path: Path, module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, shapes: Mapping[str, tuple[int, int]]
) -> None:
    if module not in shapes:
        targets = ", ".join(sorted(TARGET_MODULES))
        raise ValueError(f"{path} adapts {module}, which herd cannot adapt: target only {targets}")
    in_features, out_features = shapes[module]
    rank = lora_a.shape[0] if lora_a.ndim == 2 else 0
    if rank < 1 or lora_a.shape != (rank, in_features) or lora_b.shape != (out_features, rank):
        raise ValueError(
            f"{path}: {module}'s A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit the model's "
            f"{in_features} -> {out_features} projection: is the adapter for this base model?"
        )


class SlotTable:
    """Which adapter sits in each of ``num_slots`` device slots, least recently used first out.

    ``assign`` places a step's adapters: those already in a slot stay, the others take a free slot
    (the lowest, so a step's slots stay a short prefix) or evict the least recently used adapter not
    in this step. Pure bookkeeping: the caller copies the weights of the loads it returns.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first

    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def assign(self, names: Iterable[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Slots for ``names`` (at most ``num_slots`` of them) and the ``(slot, name)`` loads needed."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters in one step, above engine.maxLoras {self.num_slots}")
        loads: list[tuple[int, str]] = []
        for name in wanted:
            if name not in self._slot_of:
                slot = self._free_slot(set(wanted))
                loads.append((slot, name))
                self._slot_of[name] = slot
            self._slot_of.move_to_end(name)
        return {name: self._slot_of[name] for name in wanted}, loads

    def evict(self, name: str) -> int | None:
        """Forget ``name``'s slot (its adapter was unloaded); the slot it held, if any."""
        return self._slot_of.pop(name, None)

    def _free_slot(self, keep: set[str]) -> int:
        taken = set(self._slot_of.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        if free:
            return free[0]
        victim = next(name for name in self._slot_of if name not in keep)
        return self._slot_of.pop(victim)
