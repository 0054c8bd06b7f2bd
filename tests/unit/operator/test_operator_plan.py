"""The pure planner: ModelDeployment -> Deployments and Services, with no server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from herd.api.crd import ModelDeployment
from herd.api.manifest import load_manifest
from herd.operator.plan import ANNOTATION_SPEC_HASH, LABEL_TEMPLATE_HASH, plan
from herd.operator.settings import PlanSettings

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SETTINGS = PlanSettings()


def make_md(**spec: Any) -> ModelDeployment:
    body = {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "chat", "namespace": "ml", "generation": 3},
        "spec": {"model": {"source": "file:///weights/chat"}, **spec},
    }
    return ModelDeployment.model_validate(body)


def deployments(md: ModelDeployment) -> dict[str, dict[str, Any]]:
    return {obj.name: obj.body for obj in plan(md, SETTINGS).objects if obj.kind == "Deployment"}


def container(md: ModelDeployment, name: str = "chat-workers") -> dict[str, Any]:
    return deployments(md)[name]["spec"]["template"]["spec"]["containers"][0]


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


DISAGG = {
    "serving": {"mode": "disaggregated"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 3},
}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, {"Deployment/chat-workers": 1, "Service/chat-workers": None}),
        ({"workers": {"replicas": 4}}, {"Deployment/chat-workers": 4, "Service/chat-workers": None}),
        (
            {"workers": {"replicas": 4}, "replicas": 7},
            {"Deployment/chat-workers": 7, "Service/chat-workers": None},
        ),
        (
            DISAGG,
            {
                "Deployment/chat-prefill": 1,
                "Service/chat-prefill": None,
                "Deployment/chat-decode": 3,
                "Service/chat-decode": None,
            },
        ),
        (
            {**DISAGG, "replicas": 5},
            {
                "Deployment/chat-prefill": 1,
                "Service/chat-prefill": None,
                "Deployment/chat-decode": 5,
                "Service/chat-decode": None,
            },
        ),
    ],
    ids=[
        "aggregated-default",
        "aggregated-4",
        "scale-overrides-workers",
        "disaggregated",
        "scale-overrides-decode",
    ],
)
def test_objects_and_replicas(spec: dict[str, Any], expected: dict[str, int | None]) -> None:
    objects = plan(make_md(**spec), SETTINGS).objects
    got = {f"{obj.kind}/{obj.name}": obj.body["spec"].get("replicas") for obj in objects}
    assert got == expected


@pytest.mark.parametrize(
    ("spec", "name", "role"),
    [({}, "chat-workers", "unified"), (DISAGG, "chat-prefill", "prefill"), (DISAGG, "chat-decode", "decode")],
    ids=["unified", "prefill", "decode"],
)
def test_labels_selector_and_role(spec: dict[str, Any], name: str, role: str) -> None:
    md = make_md(**spec)
    body = deployments(md)[name]
    labels = {"app.kubernetes.io/managed-by": "herd", "herd.dev/deployment": "chat", "herd.dev/role": role}
    assert body["metadata"]["labels"] == labels
    assert body["metadata"]["namespace"] == "ml"
    assert body["spec"]["selector"] == {"matchLabels": labels}
    template_labels = body["spec"]["template"]["metadata"]["labels"]
    assert {k: v for k, v in template_labels.items() if k != LABEL_TEMPLATE_HASH} == labels
    assert arg(container(md, name)["command"], "--role") == role


def test_worker_command() -> None:
    md = make_md(
        model={"source": "file:///weights/chat", "servedName": "chatty"}, engine={"maxModelLen": 1024}
    )
    argv = container(md)["command"]
    assert argv[:2] == ["herd", "worker"]
    assert arg(argv, "--model") == "/weights/chat"
    assert arg(argv, "--served-name") == "chatty"
    assert (arg(argv, "--host"), arg(argv, "--port"), arg(argv, "--internal-port")) == (
        "0.0.0.0",
        "8000",
        "9000",
    )
    engine = json.loads(arg(argv, "--engine-json"))
    assert engine["maxModelLen"] == 1024
    assert engine["kvCache"]["blockSize"] == 16


def test_each_pool_runs_its_own_engine_settings() -> None:
    md = make_md(
        engine={"maxBatchTokens": 512},
        serving={"mode": "disaggregated"},
        prefill={"engine": {"maxBatchTokens": 8192}},
        decode={"engine": {"maxBatchSize": 256}},
    )
    prefill = json.loads(arg(container(md, "chat-prefill")["command"], "--engine-json"))
    decode = json.loads(arg(container(md, "chat-decode")["command"], "--engine-json"))
    assert (prefill["maxBatchTokens"], prefill["maxBatchSize"]) == (8192, 64)
    assert (decode["maxBatchTokens"], decode["maxBatchSize"]) == (512, 256)
    assert prefill["kvCache"] == decode["kvCache"]


def test_probes_drain_and_token() -> None:
    worker = container(make_md())
    assert worker["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert worker["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(SETTINGS.drain_seconds)]
    pod = deployments(make_md())["chat-workers"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > SETTINGS.drain_seconds
    token = next(env for env in worker["env"] if env["name"] == "HERD_INTERNAL_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": SETTINGS.token_secret, "key": "token"}


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({"accelerator": {"vendor": "nvidia", "count": 2}}, {"limits": {"nvidia.com/gpu": "2"}}),
        ({"accelerator": {"vendor": "amd", "count": 1}, "cpu": "4"}, {"limits": {"amd.com/gpu": "1"}, "requests": {"cpu": "4"}}),
        ({"accelerator": {"vendor": "none"}, "cpu": "2", "memory": "4Gi"}, {"requests": {"cpu": "2", "memory": "4Gi"}}),
        ({"accelerator": {"vendor": "nvidia", "count": 0}}, None),
        ({}, None),
    ],
    ids=["nvidia-x2", "amd-with-cpu", "cpu-only", "nvidia-count-0", "nothing"],
)  # fmt: skip
def test_resources(resources: dict[str, Any], expected: dict[str, Any] | None) -> None:
    assert container(make_md(workers={"resources": resources})).get("resources") == expected


@pytest.mark.parametrize(
    "source", ["hf://Org/Name", "s3://bucket/model", "file://models/x"], ids=["hf", "s3", "file"]
)
def test_security_context_without_privileges(source: str) -> None:
    pod = deployments(make_md(model={"source": source}))["chat-workers"]["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": SETTINGS.run_as_user,
        "runAsGroup": SETTINGS.run_as_user,
        "fsGroup": SETTINGS.fs_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    for container in pod["containers"] + pod.get("initContainers", []):
        assert container["securityContext"] == {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        }, container["name"]


@pytest.mark.parametrize(
    ("probe", "path"),
    [("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")],
    ids=["startup", "liveness", "readiness"],
)
def test_probes_match_what_health_and_ready_mean(probe: str, path: str) -> None:
    """Only /health (the process cannot serve) may restart a worker; /ready (loading, draining, full)
    only takes it out of the Service. The startup probe covers the longest model load."""
    worker = container(make_md())
    assert worker[probe]["httpGet"] == {"path": path, "port": "http"}
    assert worker[probe]["timeoutSeconds"] > 1  # a busy CPU worker answers slower than the default
    if probe == "startupProbe":
        assert worker[probe]["periodSeconds"] * worker[probe]["failureThreshold"] >= 600


def test_node_selector_tolerations_image_env() -> None:
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    pool = {
        "nodeSelector": {"gpu": "h100"},
        "tolerations": [toleration],
        "image": "me/worker:1",
        "env": {"A": "1"},
    }
    md = make_md(workers=pool)
    pod = deployments(md)["chat-workers"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [toleration]
    assert pod["containers"][0]["image"] == "me/worker:1"
    assert {"name": "A", "value": "1"} in pod["containers"][0]["env"]


def test_defaults_leave_out_empty_fields() -> None:
    pod = deployments(make_md(model={"source": "file://models/x"}))["chat-workers"]["spec"]["template"][
        "spec"
    ]
    assert not {"nodeSelector", "tolerations", "volumes", "initContainers"} & set(pod)
    assert "securityContext" in pod
    assert pod["containers"][0]["image"] == SETTINGS.worker_image


@pytest.mark.parametrize(
    ("model", "path", "volume", "init_argv"),
    [
        (
            {"source": "hf://Org/Name", "revision": "v2"},
            "/models/hf/Org/Name/v2",
            {"name": "models", "emptyDir": {}},
            ["hf", "download", "Org/Name", "--revision", "v2", "--local-dir", "/models/hf/Org/Name/v2"],
        ),
        (
            {"source": "hf://Org/Name", "cache": {"pvc": "model-cache"}},
            "/models/hf/Org/Name/main",
            {"name": "models", "persistentVolumeClaim": {"claimName": "model-cache"}},
            ["hf", "download", "Org/Name", "--revision", "main", "--local-dir", "/models/hf/Org/Name/main"],
        ),
        (
            {"source": "s3://bucket/llama/8b"},
            "/models/s3/bucket/llama/8b",
            {"name": "models", "emptyDir": {}},
            ["aws", "s3", "sync", "s3://bucket/llama/8b", "/models/s3/bucket/llama/8b"],
        ),
        (
            {"source": "pvc://weights/llama/8b"},
            "/models/pvc/weights/llama/8b",
            {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
            None,
        ),
        (
            {"source": "file:///mnt/llama"},
            "/mnt/llama",
            {"name": "models", "hostPath": {"path": "/mnt/llama", "type": "Directory"}},
            None,
        ),
        ({"source": "file://.cache/models/x"}, ".cache/models/x", None, None),
    ],
    ids=["hf-emptydir", "hf-cache-pvc", "s3", "pvc", "file-node-path", "file-in-image"],
)
def test_model_source(
    model: dict[str, Any], path: str, volume: dict[str, Any] | None, init_argv: list[str] | None
) -> None:
    md = make_md(model=model)
    pod = deployments(md)["chat-workers"]["spec"]["template"]["spec"]
    assert arg(pod["containers"][0]["command"], "--model") == path
    assert pod.get("volumes") == ([volume] if volume else None)
    mounts = pod["containers"][0].get("volumeMounts", [])
    assert all(mount["readOnly"] for mount in mounts)
    assert any(path.startswith(mount["mountPath"]) for mount in mounts) == (volume is not None)
    inits = pod.get("initContainers", [])
    assert [init["command"] for init in inits] == ([init_argv] if init_argv else [])
    assert all(not mount["readOnly"] for init in inits for mount in init["volumeMounts"])


def test_adapters_are_mounted_or_fetched_apart_and_passed_to_the_worker() -> None:
    adapters = [
        {"name": "sql", "source": "pvc://loras/sql"},
        {"name": "poet", "source": "hf://Org/poet-lora"},
        {"name": "local", "source": "file:///mnt/loras/local"},
    ]
    pod = deployments(make_md(adapters=adapters))["chat-workers"]["spec"]["template"]["spec"]
    argv = pod["containers"][0]["command"]
    modules = argv[argv.index("--lora-modules") + 1 :]
    assert modules == [
        "sql=/adapters/0/pvc/loras/sql",
        "poet=/adapters/1/hf/Org/poet-lora/main",
        "local=/mnt/loras/local",
    ]
    assert [volume["name"] for volume in pod["volumes"]] == ["models", "adapter-0", "adapter-1", "adapter-2"]
    assert [init["name"] for init in pod["initContainers"]] == ["fetch-adapter-1"]
    mounts = {mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]}
    assert {"/adapters/0/pvc/loras", "/adapters/1", "/mnt/loras/local"} <= mounts


def test_headless_service_per_pool() -> None:
    services = [obj.body for obj in plan(make_md(**DISAGG), SETTINGS).objects if obj.kind == "Service"]
    assert [svc["metadata"]["name"] for svc in services] == ["chat-prefill", "chat-decode"]
    for svc in services:
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == svc["metadata"]["labels"]
        assert {port["name"]: port["port"] for port in svc["spec"]["ports"]} == {
            "http": 8000,
            "internal": 9000,
        }


def hashes(md: ModelDeployment) -> dict[str, tuple[str, str | None]]:
    return {
        f"{obj.kind}/{obj.name}": (
            obj.body["metadata"]["annotations"][ANNOTATION_SPEC_HASH],
            obj.body["spec"]
            .get("template", {})
            .get("metadata", {})
            .get("labels", {})
            .get(LABEL_TEMPLATE_HASH),
        )
        for obj in plan(md, SETTINGS).objects
    }


def test_hashes_are_stable_and_track_changes() -> None:
    base = hashes(make_md())
    assert base == hashes(make_md())
    scaled = hashes(make_md(workers={"replicas": 3}))
    assert scaled["Deployment/chat-workers"][0] != base["Deployment/chat-workers"][0]
    # Scaling is not a new pod template: no rollout.
    assert scaled["Deployment/chat-workers"][1] == base["Deployment/chat-workers"][1]
    assert scaled["Service/chat-workers"] == base["Service/chat-workers"]
    longer = hashes(make_md(engine={"maxModelLen": 8192}))
    assert longer["Deployment/chat-workers"][1] != base["Deployment/chat-workers"][1]


def test_plan_does_not_share_mutable_dicts() -> None:
    body = plan(make_md(), SETTINGS).objects[0].body
    body["metadata"]["labels"]["extra"] = "x"
    assert "extra" not in body["spec"]["selector"]["matchLabels"]
    assert "extra" not in body["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_plans(path: Path) -> None:
    for md in load_manifest(path):
        result = plan(md, SETTINGS)
        assert len(result.objects) == 2 * len(md.spec.pools())
        assert result.summary().startswith("Deployment/")


def test_gateway_inference_pool_plans_the_picker_and_the_pool_beside_the_pools() -> None:
    planned = plan(make_md(gateway={"inferencePool": True}), SETTINGS)
    gateway = {(obj.kind, obj.name): obj.body for obj in planned.objects if obj.component == "gateway"}
    assert sorted(gateway) == [
        ("Deployment", "chat-epp"),
        ("InferencePool", "chat"),
        ("Role", "chat-epp"),
        ("RoleBinding", "chat-epp"),
        ("Service", "chat-epp"),
        ("ServiceAccount", "chat-epp"),
    ]
    pool = gateway[("InferencePool", "chat")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"] == {
        "selector": {
            "matchLabels": {
                "app.kubernetes.io/managed-by": "herd",
                "herd.dev/deployment": "chat",
                "herd.dev/role": "unified",
            }
        },
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
    }
    pod = gateway[("Deployment", "chat-epp")]["spec"]["template"]
    assert "herd.dev/role" not in pod["metadata"]["labels"]  # never discovered as a worker
    argv = pod["spec"]["containers"][0]["args"]
    assert argv[:2] == ["epp", "--kubernetes"] and arg(argv, "--namespace") == "ml"
    assert pod["spec"]["serviceAccountName"] == "chat-epp"
    assert gateway[("RoleBinding", "chat-epp")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "chat-epp", "namespace": "ml"}
    ]
    assert planned.summary().count(" x") == 1  # only the pool's Deployment counts replicas
    without = plan(make_md(), SETTINGS)
    assert all(obj.component == "pool" for obj in without.objects)


def test_gateway_inference_pool_refuses_a_disaggregated_model() -> None:
    pools = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    with pytest.raises(ValueError, match=r"gateway\.inferencePool needs serving\.mode aggregated"):
        make_md(serving={"mode": "disaggregated"}, gateway={"inferencePool": True}, **pools)
