"""The stacked linear layer: checkpoint tensors load into their rows; packing keeps the math."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional

from herd.worker.layers.linear import Linear

QKV = {"q_proj": 6, "k_proj": 2, "v_proj": 2}


@pytest.mark.parametrize(
    ("shards", "bias", "expected_names"),
    [
        (QKV, True, [f"attn.{n}.{p}" for n in QKV for p in ("weight", "bias")]),
        ({"gate_proj": 3, "up_proj": 3}, False, ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    ],
    ids=["qkv-with-bias", "gate-up"],
)
def test_each_checkpoint_tensor_fills_its_own_rows(
    shards: dict[str, int], bias: bool, expected_names: list[str]
) -> None:
    layer = Linear(4, shards, bias=bias)
    targets = list(layer.checkpoint_shards(expected_names[0].split(".")[0] + "."))
    assert [name for name, _, _ in targets] == expected_names
    assert all(narrow is None for _, _, narrow in targets)  # one rank: every tensor whole
    with torch.no_grad():
        for index, (_, rows, _) in enumerate(targets):
            rows.fill_(index)
    first_rows = [0, *torch.tensor(list(shards.values())).cumsum(0).tolist()[:-1]]
    step = 2 if bias else 1
    assert layer.weight[first_rows, 0].tolist() == [float(i * step) for i in range(len(shards))]


@pytest.mark.parametrize(
    ("dtype", "is_packed"), [(torch.float32, True), (torch.float64, False)], ids=["float32", "float64"]
)
def test_packing_keeps_the_output_and_drops_the_dense_weight(dtype: torch.dtype, is_packed: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    layer = Linear(64, {"proj": 96}, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64, generator=generator))
        layer.bias.copy_(torch.randn(96, generator=generator))  # type: ignore[union-attr]
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()  # type: ignore[union-attr]
    layer.pack()
    assert (layer.weight.numel() == 0) is is_packed
    for num_rows in (1, 16, 300):
        x = torch.randn(num_rows, 64, generator=generator, dtype=dtype)
        torch.testing.assert_close(layer(x), functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
