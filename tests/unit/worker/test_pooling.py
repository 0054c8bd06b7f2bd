"""Pooling as a checkpoint declares it (sentence-transformers files), and the pooling math."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from herd.worker.models import UnsupportedModelError
from herd.worker.pooling import PoolingConfig, pool, read_pooling, truncate

TRANSFORMER = {"path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
MEAN = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}


def write_folder(
    folder: Path,
    modules: list[dict[str, str]] | None,
    pooling: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    max_seq_length: int | None = None,
) -> Path:
    (folder / "config.json").write_text(json.dumps(config or {}))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder


@pytest.mark.parametrize(
    ("modules", "pooling", "config", "expected"),
    [
        (
            [TRANSFORMER, POOLING, NORMALIZE],
            MEAN,
            {},
            PoolingConfig("mean", normalize=True, size=8, max_len=256),
        ),
        (
            [TRANSFORMER, POOLING],
            {"pooling_mode_cls_token": True},
            {},
            PoolingConfig("cls", normalize=False, size=8, max_len=256),
        ),
        (
            [TRANSFORMER, POOLING, NORMALIZE],
            {"pooling_mode": "lasttoken"},
            {},
            PoolingConfig("last", normalize=True, size=8, max_len=256),
        ),
        (
            [TRANSFORMER, POOLING, NORMALIZE],
            MEAN,
            {"matryoshka_dimensions": [4, 2]},
            PoolingConfig("mean", True, 8, 256, is_matryoshka=True, matryoshka_dimensions=(4, 2)),
        ),
        (
            [TRANSFORMER, POOLING, NORMALIZE],
            MEAN,
            {"is_matryoshka": True},
            PoolingConfig("mean", True, 8, 256, is_matryoshka=True),
        ),
        (None, None, {}, PoolingConfig("cls", normalize=True, size=8, max_len=256)),
    ],
    ids=["mean-normalized", "cls", "lasttoken-by-name", "matryoshka-listed", "matryoshka-any", "bare-bert"],
)
def test_reads_the_pipeline(
    tmp_path: Path,
    modules: list[dict[str, str]] | None,
    pooling: dict[str, Any] | None,
    config: dict[str, Any],
    expected: PoolingConfig,
) -> None:
    folder = write_folder(tmp_path, modules, pooling, config, max_seq_length=256)
    assert read_pooling(folder, 8) == expected


@pytest.mark.parametrize(
    ("modules", "pooling", "message"),
    [
        (
            [TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
            MEAN,
            "sentence_transformers.models.Dense",
        ),
        ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        ([TRANSFORMER, POOLING], {**MEAN, "pooling_mode_cls_token": True}, "one way"),
        ([TRANSFORMER, POOLING], {"pooling_mode": "weightedmean"}, "'weightedmean'"),
        ([TRANSFORMER], None, "no Pooling module"),
    ],
    ids=["dense", "max", "two-modes", "weighted-by-name", "no-pooling"],
)
def test_refuses_what_it_cannot_run(
    tmp_path: Path, modules: list[dict[str, str]], pooling: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        read_pooling(write_folder(tmp_path, modules, pooling), 8)


HIDDEN = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 2.0], [6.0, 8.0], [0.0, -1.0]])
LENGTHS = [2, 3]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("mean", [[2.0, 2.0], [2.0, 3.0]]),
        ("cls", [[1.0, 0.0], [0.0, 2.0]]),
        ("last", [[3.0, 4.0], [0.0, -1.0]]),
    ],
)
def test_pools_each_sequence_of_the_flat_rows(mode: str, expected: list[list[float]]) -> None:
    assert pool(HIDDEN, LENGTHS, mode, normalize=False).tolist() == expected  # type: ignore[arg-type]
    normalized = pool(HIDDEN, LENGTHS, mode, normalize=True)  # type: ignore[arg-type]
    assert torch.allclose(normalized.norm(dim=1), torch.ones(2))


def test_truncation_renormalizes_only_a_normalized_model() -> None:
    vector = [0.6, 0.0, 0.8]
    assert truncate(vector, 3, normalize=True) == vector
    assert truncate(vector, 2, normalize=False) == pytest.approx([0.6, 0.0])
    assert truncate(vector, 2, normalize=True) == pytest.approx([1.0, 0.0])
