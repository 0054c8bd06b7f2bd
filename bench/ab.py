"""Before and after in one run: a benchmark script run alternately against two source trees.

Each round runs the same script (this checkout's, so both sides take the same options) once with
the ``herd`` packages of ``--before`` (a ``git worktree`` of the older commit) and once with those
of ``--after`` (this checkout unless given: a worktree keeps others' uncommitted edits out), in
alternating order (before first in even rounds), each writing its own JSON. The
servers a benchmark starts inherit ``PYTHONPATH``, so they run that tree's code too. Reported per
``--metric`` (a dotted path into the JSON) and side: the median and the spread (min-max) over the
rounds, and after over before.

    .venv/bin/python bench/ab.py --before /tmp/base --rounds 3 --name gateway_overhead \\
        --metric non_streaming.gateway_cpu_ms_per_request_without_polling \\
        -- bench/gateway_overhead.py --requests 1000
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import REPO, machine_info, write_json

__all__ = ["main"]

COMPONENTS = ("api", "kube", "worker", "orchestrator", "operator", "sidecar", "cli")


def source_path(tree: Path) -> str:
    """``PYTHONPATH`` that makes ``herd.*`` import from ``tree`` ahead of the editable install."""
    return os.pathsep.join(str(tree / component) for component in COMPONENTS)


def run_once(tree: Path, command: list[str], out: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": source_path(tree)}
    subprocess.run([sys.executable, *command, "--out", str(out)], cwd=REPO, env=env, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def value_at(report: dict[str, Any], path: str) -> float:
    node: Any = report
    for key in path.split("."):
        node = node[key]
    return float(node)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", type=Path, required=True, help="the older commit's worktree")
    parser.add_argument("--after", type=Path, default=REPO, help="the newer tree (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", required=True, help="names the JSON files in bench/results")
    parser.add_argument("--metric", action="append", required=True, help="a dotted path into the JSON")
    parser.add_argument("command", nargs="+", help="the benchmark script and its options (after --)")
    args = parser.parse_args(argv)
    results = REPO / "bench" / "results"
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for number in range(args.rounds):
        for side in ("before", "after") if number % 2 == 0 else ("after", "before"):
            out = results / f"{args.name}_{side}_{number + 1}.json"
            runs[side].append(run_once(sides[side], args.command, out))
    table = {
        metric: {side: summary([value_at(run, metric) for run in runs[side]]) for side in sides}
        for metric in args.metric
    }
    for row in table.values():
        row["after_over_before"] = round(row["after"]["median"] / row["before"]["median"], 3)
    report = {
        "command": shlex.join(
            [".venv/bin/python", "bench/ab.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "trees": {side: str(tree) for side, tree in sides.items()},
        "machine": machine_info(),
        "metrics": table,
    }
    write_json(results / f"{args.name}_ab.json", report)
    print(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
