"""LoRA without a model: the slot table, the stacked layer math, the scheduler's adapter cap, and
the adapter reader's refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_seq
from safetensors.torch import save_file

from herd.worker.block_manager import BlockManager
from herd.worker.layers.lora import LoraContext, LoraWeights
from herd.worker.lora import SlotTable, read_adapter
from herd.worker.sampling_params import SamplingParams
from herd.worker.scheduler import Scheduler


@pytest.mark.parametrize(
    ("steps", "expected_slots", "expected_loads"),
    [
        ([["a", "b"]], [{"a": 0, "b": 1}], [[(0, "a"), (1, "b")]]),
        ([["a"], ["a", "b"]], [{"a": 0}, {"a": 0, "b": 1}], [[(0, "a")], [(1, "b")]]),
        # c evicts the least recently used adapter not in its step: a (b was used after it)
        ([["a"], ["b"], ["c"]], [{"a": 0}, {"b": 1}, {"c": 0}], [[(0, "a")], [(1, "b")], [(0, "c")]]),
        (
            [["a"], ["b"], ["a"], ["c"]],
            [{"a": 0}, {"b": 1}, {"a": 0}, {"c": 1}],
            [[(0, "a")], [(1, "b")], [], [(1, "c")]],
        ),
        # an adapter of the same step is never the victim
        (
            [["a"], ["b"], ["a", "c"]],
            [{"a": 0}, {"b": 1}, {"a": 0, "c": 1}],
            [[(0, "a")], [(1, "b")], [(1, "c")]],
        ),
    ],
    ids=["fill-lowest", "reuse", "evict-lru", "use-refreshes", "step-protected"],
)
def test_slot_table_keeps_the_recently_used(
    steps: list[list[str]], expected_slots: list[dict[str, int]], expected_loads: list[list[tuple[int, str]]]
) -> None:
    table = SlotTable(2)
    for names, slots, loads in zip(steps, expected_slots, expected_loads, strict=True):
        assert table.assign(names) == (slots, loads)


def test_slot_table_refuses_more_adapters_than_slots() -> None:
    with pytest.raises(ValueError, match="maxLoras 2"):
        SlotTable(2).assign(["a", "b", "c"])


def test_evicted_adapter_frees_its_slot() -> None:
    table = SlotTable(2)
    table.assign(["a", "b"])
    assert table.evict("a") == 0
    assert table.assign(["c"]) == ({"c": 0}, [(0, "c")])


@pytest.mark.parametrize(
    "runs",
    [
        [(2, 1), (-1, 1), (1, 1), (1, 1), (2, 1), (-1, 1)],
        [(1, 1), (-1, 1), (2, 3), (-1, 2), (1, 4)],
        [(-1, 1), (-1, 1), (2, 5)],
        [(1, 6)],
    ],
    ids=["decodes-only", "decodes-then-prefill-chunks", "base-decodes-adapter-prefill", "one-prefill"],
)
def test_stacked_weights_give_each_row_its_own_adapter(runs: list[tuple[int, int]]) -> None:
    """The fused layer's delta for each row equals its own adapter's ``B @ A`` on each shard's rows,
    for decodes (masked) and prefill chunks (segments) alike."""
    generator = torch.Generator().manual_seed(0)
    shards = {"q_proj": 6, "k_proj": 2, "v_proj": 2}
    context = LoraContext()
    layer = LoraWeights(
        4, shards, context, num_slots=3, max_rank=4, dtype=torch.float64, device=torch.device("cpu")
    )

    def adapter(rank: int, names: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            name: (torch.randn(rank, 4, generator=generator, dtype=torch.float64),
                   torch.randn(shards[name], rank, generator=generator, dtype=torch.float64))
            for name in names
        }  # fmt: skip

    adapters = {1: adapter(4, ("q_proj", "k_proj", "v_proj")), 2: adapter(2, ("v_proj",))}
    for slot, weights in adapters.items():
        layer.set_slot(slot, weights)
    token_slots = [slot for slot, count in runs for _ in range(count)]
    context.set(runs, torch.device("cpu"))
    x = torch.randn(len(token_slots), 4, generator=generator, dtype=torch.float64)
    out = layer.add_to(torch.zeros(len(token_slots), 10, dtype=torch.float64), x)
    for row, slot in enumerate(token_slots):
        expected = torch.zeros(10, dtype=torch.float64)
        column = 0
        for name, size in shards.items():
            if slot in adapters and name in adapters[slot]:
                lora_a, lora_b = adapters[slot][name]
                expected[column : column + size] = lora_b @ (lora_a @ x[row])
            column += size
        torch.testing.assert_close(out[row], expected)


def test_a_step_without_adapters_leaves_the_output_alone() -> None:
    context = LoraContext()
    layer = LoraWeights(
        4, {"o_proj": 4}, context, num_slots=2, max_rank=2, dtype=torch.float32, device=torch.device("cpu")
    )
    layer.set_slot(0, {"o_proj": (torch.ones(2, 4), torch.ones(4, 2))})
    context.set([(-1, 1), (-1, 3)], torch.device("cpu"))
    out = torch.full((2, 4), 3.0)
    assert layer.add_to(out, torch.ones(2, 4)) is out
    assert out.eq(3.0).all()


def _lora_seq(name: str, lora: str | None) -> object:
    seq = make_seq([ord(name)] * 3, request_id=name)
    seq.lora_name, seq.params = lora, SamplingParams(max_tokens=8)
    return seq


@pytest.mark.parametrize(
    ("requests", "max_loras", "admitted"),
    [
        ([("a", "x"), ("b", "y"), ("c", "z"), ("d", None)], 2, ["a", "b", "d"]),
        ([("a", "x"), ("b", "y"), ("c", "x"), ("d", "z")], 2, ["a", "b", "c"]),
        ([("a", "x"), ("b", "y"), ("c", "z")], 3, ["a", "b", "c"]),
        ([("a", None), ("b", None)], 0, ["a", "b"]),
    ],
    ids=["third-adapter-waits-base-goes", "same-adapter-shares", "room-for-all", "base-only"],
)
def test_scheduler_runs_at_most_max_loras_adapters(
    requests: list[tuple[str, str | None]], max_loras: int, admitted: list[str]
) -> None:
    scheduler = Scheduler(BlockManager(64, 4), max_batch_tokens=256, max_batch_size=8, max_loras=max_loras)
    for name, lora in requests:
        scheduler.add(_lora_seq(name, lora))  # type: ignore[arg-type]
    output = scheduler.schedule()
    assert [chunk.seq.request_id for chunk in output.chunks] == admitted
    left = [seq.request_id for seq in scheduler.waiting]
    assert left == [name for name, _ in requests if name not in admitted]  # passed over, in order


def _write_adapter(folder: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


SHAPES = {"model.layers.0.self_attn.q_proj": (8, 8), "model.layers.0.mlp.down_proj": (16, 8)}
Q = "base_model.model.model.layers.0.self_attn.q_proj"
GOOD = {f"{Q}.lora_A.weight": torch.ones(2, 8), f"{Q}.lora_B.weight": torch.ones(8, 2)}


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"use_dora": True}, GOOD, "use_dora"),
        ({"bias": "all"}, GOOD, "bias"),
        ({"peft_type": "IA3"}, GOOD, "LoRA adapters only"),
        ({"modules_to_save": ["lm_head"]}, GOOD, "modules_to_save"),
        ({}, {f"{Q}.lora_A.weight": torch.ones(2, 8)}, "lora_B missing"),
        ({}, {"base_model.model.lm_head.lora_A.weight": torch.ones(2, 8),
              "base_model.model.lm_head.lora_B.weight": torch.ones(8, 2)}, "cannot adapt"),
        ({}, {f"{Q}.lora_A.weight": torch.ones(2, 9), f"{Q}.lora_B.weight": torch.ones(8, 2)}, "base model"),
        ({"r": 8}, {f"{Q}.lora_A.weight": torch.ones(8, 8), f"{Q}.lora_B.weight": torch.ones(8, 8)}, "maxLoraRank 4"),
        ({}, {"embed.weight": torch.ones(2)}, "not a LoRA"),
        ({"lora_alpha": None}, GOOD, "no lora_alpha number"),
        ({"lora_alpha": "4"}, GOOD, "no lora_alpha number"),
        ({}, {f"{Q}.lora_A.weight": torch.ones(0, 8), f"{Q}.lora_B.weight": torch.ones(8, 0)}, "base model"),
        ({}, {f"{Q}.lora_A.weight": torch.ones(()), f"{Q}.lora_B.weight": torch.ones(8, 2)}, "base model"),
        ({"lora_alpha": 1e308}, GOOD, "not finite in torch.float32 once scaled"),
        ({}, {f"{Q}.lora_A.weight": torch.full((2, 8), math.nan), f"{Q}.lora_B.weight": torch.ones(8, 2)},
         "not finite"),
    ],
    ids=["dora", "bias", "not-lora", "modules-to-save", "half-a-pair", "lm-head", "wrong-shape", "rank", "stray",
         "no-alpha", "alpha-a-string", "rank-zero", "a-scalar", "alpha-overflows", "nan-weights"],
)  # fmt: skip
def test_adapters_herd_cannot_serve_are_refused(
    tmp_path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor], message: str
) -> None:
    folder = _write_adapter(tmp_path / "adapter", config, tensors)
    with pytest.raises(ValueError, match=message):
        read_adapter("a", folder, SHAPES, max_rank=4, dtype=torch.float32)


def test_scaling_is_folded_into_b(tmp_path: Path) -> None:
    folder = _write_adapter(tmp_path / "adapter", {"use_rslora": True, "lora_alpha": 6}, GOOD)
    adapter = read_adapter("a", folder, SHAPES, max_rank=4, dtype=torch.float32)
    lora_a, lora_b = adapter.weights["model.layers.0.self_attn.q_proj"]
    assert adapter.rank == 2
    assert lora_a.eq(1).all()
    torch.testing.assert_close(lora_b, torch.full((8, 2), 6 / 2**0.5))


@pytest.mark.parametrize(
    ("config_text", "weights", "message"),
    [
        ("[]", None, "not a JSON object"),
        ("{not json", None, "is not valid JSON"),
        (b"\xff\xfe", None, "is not valid JSON"),
        ('{"a": ' * 100 + "1" + "}" * 100, None, "nests arrays and objects more than 64"),
        (None, b"not a safetensors file", "not a readable safetensors file"),
    ],
    ids=["config-a-list", "config-not-json", "config-not-utf8", "config-too-deep", "weights-corrupt"],
)
def test_a_malformed_adapter_folder_is_a_clear_error(
    tmp_path: Path, config_text: str | bytes | None, weights: bytes | None, message: str
) -> None:
    folder = _write_adapter(tmp_path / "adapter", {}, GOOD)
    if isinstance(config_text, str):
        (folder / "adapter_config.json").write_text(config_text)
    elif config_text is not None:
        (folder / "adapter_config.json").write_bytes(config_text)
    if weights is not None:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(ValueError, match=message):
        read_adapter("a", folder, SHAPES, max_rank=4, dtype=torch.float32)
