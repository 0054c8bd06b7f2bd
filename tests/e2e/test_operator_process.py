"""``herd operator`` as a real process on the real control plane: it reconciles, answers liveness,
stops on SIGTERM, and refuses to start where its CRD is not installed.

Moved from the kmock emulator (issue 19, item 6). What changed: the process logs in with a
TokenRequest token of the chart's operator ServiceAccount and serves every namespace, as the chart
runs it (no request it makes may be refused); the refusal runs on a control plane of its own, since
the session's shared one has the CRD.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.cluster import ControlPlane
from support.operator_harness import Models, is_refusal, model_deployment, model_namespace, own_control_plane
from support.procs import free_port, running, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "operator-process"
HERD = shutil.which("herd") or str(REPO / ".venv" / "bin" / "herd")


@pytest.fixture(scope="module")
def models(cluster: ControlPlane) -> Iterator[Models]:
    with model_namespace(cluster, NAMESPACE) as models:
        yield models


def test_herd_operator_process_reconciles_and_reports_liveness(models: Models, tmp_path: Path) -> None:
    login = models.plane.login_as("herd-operator", "herd", default_namespace=NAMESPACE)
    port, log = free_port(), tmp_path / "operator.log"
    argv = [HERD, "operator", "-A", "--standalone", "--kubeconfig", str(login.kubeconfig),
            "--liveness", f"http://127.0.0.1:{port}/healthz", "--worker-image", "me/worker:7",
            "--orchestrator-namespace", "herd"]  # fmt: skip
    with running(argv, log=log) as process:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, timeout=60,
                   what="liveness")  # fmt: skip
        models.apply(model_deployment("process"))
        wait_until(lambda: "Deployment/process-workers" in models.children("process"), timeout=60, what="Deployment")  # fmt: skip
        template = models.children("process")["Deployment/process-workers"]["spec"]["template"]
        assert template["spec"]["containers"][0]["image"] == "me/worker:7"
        endpoint = "http://herd-orchestrator.herd.svc:8000/v1"
        wait_until(lambda: models.get("md", "process").get("status", {}).get("endpoint") == endpoint,
                   timeout=60, what="endpoint")  # fmt: skip
        process.terminate()
        assert process.wait(timeout=60) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]  # JSON lines only
    assert records and all(record["component"] == "operator" for record in records)
    # One concise line per event: no settings dump, no kopf chatter, no line per API request.
    assert not [record for record in records if {"settings", "k8s_ref", "k8s_skip"} & set(record)]
    assert not [record for record in records if record["logger"] == "httpx"]
    assert not [record for record in records if record["msg"].endswith("succeeded.")]
    messages = [(record["level"], record["msg"]) for record in records]
    assert messages.count(("info", "operator started: serving every namespace")) == 1
    about = [(level, msg) for (level, msg), record in zip(messages, records, strict=True)
             if record.get("object") == f"ModelDeployment {NAMESPACE}/process"]  # fmt: skip
    assert ("info", "waiting for ready pods: workers 0/2") in about, about
    warnings = [json.dumps(record) for record in records if record["level"] in ("warning", "error")]
    refused = [warning for warning in warnings if is_refusal(warning)]
    assert not refused, refused[:3]


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A control plane of its own with no CRD installed."""
    with own_control_plane(tmp_path_factory.mktemp("bare")) as plane:
        yield plane


@pytest.mark.parametrize("scope", [["-n", "default"], ["-A"]], ids=["namespace", "cluster-wide"])
def test_herd_operator_refuses_to_start_before_its_crd_is_installed(
    bare: ControlPlane, tmp_path: Path, scope: list[str]
) -> None:
    argv = [HERD, "operator", *scope, "--standalone", "--kubeconfig", str(bare.kubeconfig)]
    with running(argv, log=tmp_path / "operator.log") as process:
        assert process.wait(timeout=60) == 2
    assert "install the ModelDeployment CRD first" in (tmp_path / "operator.log").read_text()
