"""The vLLM backend's command lines: what they say for each engine spec, and that vLLM 0.32's own
argument parser takes them (when the vLLM environment is built)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from support.vllm_env import VLLM_PYTHON, skip_without_vllm

from herd.api.backends import KV_EVENTS_TOPIC, sidecar_argv, vllm_server_argv
from herd.api.crd import EngineSpec

GIB = 2**30


def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--name value`` pairs (a flag without a value maps to None)."""
    flags: dict[str, str | None] = {}
    for index, part in enumerate(argv):
        if part.startswith("--"):
            following = argv[index + 1] if index + 1 < len(argv) else "--"
            flags[part] = None if following.startswith("--") else following
    return flags


def _vllm(engine: dict[str, Any]) -> list[str]:
    return vllm_server_argv(EngineSpec.model_validate(engine), "/models/m", "m", 8000, 5557, 5558)


@pytest.mark.parametrize(
    ("engine", "expected"),
    [
        pytest.param(
            {},
            {
                "--dtype": "auto",
                "--max-model-len": "4096",
                "--max-num-seqs": "64",
                "--max-num-batched-tokens": "8192",
                "--block-size": "16",
                "--enable-prefix-caching": None,
                "--gpu-memory-utilization": "0.9",
            },
            id="defaults",
        ),
        pytest.param(
            {"dtype": "float32", "maxModelLen": 2048, "kvCache": {"blockSize": 32, "prefixCaching": False}},
            {
                "--dtype": "float32",
                "--max-model-len": "2048",
                "--block-size": "32",
                "--no-enable-prefix-caching": None,
            },
            id="dtype-length-block-no-prefix-caching",
        ),
        pytest.param(
            {"kvCache": {"memoryGiB": 2.5}},
            {"--kv-cache-memory-bytes": str(int(2.5 * GIB))},
            id="kv-pool-in-gib",
        ),
        pytest.param(
            {"device": "cpu", "kvCache": {"blockSize": 64}},
            {"--kv-cache-memory-bytes": str(GIB), "--block-size": "64"},
            id="cpu-default-pool",
        ),
        pytest.param(
            {"device": "cuda", "kvCache": {"memoryUtilization": 0.5}},
            {"--gpu-memory-utilization": "0.5"},
            id="cuda-share",
        ),
        pytest.param(
            {"task": "embed", "maxModelLen": 256},
            {"--runner": "pooling", "--convert": "embed", "--no-enable-prefix-caching": None},
            id="embed",
        ),
        pytest.param({"task": "generate"}, {"--runner": "generate", "--convert": "<missing>"}, id="generate"),
        pytest.param({}, {"--runner": "<missing>"}, id="auto-leaves-it-to-vllm"),
    ],
)
def test_vllm_argv_follows_the_engine_spec(engine: dict[str, Any], expected: dict[str, str | None]) -> None:
    flags = _flags(_vllm(engine))
    assert {name: flags.get(name, "<missing>") for name in expected} == expected
    assert ("--enable-prefix-caching" in flags) != ("--no-enable-prefix-caching" in flags)
    assert ("--kv-cache-memory-bytes" in flags) != ("--gpu-memory-utilization" in flags)


@pytest.mark.parametrize(
    ("engine", "adapters", "expected"),
    [
        ({}, {}, []),
        (
            {},
            {"sql": "/a/sql", "poet": "/a/poet"},
            [
                "--enable-lora",
                "--max-loras",
                "4",
                "--max-lora-rank",
                "16",
                "--lora-modules",
                "sql=/a/sql",
                "poet=/a/poet",
            ],
        ),
        (
            {"maxLoras": 2, "maxLoraRank": 64},
            {},
            ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "64"],
        ),
    ],
    ids=["no-lora", "adapters-default-slots", "runtime-only"],
)
def test_vllm_gets_lora_flags_for_adapters_and_slots(
    engine: dict[str, Any], adapters: dict[str, str], expected: list[str]
) -> None:
    argv = vllm_server_argv(
        EngineSpec.model_validate(engine), "/models/m", "m", 8000, 5557, 5558, adapters=adapters
    )
    start = argv.index("--enable-lora") if "--enable-lora" in argv else len(argv)
    assert argv[start : start + len(expected)] == expected


