"""``herd operator`` as a real process against the emulator: it reconciles, answers liveness, stops on SIGTERM."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from support.kube.emulator import kube_emulator
from support.operator_harness import install_crd, kubectl
from support.procs import free_port, running, wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_herd_operator_process_reconciles_and_reports_liveness(tmp_path: Path) -> None:
    herd = shutil.which("herd") or str(REPO / ".venv" / "bin" / "herd")
    port = free_port()
    with kube_emulator(tmp_path / "kube") as kube:
        install_crd(kube)
        argv = [herd, "operator", "-n", "default", "--standalone", "--kubeconfig", str(kube.kubeconfig),
                "--liveness", f"http://127.0.0.1:{port}/healthz", "--worker-image", "me/worker:7", "--orchestrator-namespace", "herd"]  # fmt: skip
        with running(argv, log=tmp_path / "operator.log") as process:
            wait_until(
                lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200,
                timeout=60,
                what="liveness",
            )
            kubectl(kube, "apply", "--validate=false", "-f", str(REPO / "examples" / "smollm2.yaml"))
            wait_until(
                lambda: kube.find("deployments.apps", "smollm2-workers") is not None,
                timeout=60,
                what="Deployment",
            )
            image = kube.get("deployments.apps", "smollm2-workers")["spec"]["template"]["spec"]["containers"][
                0
            ]["image"]
            assert image == "me/worker:7"
            endpoint = "http://herd-orchestrator.herd.svc:8000/v1"
            wait_until(
                lambda: kube.get("md", "smollm2")["status"]["endpoint"] == endpoint,
                timeout=60,
                what="endpoint",
            )
            process.terminate()
            assert process.wait(timeout=60) == 0
        log = (tmp_path / "operator.log").read_text()
        assert '"component": "operator"' in log


@pytest.mark.parametrize("scope", [["-n", "default"], ["-A"]], ids=["namespace", "cluster-wide"])
def test_herd_operator_refuses_to_start_before_its_crd_is_installed(tmp_path: Path, scope: list[str]) -> None:
    herd = shutil.which("herd") or str(REPO / ".venv" / "bin" / "herd")
    with kube_emulator(tmp_path / "kube") as kube:
        argv = [herd, "operator", *scope, "--standalone", "--kubeconfig", str(kube.kubeconfig)]
        with running(argv, log=tmp_path / "operator.log") as process:
            assert process.wait(timeout=60) == 2
    assert "install the ModelDeployment CRD first" in (tmp_path / "operator.log").read_text()
