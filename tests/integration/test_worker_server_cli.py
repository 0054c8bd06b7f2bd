"""``herd worker``'s engine settings: the manifest's engine block with the flags laid over it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from herd.api.crd import EngineSpec
from herd.cli.main import build_parser
from herd.cli.worker import engine_spec


@pytest.mark.parametrize(
    ("engine_json", "overrides", "expected"),
    [
        (None, {}, {"max_model_len": 4096, "block_size": 16}),
        (
            '{"maxModelLen": 1024, "kvCache": {"blockSize": 32}}',
            {},
            {"max_model_len": 1024, "block_size": 32},
        ),
        (
            '{"maxModelLen": 1024}',
            {"max_model_len": 512, "block_size": 8},
            {"max_model_len": 512, "block_size": 8},
        ),
        (None, {"kv_memory_gib": 0.5, "dtype": "bfloat16"}, {"memory_gib": 0.5, "dtype": "bfloat16"}),
        (
            '{"kvCache": {"prefixCaching": false}}',
            {"block_size": 64},
            {"prefix_caching": False, "block_size": 64},
        ),
        (
            EngineSpec(max_batch_size=3).model_dump_json(by_alias=True),
            {},
            {"max_batch_size": 3, "memory_gib": None},
        ),
    ],
    ids=[
        "defaults",
        "manifest",
        "flags-win",
        "memory-and-dtype",
        "flags-merge-into-nested",
        "as-herd-up-sends-it",
    ],
)
def test_engine_spec_layers_flags_over_the_manifest(
    engine_json: str | None, overrides: dict[str, Any], expected: dict[str, Any]
) -> None:
    spec = engine_spec(engine_json, overrides)
    flat = {**spec.model_dump(), **spec.kv_cache.model_dump()}
    assert {name: flat[name] for name in expected} == expected


def test_a_bad_engine_block_names_the_field() -> None:
    with pytest.raises(ValidationError, match="blockSize"):
        engine_spec(json.dumps({"kvCache": {"blockSize": 12}}), {})


def test_the_worker_command_parses_with_defaults() -> None:
    args = build_parser(["worker"]).parse_args(["worker", "--model", "/models/m"])
    assert (args.host, args.port, args.internal_port, args.role) == ("127.0.0.1", 8001, None, "unified")


def test_a_missing_token_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HERD_INTERNAL_TOKEN", raising=False)
    args = build_parser(["worker"]).parse_args(["worker", "--model", "/models/m"])
    assert args.func(args) == 2
    assert "HERD_INTERNAL_TOKEN" in capsys.readouterr().err
