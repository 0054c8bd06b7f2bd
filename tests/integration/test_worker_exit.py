"""A worker whose engine cannot recover exits 1, so that its supervisor restarts it; so does one
whose model herd cannot run, naming it.

A real ``herd worker`` process with a lost device injected (``support.faulty_worker``): its request
gets a 500 in the OpenAI envelope, and the process exits 1 instead of lingering, answering 503.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.procs import free_port, running, wait_until
from support.worker_server import worker_argv

pytestmark = pytest.mark.timeout(180)


def test_a_worker_whose_engine_cannot_recover_exits_1(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    argv = worker_argv(tiny_llama, port=port, internal_port=free_port(), token="t")
    argv = [sys.executable, "-m", "support.faulty_worker", *argv[4:]]  # herd worker, with a lost device
    tests_dir = str(Path(__file__).resolve().parent.parent)
    env = {"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "worker.log"
    with running(argv, log=log, env=env) as process:
        url = f"http://127.0.0.1:{port}"

        def is_ready() -> bool:
            assert process.poll() is None, f"the worker exited before it was ready; see {log}"
            return httpx.get(f"{url}/ready", timeout=2).status_code == 200

        wait_until(is_ready, timeout=120, interval=0.2, what="the faulty worker ready")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        try:
            code = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the worker lingers after its engine failed; see {log}") from None
    assert failed.status_code == 500, failed.text
    assert "device is lost" in failed.json()["error"]["message"]
    assert code == 1
    assert "exiting so that the supervisor restarts this worker" in log.read_text()


def test_a_worker_on_a_model_herd_cannot_run_exits_naming_it(tiny_llama: Path, tmp_path: Path) -> None:
    folder = tmp_path / "phi"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["Phi3ForCausalLM"]}))
    argv = worker_argv(folder, port=free_port(), internal_port=free_port(), token="t")
    log = tmp_path / "worker.log"
    with running(argv, log=log) as process:
        code = process.wait(timeout=120)
    assert code == 1
    assert (
        f"{folder} holds a Phi3ForCausalLM, which herd cannot run: herd runs Gemma2ForCausalLM"
        in log.read_text()
    )
