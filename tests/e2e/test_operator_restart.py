"""``herd operator`` killed with SIGKILL in the middle of a reconcile pass, then started again: it
converges, every child exists once with the desired spec, and the status is written for the
current generation.

On the real control plane (moved from the kmock emulator, issue 19, item 6): a validating admission
webhook on 127.0.0.1 holds the operator's first Service create in the test's namespace until the test
has killed the process, so the kill lands between children: the first pool's Deployment exists, its
Service request is in flight, the second pool is not made yet. The webhook also sees who asked: the
chart's operator ServiceAccount, whose token the process logs in with. What changed: the emulator let
the held request through as a dead client's; the real apiserver may drop it with its client, and the
test holds either way. The pods stay Pending (no node matches their pools), so the status shows the
pools 0/N rather than Ready.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support.cluster import ControlPlane
from support.operator_harness import Models, model_deployment, model_namespace, pending_pool
from support.procs import free_port, running, wait_until

from herd.api.crd import ModelDeployment
from herd.operator.plan import ANNOTATION_SPEC_HASH, plan
from herd.operator.settings import PlanSettings

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
HERD = shutil.which("herd") or str(REPO / ".venv" / "bin" / "herd")
NAMESPACE = "operator-restart"
OPERATOR_ACCOUNT = ("herd-operator", "herd")
TIMEOUT_S = 60.0
HOLD_S = 25.0  # below the webhook's 30 s timeout, far above the kill and the check (well under 1 s)
IMAGE = "me/worker:7"
WEBHOOK = "herd-test-hold-service"
MANIFEST = model_deployment("split", serving={"mode": "disaggregated"}, prefill=pending_pool(1), decode=pending_pool(2))  # fmt: skip


@dataclass
class ServiceHold:
    """What the webhook saw, and the switch that lets the held first Service create through."""

    is_held: threading.Event = field(default_factory=threading.Event)
    is_released: threading.Event = field(default_factory=threading.Event)
    users: list[str] = field(default_factory=list)

    def admit(self, request: dict[str, Any]) -> None:
        """Blocks the first create until released (at most ``HOLD_S``); every later one passes."""
        self.users.append(request["userInfo"]["username"])
        if not self.is_held.is_set():
            self.is_held.set()
            self.is_released.wait(HOLD_S)


def webhook_handler(hold: ServiceHold) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            hold.admit(review["request"])
            answer = {**review, "response": {"uid": review["request"]["uid"], "allowed": True}}
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the apiserver's calls are no news."""

    return Handler


def serving_certificate(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1 signed by it (``ca.crt``, ``tls.crt``, ``tls.key``)."""
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
         "-subj", "/CN=herd-webhook-ca"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "tls.crt",
         "-days", "1", "-extfile", "san.ext"],
    ):  # fmt: skip
        subprocess.run(["openssl", *argv], cwd=folder, capture_output=True, check=True, timeout=60)
    return folder / "ca.crt", folder / "tls.crt", folder / "tls.key"


def webhook_configuration(url: str, ca: Path) -> dict[str, Any]:
    """A ValidatingWebhookConfiguration that sends Service creates in ``NAMESPACE`` only to ``url``."""
    hook = {"name": "hold.services.herd.test", "sideEffects": "None", "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 30, "failurePolicy": "Fail",
            "clientConfig": {"url": url, "caBundle": base64.b64encode(ca.read_bytes()).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["services"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}}  # fmt: skip
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": WEBHOOK}, "webhooks": [hook]}  # fmt: skip


@contextlib.contextmanager
def service_webhook(plane: ControlPlane, folder: Path) -> Iterator[ServiceHold]:
    """The webhook served on 127.0.0.1 over TLS and registered while in the block (the session's other
    namespaces never meet it)."""
    ca, cert, key = serving_certificate(folder)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    hold = ServiceHold()
    server = ThreadingHTTPServer(("127.0.0.1", 0), webhook_handler(hold))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    thread.start()
    url = f"https://127.0.0.1:{server.server_port}/validate"
    plane.kubectl("apply", "-f", "-", stdin=json.dumps(webhook_configuration(url, ca)))
    try:
        yield hold
    finally:
        hold.is_released.set()
        plane.kubectl("delete", "validatingwebhookconfiguration", WEBHOOK)
        server.shutdown()
        server.server_close()
        thread.join(TIMEOUT_S)


@pytest.fixture(scope="module")
def models(cluster: ControlPlane) -> Iterator[Models]:
    with model_namespace(cluster, NAMESPACE) as models:
        yield models


def operator_argv(kubeconfig: Path) -> list[str]:
    return [HERD, "operator", "-A", "--standalone", "--kubeconfig", str(kubeconfig),
            "--liveness", f"http://127.0.0.1:{free_port()}/healthz", "--worker-image", IMAGE,
            "--orchestrator-namespace", "herd", "--retry-delay", "1"]  # fmt: skip


def test_an_operator_killed_mid_reconcile_converges_without_duplicates(
    models: Models, tmp_path: Path
) -> None:
    desired = plan(ModelDeployment.model_validate({**MANIFEST, "metadata": {"name": "split", "namespace": NAMESPACE}}),
                   PlanSettings(worker_image=IMAGE)).objects  # fmt: skip
    login = models.plane.login_as(*OPERATOR_ACCOUNT, default_namespace=NAMESPACE)
    with service_webhook(models.plane, tmp_path) as hold:
        models.apply(MANIFEST)
        with running(operator_argv(login.kubeconfig), log=tmp_path / "operator-1.log") as first:
            assert hold.is_held.wait(TIMEOUT_S), "the operator never created a Service"
            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=TIMEOUT_S)
        at_kill = models.children("split")
        assert list(at_kill) == ["Deployment/split-prefill"], "the kill did not land mid-pass"
        hold.is_released.set()
        with running(operator_argv(login.kubeconfig), log=tmp_path / "operator-2.log"):
            wait_until(
                lambda: len(models.children("split")) == len(desired), timeout=TIMEOUT_S, what="every child"
            )
            wait_until(lambda: models.is_observed("split"), timeout=TIMEOUT_S, what="the status written")
        assert set(hold.users) == {login.user}, "every Service create came from the operator's ServiceAccount"
    current = models.children("split")
    # Exactly once each (names are unique per kind, so also no second object under another name) ...
    assert sorted(current) == sorted(f"{obj.kind}/{obj.name}" for obj in desired)
    # ... the Deployment made before the kill kept (not deleted and made again) ...
    prefill = current["Deployment/split-prefill"]
    assert prefill["metadata"]["uid"] == at_kill["Deployment/split-prefill"]["metadata"]["uid"]
    # ... every child with the desired spec, owned by the ModelDeployment.
    for obj in desired:
        child = current[f"{obj.kind}/{obj.name}"]
        assert child["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == obj.spec_hash, obj.name
        assert child["spec"]["selector"] == obj.body["spec"]["selector"], obj.name
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("ModelDeployment", "split", True)
    assert prefill["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE
    pools = models.get("md", "split")["status"]["pools"]
    assert (pools["prefill"]["ready"], pools["decode"]["ready"]) == ("0/1", "0/2")
