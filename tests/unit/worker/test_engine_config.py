"""EngineConfig: validation, unknown keys, device and dtype resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest
import torch

from herd.worker.config import EngineConfig


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tmp_path


def test_manifest_spelling_is_accepted(folder: Path) -> None:
    config = EngineConfig(
        model_path=folder,
        served_name="m",
        engine={"maxBatchTokens": 64, "kvCache": {"blockSize": 32, "memoryGiB": 0.5}},  # type: ignore[arg-type]
    )
    assert (config.block_size, config.engine.max_batch_tokens, config.engine.kv_cache.memory_gib) == (
        32,
        64,
        0.5,
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"engine": {"maxBatchTokens": 1}}, "maxBatchTokens"),
        ({"engine": {"kvCache": {"blockSize": 12}}}, "blockSize"),
        ({"served_name": ""}, "served_name"),
        ({"role": "router"}, "role"),
    ],
    ids=["unknown-key", "tiny-budget", "block-not-power-of-two", "empty-name", "bad-role"],
)
def test_bad_settings_name_the_field(folder: Path, overrides: dict[str, object], field: str) -> None:
    settings: dict[str, object] = {"model_path": folder, "served_name": "m", **overrides}
    with pytest.raises(pydantic.ValidationError, match=field):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_folder_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"config\.json"):
        EngineConfig(model_path=tmp_path, served_name="m")


@pytest.mark.parametrize(
    ("dtype", "checkpoint", "expected"),
    [
        ("auto", "bfloat16", torch.float32),
        ("bfloat16", "float32", torch.bfloat16),
        ("float16", None, torch.float16),
    ],
    ids=["auto-on-cpu-is-fp32", "explicit-bf16", "explicit-fp16"],
)
def test_dtype_resolution_on_cpu(
    folder: Path, dtype: str, checkpoint: str | None, expected: torch.dtype
) -> None:
    config = EngineConfig(model_path=folder, served_name="m", engine={"dtype": dtype, "device": "cpu"})  # type: ignore[arg-type]
    assert config.device == torch.device("cpu")
    assert config.resolve_dtype(checkpoint) == expected


@pytest.mark.parametrize(
    ("engine", "refused"),
    [
        ({"tensorParallelSize": 2}, True),
        ({"kvCache": {"hostMemoryGiB": 1}}, True),
        ({"kvCache": {"hostMemoryGiB": 1, "disk": {"path": "/var/tmp", "sizeGiB": 1}}}, True),
        ({}, False),
    ],
    ids=["tensor-parallel", "host-tier", "disk-tier", "alone"],
)
def test_a_draft_model_runs_beside_one_devices_pool_only(
    folder: Path, engine: dict[str, object], refused: bool
) -> None:
    """The draft's KV pool mirrors the device pool block for block: not split over ranks, not tiered."""
    speculative = {"method": "draft", "draftModel": f"file://{folder}"}
    settings = {"model_path": folder, "served_name": "m", "engine": {**engine, "speculative": speculative}}
    if refused:
        with pytest.raises(pydantic.ValidationError, match="method draft runs beside one device's KV pool"):
            EngineConfig(**settings)  # type: ignore[arg-type]
    else:
        assert EngineConfig(**settings).draft_model_path == folder  # type: ignore[arg-type]
    ngram = {**settings, "engine": {**engine, "speculative": {"method": "ngram"}}}
    assert EngineConfig(**ngram).engine.speculative is not None  # type: ignore[arg-type]