def test_a_cpu_block_size_vllm_refuses_is_refused_here() -> None:
    with pytest.raises(ValueError, match="blockSize 16 does not suit vLLM on a CPU"):
        _vllm({"device": "cpu"})


def test_vllm_argv_serves_on_loopback_and_publishes_kv_events_to_the_sidecar() -> None:
    argv = _vllm({})
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = _flags(argv)
    assert (flags["--model"], flags["--served-model-name"]) == ("/models/m", "m")
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "8000")
    assert "--enable-prompt-tokens-details" in flags
    assert json.loads(flags["--kv-events-config"] or "") == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557",  # no '*': vLLM's PUB socket connects to the sidecar
        "replay_endpoint": "tcp://127.0.0.1:5558",
        "topic": KV_EVENTS_TOPIC,
    }


def test_the_specs_extra_args_come_last_so_that_they_win() -> None:
    argv = _vllm({"backend": "vllm", "vllm": {"extraArgs": ["--enforce-eager", "--max-model-len", "512"]}})
    assert argv[-3:] == ["--enforce-eager", "--max-model-len", "512"]


def test_sidecar_argv_names_the_same_ports() -> None:
    argv = sidecar_argv(
        vllm_port=8000,
        kv_events_port=5557,
        replay_port=5558,
        served_name="m",
        model_path="/models/m",
        block_size=32,
        host="0.0.0.0",
        port=8001,
        internal_port=9001,
        herd=("py", "-m", "herd.cli.main"),
    )
    assert argv[:4] == ["py", "-m", "herd.cli.main", "sidecar"]
    assert _flags(argv) == {
        "--vllm-url": "http://127.0.0.1:8000",
        "--kv-events": "tcp://127.0.0.1:5557",
        "--kv-replay": "tcp://127.0.0.1:5558",
        "--served-name": "m",
        "--model": "/models/m",
        "--block-size": "32",
        "--role": "unified",
        "--host": "0.0.0.0",
        "--port": "8001",
        "--internal-port": "9001",
    }


_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
print(json.dumps({
    "model": engine.model, "served": engine.served_model_name, "dtype": engine.dtype,
    "max_model_len": engine.max_model_len, "block_size": engine.block_size,
    "prefix_caching": engine.enable_prefix_caching, "kv_bytes": engine.kv_cache_memory_bytes,
    "max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens,
    "events": engine.kv_events_config.endpoint, "replay": engine.kv_events_config.replay_endpoint,
    "host": args.host, "port": args.port, "details": args.enable_prompt_tokens_details,
    "runner": engine.runner, "convert": engine.convert,
}))
"""


def _parsed_by_vllm(engine: dict[str, Any]) -> dict[str, Any]:
    argv = _vllm(engine)
    result = subprocess.run(
        [str(VLLM_PYTHON), "-c", _PARSE, *argv[3:]], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    parsed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return parsed


@pytest.mark.slow
@skip_without_vllm
def test_vllm_own_parser_takes_the_argv() -> None:
    engine = {
        "dtype": "float32",
        "device": "cpu",
        "maxModelLen": 2048,
        "kvCache": {"blockSize": 32, "prefixCaching": False},
    }
    parsed = _parsed_by_vllm(engine)
    assert parsed == {
        "model": "/models/m",
        "served": ["m"],
        "dtype": "float32",
        "max_model_len": 2048,
        "block_size": 32,
        "prefix_caching": False,
        "kv_bytes": GIB,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "events": "tcp://127.0.0.1:5557",
        "replay": "tcp://127.0.0.1:5558",
        "host": "127.0.0.1",
        "port": 8000,
        "details": True,
        "runner": "auto",
        "convert": "auto",
    }


@pytest.mark.slow
@skip_without_vllm
def test_vllm_own_parser_takes_an_embedding_models_argv() -> None:
    parsed = _parsed_by_vllm(
        {"task": "embed", "device": "cpu", "maxModelLen": 256, "kvCache": {"blockSize": 32}}
    )
    assert (parsed["runner"], parsed["convert"], parsed["prefix_caching"]) == ("pooling", "embed", False)
