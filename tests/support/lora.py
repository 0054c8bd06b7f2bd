"""LoRA adapters made with ``peft`` (the reference), and the base model with one merged in."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def _peft_quietly() -> Iterator[None]:
    """peft 0.21 calls transformers 5 APIs that warn of their own deprecation (not herd's to fix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        yield


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base: Path,
    folder: Path,
    *,
    rank: int,
    seed: int,
    alpha: float | None = None,
    targets: tuple[str, ...] = ALL_TARGETS,
) -> Path:
    """A PEFT LoRA adapter for ``base`` with random, nonzero weights (``init_lora_weights=False``:
    both A and B drawn as ``nn.Linear`` draws them), saved as peft saves it; returns ``folder``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        target_modules=list(targets),
        init_lora_weights=False,
    )
    with _peft_quietly():
        get_peft_model(model, config).save_pretrained(folder)
    return folder


@functools.cache
def merged_checkpoint(base: Path, adapter: Path, folder: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights (peft's ``merge_and_unload``), saved in
    ``folder`` with ``base``'s tokenizer: transformers' reference for herd running the adapter."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with _peft_quietly():
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        merged.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, folder / name)
    return folder
