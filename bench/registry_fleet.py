"""Issue 14: does herd's orchestrator hold a fleet of 128 and 256 simulated workers on this machine?

Two orchestrators side by side over the same fleet, alternating over ``--rounds``: ``before`` runs the
orchestrator of an older commit (``--before REV``, extracted with ``git archive`` and put first on
``PYTHONPATH``; it polled every worker's ``/ready``, load report and KV events on one phase with a
0.5 s timeout), ``after`` this tree's (one status stream per worker). The fleet is this tree's
``herd worker --replicas N`` (simulated workers, which serve both contracts), started once a size.
Each run starts a fresh orchestrator (round robin, the dashboard's history sampler on, as by default)
and for ``--seconds`` reads every second how many workers it has admitted (``herd_router_workers``
in its ``/metrics``); it reports the time until all were admitted, the least admitted after that, the
ejections its log names, and its CPU time over the run (from ``/proc``). Idle fleet: no requests, so
what is measured is following the fleet, nothing else.

``before`` polls at the period the scale runs gave it (the default dilated 3.6x with the workers and
stretched to about 32 workers a period: 3.6 s at 128, 7.2 s at 256), ``after`` at the default
0.25 s, the least favourable setting for it.

    .venv/bin/python bench/registry_fleet.py --before 14fcaf3 --sizes 128,256 --rounds 2 \
        --out bench/results/registry_fleet.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import DEMO_MODEL, HOST, REPO, free_port, herd_workers, machine_info, serving, write_json
from routing_scale import admitted_workers

__all__ = ["main"]

TOKEN = "registry-fleet"
NAME = "sim"
# routing_scale.py's worker: the unit cost model dilated 3.6x, batches of 2, a small pool.
ENGINE = {
    "backend": "simulated",
    "dtype": "float32",
    "device": "cpu",
    "maxModelLen": 4096,
    "maxBatchSize": 2,
    "maxQueueLen": 32,
    "kvCache": {"blockSize": 16, "memoryGiB": 0.03, "prefixCaching": True},
    "simulation": {"costModel": {"stepMs": 54.0, "seqMs": 0.72, "tokenMs": 0.36, "contextUs": 0.0}},
}
COMPONENTS = ("api", "cli", "kube", "operator", "orchestrator", "sidecar", "worker")


@contextlib.contextmanager
def fleet(size: int, model: Path, log_dir: Path) -> Iterator[list[tuple[str, str]]]:
    log = log_dir / f"fleet-{size}.log"
    with herd_workers(
        model, name=NAME, token=TOKEN, engine=ENGINE, log=log, replicas=size, timeout=900
    ) as workers:
        yield workers.urls


@contextlib.contextmanager
def before_tree(rev: str) -> Iterator[str]:
    """The older commit's source, as a ``PYTHONPATH`` that puts its packages first."""
    with tempfile.TemporaryDirectory(prefix="herd-before-") as folder:
        archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        yield os.pathsep.join(str(Path(folder) / component) for component in COMPONENTS)


def orchestrator_argv(urls: list[tuple[str, str]], manifest: Path, port: int, poll_s: float) -> list[str]:
    argv = [sys.executable, "-m", "herd.cli.main", "orchestrator", "--manifest", str(manifest)]
    for number, (public, internal) in enumerate(urls):
        argv += ["--worker", f"{public},{internal},unified,w{number:03d}"]
    argv += [f"--internal-token={TOKEN}", "--host", HOST, "--port", str(port), "--log-level", "WARNING"]
    return [*argv, "--poll-interval", f"{poll_s:.3f}"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(
    urls: list[tuple[str, str]],
    tree: str,
    pythonpath: str | None,
    poll_s: float,
    args: argparse.Namespace,
    log: Path,
) -> dict[str, Any]:
    manifest = log.with_suffix(".manifest.json")
    spec = {"model": {"source": f"file://{args.model.resolve()}", "servedName": NAME}, "engine": ENGINE,
            "routing": {"strategy": "round_robin"}}  # fmt: skip
    manifest.write_text(json.dumps({"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment",
                                    "metadata": {"name": NAME}, "spec": spec}))  # fmt: skip
    port = free_port()
    url = f"http://{HOST}:{port}"
    env = {"PYTHONPATH": pythonpath} if pythonpath else {}
    load_before = os.getloadavg()[0]
    with serving(
        orchestrator_argv(urls, manifest, port, poll_s), ready_url=f"{url}/ready", log=log, env=env
    ) as process:
        started, cpu_started = time.monotonic(), cpu_seconds(process.pid)
        series: list[tuple[float, int]] = []
        while (elapsed := time.monotonic() - started) < args.seconds:
            with contextlib.suppress(Exception):  # a scrape that times out is a missing point
                series.append((round(elapsed, 1), admitted_workers(url)))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started - elapsed)))
        cpu = cpu_seconds(process.pid) - cpu_started
    size = len(urls)
    full_at = next((at for at, admitted in series if admitted == size), None)
    after_full = [admitted for at, admitted in series if full_at is not None and at >= full_at]
    ejections = log.read_text().count('"worker ejected"')
    return {
        "tree": tree,
        "size": size,
        "poll_interval_s": poll_s,
        "seconds": args.seconds,
        "all_admitted_at_s": full_at,
        "min_admitted_after_all": min(after_full) if after_full else None,
        "max_admitted": max((admitted for _, admitted in series), default=0),
        "final_admitted": series[-1][1] if series else None,
        "ejections": ejections,
        "orchestrator_cpu_share": round(cpu / args.seconds, 3),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "series": series,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", required=True, help="the older commit whose orchestrator is 'before'")
    parser.add_argument("--sizes", default="128,256", help="fleet sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trees", default="before,after", help="which orchestrators to run, in turn")
    parser.add_argument("--seconds", type=float, default=90.0, help="each run's length")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "registry_fleet.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    document: dict[str, Any] = {
        "command": " ".join(
            ["python", "bench/registry_fleet.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine_info(),
        "before": args.before,
        "runs": [],
    }
    with before_tree(args.before) as old_path, tempfile.TemporaryDirectory(prefix="registry-fleet-") as logs:
        log_dir = Path(logs)
        for size in (int(size) for size in args.sizes.split(",")):
            with fleet(size, args.model, log_dir) as urls:
                every = [("before", old_path, 0.9 * max(1.0, size / 32)), ("after", None, 0.25)]
                setups = [setup for setup in every if setup[0] in args.trees.split(",")]
                for number in range(args.rounds):
                    for tree, pythonpath, poll_s in setups[number % 2 :] + setups[: number % 2]:
                        log = log_dir / f"orchestrator-{tree}-{size}-{number}.log"
                        row = run_one(urls, tree, pythonpath, poll_s, args, log)
                        print(
                            json.dumps({key: value for key, value in row.items() if key != "series"}),
                            flush=True,
                        )
                        document["runs"].append(row)
                        write_json(args.out, document)
    document["machine_after"] = machine_info()
    write_json(args.out, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
