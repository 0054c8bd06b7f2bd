"""The simulated backend against the real engine it was calibrated from (issue 13's acceptance).

``herd bench calibrate`` fits the cost model on the demo model; then the same multi-tenant workload
runs through ``herd bench``'s client on a real ``herd worker`` and on a simulated one, at two
concurrency levels. The simulated TTFT p50 and ITL p50 must be within 25 % of the real engine's own
measured numbers in the same test, and the prefix-cache hit rate equal. Each level first sends its
tenants' requests one at a time (unmeasured), so that which blocks a measured request finds cached
does not depend on timing: the hit rates are then a property of the scheduler and the block
manager, which both backends share. Both engines run on one thread (``OMP_NUM_THREADS=1``), as the
calibration did.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.worker_server import worker_process

from herd.cli.loadgen import BenchConfig, run_benchmark

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOKEN = "fidelity"
ENGINE = {"device": "cpu", "maxModelLen": 512, "kvCache": {"memoryGiB": 0.5}}
FLAGS = {"kv_memory_gib": "0.5"}  # worker_argv's own small pool would evict, and hits would vary
WORKLOAD = {
    "workload": "shared-prefix",
    "num_tenants": 4,
    "prefix_len": 64,
    "input_len": "24",
    "output_len": "16",
}
NUM_WARMUP = 8
NUM_MEASURED = 24
LEVELS = (1, 4)
TOLERANCE = 0.25


def _calibrate(model: Path, out: Path) -> dict[str, Any]:
    argv = [sys.executable, "-m", "herd.cli.main", "bench", "calibrate", "--model", str(model)]
    argv += ["--engine-json", json.dumps(ENGINE), "--batch-sizes", "1,2,4", "--context-lens", "48,112,176"]
    subprocess.run([*argv, "--out", str(out)], check=True, capture_output=True, timeout=600)
    cost: dict[str, Any] = json.loads(out.read_text())
    return cost


def _run(url: str, concurrency: int, num_requests: int, seed: int) -> dict[str, Any]:
    config = BenchConfig(
        url=url, model="tiny", concurrency=concurrency, num_requests=num_requests, seed=seed, **WORKLOAD
    )
    report = asyncio.run(run_benchmark(config))
    assert report["num_completed"] == num_requests, report["errors"]
    return report


def _measure(url: str) -> dict[int, dict[str, float]]:
    """Per level: the warm-up one at a time, then warm-up plus measured requests (the warm-up's
    own requests come first again, whole-prompt hits) at the level's concurrency."""
    figures = {}
    for level in LEVELS:  # the level is the seed: its tenants' prefixes are new to the worker
        _run(url, 1, NUM_WARMUP, seed=level)
        report = _run(url, level, NUM_WARMUP + NUM_MEASURED, seed=level)
        figures[level] = {
            "ttft_p50_ms": report["ttft_ms"]["p50"],
            "itl_p50_ms": report["itl_ms"]["p50"],
            "hit_rate": report["prefix_cache_hit_rate"],
        }
    return figures


def test_the_simulated_engine_matches_the_real_one(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cost = _calibrate(demo_model, tmp_path / "cost.json")
    real_engine = json.dumps(ENGINE)
    with worker_process(
        demo_model, log=tmp_path / "real.log", token=TOKEN, engine_json=real_engine, **FLAGS
    ) as real:
        real_figures = _measure(real.url)
    simulated_engine = json.dumps({**ENGINE, "backend": "simulated", "simulation": {"costModel": cost}})
    with worker_process(
        demo_model, log=tmp_path / "simulated.log", token=TOKEN, engine_json=simulated_engine, **FLAGS
    ) as simulated:
        simulated_figures = _measure(simulated.url)
    print(json.dumps({"cost_model": cost, "real": real_figures, "simulated": simulated_figures}))
    for level in LEVELS:
        real_level, simulated_level = real_figures[level], simulated_figures[level]
        assert simulated_level["hit_rate"] == real_level["hit_rate"], level
        for name in ("ttft_p50_ms", "itl_p50_ms"):
            ratio = simulated_level[name] / real_level[name]
            assert abs(ratio - 1.0) <= TOLERANCE, f"concurrency {level}: {name} simulated/real = {ratio:.2f}"
