"""``herd sidecar``'s refusals, and that it loads no torch (it runs in a vLLM pod, beside vLLM's own)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from herd.api.protocol import TOKEN_ENV
from herd.cli.main import main

ARGV = [
    "sidecar", "--vllm-url", "http://127.0.0.1:1", "--kv-events", "tcp://127.0.0.1:2",
    "--kv-replay", "tcp://127.0.0.1:3", "--served-name", "m", "--model", "/nonexistent", "--block-size", "32",
]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        pytest.param(
            ["--role", "prefill"], {TOKEN_ENV: "t"}, "role 'prefill' is not supported on vLLM", id="prefill"
        ),
        pytest.param(["--role", "decode"], {TOKEN_ENV: "t"}, "serve this model aggregated", id="decode"),
        pytest.param([], {}, f"pass --internal-token or set {TOKEN_ENV}", id="no-token"),
    ],
)
def test_refusals(
    extra: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*ARGV, *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_sidecar_loads_no_torch() -> None:
    code = "import sys, herd.sidecar, herd.cli.sidecar; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
