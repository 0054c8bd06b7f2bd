"""``herd up`` scales a model to zero and back (issue 17): with ``autoscaling.minReplicas: 0`` its
worker stops after ``scaleToZeroAfterSeconds`` without a request; a request is then held by the
orchestrator, whose held count makes herd up start the worker again on its ports, and is answered
by it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support.cluster import is_alive
from support.herd_up import herd_up_of
from support.procs import wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = pytest.mark.e2e


def write_manifest(folder: Path, model: Path) -> Path:
    path = folder / "idle.yaml"
    path.write_text(
        f"""apiVersion: herd.dev/v1alpha1
kind: ModelDeployment
metadata: {{name: idle}}
spec:
  model: {{source: "file://{model}", servedName: idle}}
  engine: {{dtype: float32, device: cpu, maxModelLen: 512, kvCache: {{memoryGiB: 0.05}}}}
  workers: {{replicas: 1}}
  routing: {{strategy: round_robin}}
  autoscaling: {{enabled: true, minReplicas: 0, maxReplicas: 1, scaleToZeroAfterSeconds: 2, coldStartTimeoutSeconds: 180}}
"""
    )
    return path


def test_an_idle_model_stops_its_worker_and_a_request_starts_it_again(
    tiny_llama: Path, tmp_path: Path
) -> None:
    with herd_up_of(write_manifest(tmp_path, tiny_llama), tmp_path) as up:
        first = int(str(up.workers()["idle-workers-0"]["pid"]))
        wait_until(lambda: up.entries("model idle: stopping its workers"), timeout=60, what="the idle stop")
        wait_until(lambda: not is_alive(first), timeout=30, what="the worker process gone")
        assert not up.entries("process exited; restarting it"), "a parked worker is not restarted"

        body = {"model": "idle", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        answered = httpx.post(f"{up.base_url}/v1/chat/completions", json=body, timeout=240)
        assert answered.status_code == 200, answered.text
        assert answered.headers[WORKER_HEADER] == "idle-workers-0"
        [started] = up.entries("requests held: starting the model's workers")
        assert started["model"] == "idle" and started["num_held"] == 1
        second = int(str(up.workers()["idle-workers-0"]["pid"]))
        assert second != first and is_alive(second)

        wait_until(lambda: len(up.entries("model idle: stopping its workers")) == 2, timeout=60,
                   what="idle again, stopped again")  # fmt: skip
