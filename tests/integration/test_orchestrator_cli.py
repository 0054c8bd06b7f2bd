"""``herd orchestrator`` and ``herd up`` argument handling, and their errors, without starting workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from herd.api.crd import RoundRobinRouting
from herd.api.manifest import parse_manifest
from herd.api.protocol import TOKEN_ENV
from herd.cli.orchestrator import local_model_path, parse_worker
from herd.cli.up import UpError, plan_workers
from herd.orchestrator.discovery import ModelConfig, WorkerEndpoint

ONE = [ModelConfig("m", RoundRobinRouting(strategy="round_robin"))]
TWO = [*ONE, ModelConfig("n", RoundRobinRouting(strategy="round_robin"))]


@pytest.mark.parametrize(
    ("value", "models", "expected"),
    [
        (
            "http://a:1,http://a:2",
            ONE,
            WorkerEndpoint("worker-0", "m", "http://a:1", "http://a:2", "unified"),
        ),
        (
            "n=http://a:1/,http://a:2,decode",
            TWO,
            WorkerEndpoint("worker-0", "n", "http://a:1", "http://a:2", "decode"),
        ),
        (
            "n=http://a:1,http://a:2,prefill,tiny-prefill-0",
            TWO,
            WorkerEndpoint("tiny-prefill-0", "n", "http://a:1", "http://a:2", "prefill"),
        ),
    ],
    ids=["single-model", "named-model-and-role", "named-worker"],
)
def test_parse_worker(value: str, models: list[ModelConfig], expected: WorkerEndpoint) -> None:
    assert parse_worker(value, models, 0) == expected


@pytest.mark.parametrize(
    ("value", "models", "message"),
    [
        ("http://a:1", ONE, "expected [MODEL=]URL,INTERNAL_URL"),
        ("http://a:1,http://a:2,boss", ONE, "expected [MODEL=]URL,INTERNAL_URL"),
        ("http://a:1,http://a:2", TWO, "name its model"),
        ("http://a:1,http://a:2,unified,", ONE, "expected [MODEL=]URL,INTERNAL_URL"),
    ],
    ids=["no-internal-url", "bad-role", "ambiguous-model", "empty-id"],
)
def test_parse_worker_errors(value: str, models: list[ModelConfig], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_worker(value, models, 0)


def test_local_model_path_resolves_relative_sources(tmp_path: Path) -> None:
    assert local_model_path("file://models/x", cwd=tmp_path) == tmp_path / "models" / "x"
    assert local_model_path("file:///abs/x", cwd=tmp_path) == Path("/abs/x")
    assert local_model_path("hf://Org/Name") is None


def deployment(source: str, **spec: object) -> object:
    return parse_manifest(
        {
            "apiVersion": "herd.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "tiny"},
            "spec": {"model": {"source": source}, **spec},
        }
    )


def test_plan_workers_for_each_pool(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # planning only checks that a model folder is there
    disaggregated = deployment(
        f"file://{tmp_path}",
        engine={"maxBatchSize": 8, "maxQueueLen": 100},
        serving={"mode": "disaggregated"},
        prefill={"replicas": 1, "engine": {"maxBatchTokens": 4096}},
        decode={"replicas": 2, "engine": {"maxBatchSize": 32}},
    )
    token = "-starts-like-a-flag"  # token_urlsafe makes one in 64 of these
    workers = plan_workers(disaggregated, token)  # type: ignore[arg-type]
    assert [[(e.id, e.role) for e in w.endpoints] for w in workers] == [
        [("tiny-prefill-0", "prefill")],
        [("tiny-decode-0", "decode")],
        [("tiny-decode-1", "decode")],
    ]
    assert len({w.endpoints[0].url for w in workers}) == 3
    argv = workers[0].argv
    assert argv[argv.index("--role") + 1] == "prefill"
    # The token travels in the environment: argv is public (ps) and a leading '-' would read as a flag.
    assert all(w.env[TOKEN_ENV] == token and not any(token in part for part in w.argv) for w in workers)
    engines = [json.loads(w.argv[w.argv.index("--engine-json") + 1]) for w in workers]
    assert [(e["maxBatchSize"], e["maxBatchTokens"]) for e in engines] == [(8, 4096), (32, 8192), (32, 8192)]
    # The gateway caps each decode worker at the decode pool's batch and queue, not the model's.
    assert ModelConfig.from_deployment(disaggregated).max_in_flight_per_worker == 32 + 100  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("source", "message"),
    [("hf://Org/Name", "herd up needs a local model"), ("file:///nonexistent", "holds no config.json")],
    ids=["remote-source", "missing-folder"],
)
def test_plan_workers_rejects_unusable_sources(source: str, message: str) -> None:
    with pytest.raises(UpError, match=message):
        plan_workers(deployment(source), "t")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "pvc://loras/sql",
            "adapter 'sql' source 'pvc://loras/sql' is not local; herd up needs local adapters",
        ),
        ("file:///nonexistent", "holds no adapter_config.json"),
    ],
    ids=["remote-adapter", "missing-adapter-folder"],
)
def test_plan_workers_rejects_unusable_adapter_sources(tiny_llama: Path, source: str, message: str) -> None:
    md = deployment(f"file://{tiny_llama}", adapters=[{"name": "sql", "source": source}])
    with pytest.raises(UpError, match=message):
        plan_workers(md, "t")  # type: ignore[arg-type]


@pytest.mark.e2e
def test_herd_up_reports_a_remote_source_and_exits(tmp_path: Path) -> None:
    manifest = tmp_path / "remote.yaml"
    manifest.write_text(
        "apiVersion: herd.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: remote}\n"
        "spec: {model: {source: 'hf://Org/Name'}}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "herd.cli.main", "up", str(manifest), "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "herd up needs a local model" in result.stderr


def test_orchestrator_rejects_a_poll_interval_of_zero() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "herd.cli.main",
            "orchestrator",
            "--poll-interval",
            "0",
            "--worker",
            "http://127.0.0.1:1,http://127.0.0.1:2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--poll-interval must be above 0 seconds" in result.stderr


@pytest.mark.e2e
def test_herd_up_names_the_log_of_a_worker_that_fails(tmp_path: Path) -> None:
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a folder that looks like a model but cannot load
    manifest = tmp_path / "broken.yaml"
    manifest.write_text(
        "apiVersion: herd.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: broken}\n"
        f"spec: {{model: {{source: 'file://{model}'}}, workers: {{replicas: 1}}}}\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "herd.cli.main",
            "up",
            str(manifest),
            "--log-dir",
            str(tmp_path / "logs"),
            "--ready-timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 1
    assert "worker broken-workers-0 exited with code" in result.stderr
    log = tmp_path / "logs" / "broken-workers-0.log"
    assert str(log) in result.stderr and log.exists()
