"""`helm test` sends one chat request through the orchestrator and fails unless choices come back."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from support.chart import find, is_hook, render_chart


def _hook(values: dict[str, Any]) -> dict[str, Any]:
    (pod,) = [pod for pod in find(render_chart(values, include_hooks=True), "Pod") if is_hook(pod)]
    return pod


def test_hook_is_a_helm_test_pod_addressing_the_orchestrator() -> None:
    pod = _hook({"test": {"model": "llama-3-8b"}})
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    env = {entry["name"]: entry.get("value") for entry in pod["spec"]["containers"][0]["env"]}
    assert env["URL"] == "http://herd-orchestrator:8000/v1/chat/completions"
    body = json.loads(env["BODY"])
    assert body["model"] == "llama-3-8b"
    assert body["messages"][0]["role"] == "user"


def test_hook_is_not_installed_with_the_release_and_can_be_disabled() -> None:
    assert not any(is_hook(manifest) for manifest in render_chart({}))
    assert not any(
        is_hook(manifest) for manifest in render_chart({"test": {"enabled": False}}, include_hooks=True)
    )


class _FakeOrchestrator(BaseHTTPRequestHandler):
    """Answers every POST with the canned ``reply`` and remembers what it received."""

    reply: bytes = b""
    received: list[tuple[dict[str, str], dict[str, Any]]]

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        self.received.append((dict(self.headers), json.loads(self.rfile.read(length))))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.reply)))
        self.end_headers()
        self.wfile.write(self.reply)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the test asserts on what was received instead."""


@pytest.fixture
def orchestrator() -> Iterator[tuple[ThreadingHTTPServer, type[_FakeOrchestrator]]]:
    handler = type("Handler", (_FakeOrchestrator,), {"received": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _run_hook(pod: dict[str, Any], url: str, api_key: str | None = None) -> subprocess.CompletedProcess[str]:
    """Runs the hook container's own command with the local curl, pointed at ``url``."""
    container = pod["spec"]["containers"][0]
    env = {entry["name"]: entry["value"] for entry in container["env"] if "value" in entry}
    env |= {"URL": url, "PATH": "/usr/bin:/bin"} | ({"API_KEY": api_key} if api_key else {})
    argv = [*container["command"], *container["args"]]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


REPLIES = {
    "choices": (b'{"id": "c1", "choices": [{"index": 0, "message": {"content": "hi"}}]}', 0),
    "no-choices": (b'{"id": "c1", "object": "chat.completion"}', 1),
}


@pytest.mark.e2e
@pytest.mark.parametrize(("reply", "exit_code"), REPLIES.values(), ids=REPLIES.keys())
def test_hook_script_passes_only_when_choices_come_back(
    orchestrator: tuple[ThreadingHTTPServer, type[_FakeOrchestrator]], reply: bytes, exit_code: int
) -> None:
    server, handler = orchestrator
    handler.reply = reply
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
    result = _run_hook(_hook({"test": {"model": "smollm2"}}), url, api_key="key-1")
    assert result.returncode == exit_code, result.stderr
    ((headers, body),) = handler.received
    assert body["model"] == "smollm2"
    assert headers["Authorization"] == "Bearer key-1"
    assert headers["Content-Type"] == "application/json"
