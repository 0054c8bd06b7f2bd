"""The pod template by ``engine.backend``: herd's worker, the simulated worker (no weights
fetched), or vLLM with herd's sidecar in front of it on the worker's ports."""

from __future__ import annotations

import json
from typing import Any

import pytest

from herd.api.crd import CostModel, ModelDeployment
from herd.operator.plan import plan
from herd.operator.pod import HTTP_PORT, INTERNAL_PORT, VLLM_PORT
from herd.operator.settings import PlanSettings
from herd.operator.source import WEIGHT_FILES

SETTINGS = PlanSettings(worker_image="herd/worker:1", vllm_image="vllm/vllm-openai:9")
GPU = {"resources": {"accelerator": {"vendor": "nvidia", "count": 1}, "memory": "16Gi"}}


def make_md(engine: dict[str, Any], **spec: Any) -> ModelDeployment:
    body = {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "chat", "namespace": "ml"},
        "spec": {"model": {"source": "hf://Org/Chat"}, "engine": engine, **spec},
    }
    return ModelDeployment.model_validate(body)


def pod(md: ModelDeployment) -> dict[str, Any]:
    deployment = next(obj for obj in plan(md, SETTINGS).objects if obj.kind == "Deployment")
    spec: dict[str, Any] = deployment.body["spec"]["template"]["spec"]
    return spec


def containers(md: ModelDeployment) -> dict[str, dict[str, Any]]:
    return {container["name"]: container for container in pod(md)["containers"]}


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(
    ("engine", "names", "fetches_weights", "backend"),
    [
        ({}, ["worker"], True, "herd"),
        (
            {"backend": "simulated", "simulation": {"costModel": {"stepMs": 7}}},
            ["worker"],
            False,
            "simulated",
        ),
        ({"backend": "vllm"}, ["vllm", "sidecar"], True, None),
    ],
    ids=["herd", "simulated", "vllm"],
)
def test_each_backend_renders_its_containers(
    engine: dict[str, Any], names: list[str], fetches_weights: bool, backend: str | None
) -> None:
    md = make_md(engine)
    assert list(containers(md)) == names
    (fetch,) = pod(md)["initContainers"]
    assert all((pattern in fetch["command"]) != fetches_weights for pattern in WEIGHT_FILES)
    if backend is not None:
        sent = json.loads(arg(containers(md)["worker"]["command"], "--engine-json"))
        assert sent["backend"] == backend


def test_a_simulated_worker_gets_its_cost_model_in_the_engine_json() -> None:
    md = make_md({"backend": "simulated", "simulation": {"costModel": {"stepMs": 7, "seqMs": 0.5}}})
    sent = json.loads(arg(containers(md)["worker"]["command"], "--engine-json"))
    given = CostModel.model_validate({"stepMs": 7, "seqMs": 0.5})
    assert sent["simulation"]["costModel"] == given.model_dump(by_alias=True)  # defaults spelled out
    assert containers(md)["worker"]["image"] == "herd/worker:1"


@pytest.mark.parametrize(
    ("vllm", "image", "extra"),
    [
        (None, "vllm/vllm-openai:9", []),
        ({"image": "my/vllm:2", "extraArgs": ["--enforce-eager"]}, "my/vllm:2", ["--enforce-eager"]),
    ],
    ids=["operator-image", "spec-image-and-args"],
)
def test_a_vllm_pod_runs_vllm_on_loopback(vllm: dict[str, Any] | None, image: str, extra: list[str]) -> None:
    engine: dict[str, Any] = {"backend": "vllm", "maxModelLen": 2048, "kvCache": {"blockSize": 32}}
    md = make_md({**engine, **({"vllm": vllm} if vllm else {})}, workers=GPU)
    server = containers(md)["vllm"]
    argv = server["command"]
    assert server["image"] == image
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[len(argv) - len(extra) :] == extra
    assert (arg(argv, "--host"), arg(argv, "--port")) == ("127.0.0.1", str(VLLM_PORT))
    assert (arg(argv, "--max-model-len"), arg(argv, "--block-size")) == ("2048", "32")
    assert arg(argv, "--served-model-name") == "chat"
    assert "ports" not in server and "readinessProbe" not in server
    assert server["resources"] == {"requests": {"memory": "16Gi"}, "limits": {"nvidia.com/gpu": "1"}}
    assert f"127.0.0.1:{VLLM_PORT}/health" in " ".join(server["livenessProbe"]["exec"]["command"])


def test_the_vllm_sidecar_serves_the_worker_contract_on_the_worker_ports() -> None:
    md = make_md({"backend": "vllm", "kvCache": {"blockSize": 32}}, workers=GPU)
    sidecar = containers(md)["sidecar"]
    argv = sidecar["command"]
    assert argv[:2] == ["herd", "sidecar"] and sidecar["image"] == "herd/worker:1"
    assert arg(argv, "--vllm-url") == f"http://127.0.0.1:{VLLM_PORT}"
    assert (arg(argv, "--port"), arg(argv, "--internal-port")) == (str(HTTP_PORT), str(INTERNAL_PORT))
    assert (arg(argv, "--block-size"), arg(argv, "--served-name")) == ("32", "chat")
    assert [(p["name"], p["containerPort"]) for p in sidecar["ports"]] == [
        ("http", HTTP_PORT),
        ("internal", INTERNAL_PORT),
    ]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert "resources" not in sidecar, "the accelerator is vLLM's"
    assert sidecar["env"][0]["valueFrom"]["secretKeyRef"]["name"] == SETTINGS.token_secret


def test_the_service_is_the_same_for_every_backend() -> None:
    def service(engine: dict[str, Any]) -> dict[str, Any]:
        obj = next(obj for obj in plan(make_md(engine), SETTINGS).objects if obj.kind == "Service")
        body: dict[str, Any] = obj.body["spec"]
        return body

    assert service({}) == service({"backend": "vllm"}) == service({"backend": "simulated"})
