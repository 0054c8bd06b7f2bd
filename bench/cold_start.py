"""Cold start after scale to zero, beside a warm request, under ``herd up`` with the real SmolLM2.

One ``herd up`` of SmolLM2-135M-Instruct (CPU, fp32) whose ``autoscaling`` scales to zero after
``--idle`` seconds. Each round waits until herd up has stopped the idle worker, then sends a streamed
chat request (cold: the orchestrator holds it, herd up starts the worker on the held demand, the
worker loads the model, the orchestrator admits it and routes the request), and at once a second
one (warm: the same worker, running). What differs between the two is only whether a worker was
running when the request arrived. The cold request is cut into its parts, each from a timestamp on
this machine's clock:

* ``demand_seen``: arrival to herd up's "requests held: starting the model's workers" line (herd up
  reads the orchestrator's ``/metrics`` every 0.5 s);
* ``worker_ready``: from there to the new worker process's "engine ready" line (process start,
  imports, the model loaded: ``/ready`` answers 200 from then on);
* ``admitted``: from there to the orchestrator's "worker admitted" line (its registry polls ``/ready``
  every 0.25 s);
* ``first_token``: from there to the request's first streamed token.

    .venv/bin/python bench/cold_start.py --rounds 3      # writes bench/results/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from _common import DEMO_MODEL, HOST, REPO, free_port, running, wait_until, write_results
from support.cluster import is_alive

__all__ = ["cold_start_main", "main"]

MODEL = "smollm2"
TIMEOUT_S = 300.0
PARTS = ("demand_seen", "worker_ready", "admitted", "first_token")


def manifest(folder: Path, idle_s: int) -> Path:
    path = folder / "cold.yaml"
    path.write_text(
        f"""apiVersion: herd.dev/v1alpha1
kind: ModelDeployment
metadata: {{name: {MODEL}}}
spec:
  model: {{source: "file://{DEMO_MODEL}", servedName: {MODEL}}}
  engine: {{dtype: float32, device: cpu, maxModelLen: 2048, kvCache: {{memoryGiB: 0.25}}}}
  workers: {{replicas: 1}}
  routing: {{strategy: round_robin}}
  autoscaling: {{enabled: true, minReplicas: 0, maxReplicas: 1, scaleToZeroAfterSeconds: {idle_s}, coldStartTimeoutSeconds: {int(TIMEOUT_S)}}}
"""
    )
    return path


class Log:
    """A JSON log: herd up's output (its own lines and the orchestrator's, which writes to herd up's
    stdout), or a worker's."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def times(self, msg: str, component: str) -> list[float]:
        """Wall-clock seconds of every line with this message from this component."""
        found = []
        for line in self.path.read_text().splitlines():
            if line.startswith('{"ts"'):
                entry = json.loads(line)
                if entry.get("msg") == msg and entry.get("component") == component:
                    found.append(datetime.fromisoformat(entry["ts"]).timestamp())
        return found

    def first_after(self, msg: str, component: str, since: float) -> float:
        """The first such line at or after ``since`` (waits for it, bounded)."""
        found: list[float] = []

        def logged() -> bool:
            found[:] = [at for at in self.times(msg, component) if at >= since - 0.001]
            return bool(found)

        wait_until(logged, timeout=TIMEOUT_S, interval=0.05, what=f"{component}: {msg}")
        return found[0]


def first_token_at(url: str) -> float:
    """Send a streamed chat request; the wall-clock time its first content token arrived."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and _has_text(json.loads(line.removeprefix("data: "))):
                at = time.time()
                for _ in lines:  # read the rest: the request ends cleanly
                    pass
                return at
    raise RuntimeError("the stream ended without a token")


def _has_text(chunk: dict[str, Any]) -> bool:
    return any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or [])


def last_worker(log: Log) -> dict[str, Any]:
    """herd up's "started process" line of the worker it started last."""
    started = [json.loads(line) for line in log.path.read_text().splitlines() if '"started process"' in line]
    return next(entry for entry in reversed(started) if entry["kind"] == "worker")


def worker_pid(log: Log) -> int:
    return int(last_worker(log)["pid"])


def worker_log(log: Log) -> Log:
    """The worker's own log (every start of it appends there)."""
    return Log(Path(last_worker(log)["log"]))


def one_round(url: str, log: Log, num_stops: int) -> dict[str, float]:
    """From zero: the idle worker stopped and its process exited (it drains for up to a few seconds)."""
    wait_until(lambda: len(log.times("model idle: stopping its workers", "herd-up")) >= num_stops,
               timeout=TIMEOUT_S, interval=0.1, what="the idle worker stopped")  # fmt: skip
    pid = worker_pid(log)
    wait_until(lambda: not is_alive(pid), timeout=TIMEOUT_S, interval=0.05, what="the worker process gone")
    arrived = time.time()
    first = first_token_at(url)
    started = log.first_after("requests held: starting the model's workers", "herd-up", arrived)
    ready = worker_log(log).first_after("engine ready", "worker", arrived)
    admitted = log.first_after("worker admitted", "orchestrator", arrived)
    warm_arrived = time.time()
    warm = first_token_at(url) - warm_arrived
    return {
        "cold_ttft_s": round(first - arrived, 3),
        "warm_ttft_s": round(warm, 3),
        "demand_seen": round(started - arrived, 3),
        "worker_ready": round(ready - started, 3),
        "admitted": round(admitted - ready, 3),
        "first_token": round(first - admitted, 3),
    }


def summary(values: list[float]) -> dict[str, float]:
    return {"median_s": round(statistics.median(values), 3), "min_s": min(values), "max_s": max(values)}


def run(rounds: int, idle_s: int, folder: Path) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "herd.cli.main", "up", str(manifest(folder, idle_s)), "--port", str(port),
            "--log-dir", str(folder / "logs")]  # fmt: skip
    log = Log(folder / "up.log")
    url = f"http://{HOST}:{port}"
    with running(argv, log=log.path, env={"OMP_NUM_THREADS": "1"}, cwd=REPO):
        wait_until(lambda: _is_ready(url), timeout=TIMEOUT_S, interval=0.2, what="herd up serving")
        results = [one_round(url, log, number) for number in range(1, rounds + 1)]
    keys = ("cold_ttft_s", "warm_ttft_s", *PARTS)
    return {"summary": {key: summary([result[key] for result in results]) for key in keys}, "rounds": results}


def _is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == httpx.codes.OK
    except httpx.HTTPError:
        return False


def cold_start_main(
    run: Callable[[int, int, Path], dict[str, Any]], *, doc: str | None, name: str, idle_s: int
) -> None:
    """The command line of the cold-start benchmark ``bench/NAME.py``: ``run(rounds, idle_s, folder)``
    in a temporary folder, its results written with the command and the machine."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=int, default=idle_s, help="scaleToZeroAfterSeconds")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / f"{name}.json")
    args = parser.parse_args()
    if not (DEMO_MODEL / "config.json").exists():
        raise SystemExit(f"{DEMO_MODEL} is missing: run `herd model prepare smollm2 --out {DEMO_MODEL}`")
    with tempfile.TemporaryDirectory(prefix=f"herd-{name.replace('_', '-')}-") as folder:
        results = run(args.rounds, args.idle, Path(folder))
    command = f"python bench/{name}.py --rounds {args.rounds} --idle {args.idle}"
    write_results(args.out, results, command=command)


def main() -> None:
    cold_start_main(run, doc=__doc__, name="cold_start", idle_s=3)


if __name__ == "__main__":
    main()
