"""The report of ``routing_scale.py``: medians and ranges over the rounds, the issue's targets,
markdown tables and PNG plots, all from the results document (``--replot`` redoes them from a file)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

__all__ = ["cell_table", "overhead_table", "plot", "summarize_cell", "targets"]

KV = "herd:kv_cache_aware"


NUMERIC = (
    "hit_rate",
    "hit_share_of_oracle",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_p99_cold_prefills",
    "itl_p99_ms",
    "output_tok_s",
    "num_rejected",
    "in_flight_mean",
    "in_flight_max_over_mean",
    "requests_max_over_mean",
    "workers_used",
    "worker_hit_rate",
)


def aggregate(rounds: list[dict[str, Any]], oracle_hit_rate: float) -> dict[str, Any]:
    """Median and range over the rounds that ran, of every figure; the hit rate also as a share of the oracle."""
    done = [row for row in rounds if "failed" not in row]
    for row in done:
        row["hit_share_of_oracle"] = (
            round(row["hit_rate"] / oracle_hit_rate, 3)
            if row["hit_rate"] is not None and oracle_hit_rate
            else None
        )
    median, spread = {}, {}
    for key in NUMERIC:
        values = [row[key] for row in done if row.get(key) is not None]
        if values:
            median[key] = round(statistics.median(values), 4)
            spread[key] = [min(values), max(values)]
    return {"num_rounds": len(done), "num_failed": len(rounds) - len(done), "median": median, "range": spread}


def summarize_cell(cell: dict[str, Any]) -> None:
    """Adds each router's (and each gateway count's) median and range to the cell, in place."""
    oracle_hit_rate = cell["oracle"]["oracle_hit_rate"]
    for group in ("routers", "gateways", "harnesses"):
        for entry in cell.get(group, {}).values():
            entry.update(aggregate(entry["rounds"], oracle_hit_rate))


def target(name: str, where: str, value: Any, is_met: bool) -> dict[str, Any]:
    return {"target": name, "where": where, "value": value, "met": is_met}


def targets(cells: list[dict[str, Any]], load: float) -> list[dict[str, Any]]:
    """The issue's targets, each checked where the run has the figures (missed ones are kept)."""
    checks = []
    for cell in (c for c in cells if "routers" in c and c["load"] == load):
        where = f"{cell['trace']}, {cell['num_workers']} workers, load {cell['load']:.0%}"
        medians = {name: entry.get("median", {}) for name, entry in cell["routers"].items()}
        kv = medians.get(KV, {})
        if not kv:
            continue
        if cell["trace"] != "hot-burst" and cell["num_workers"] <= 128:
            share, ratio = kv.get("hit_share_of_oracle"), kv.get("in_flight_max_over_mean")
            checks.append(target(">= 90 % of the oracle", where, share, share is not None and share >= 0.9))
            checks.append(
                target("max/mean in-flight <= 1.25", where, ratio, ratio is not None and ratio <= 1.25)
            )
        checks += best_of_all(where, medians)
    checks += burst_checks(cells) + gateway_checks(cells)
    return checks


def best_of_all(where: str, medians: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """kv_cache_aware's hit rate the highest and its TTFT p99 the lowest in the cell: of every other
    router, and of the peer routers alone."""
    checks = []
    for group, peers_only in (("all routers", False), ("the peer routers", True)):
        others = [
            m
            for name, m in medians.items()
            if name != KV and m and not (peers_only and name.startswith("herd:"))
        ]
        if not others:
            continue
        best_hit = max(m.get("hit_rate") or 0.0 for m in others)
        best_ttft = min(m.get("ttft_p99_ms") or math.inf for m in others)
        hit, ttft = medians[KV].get("hit_rate") or 0.0, medians[KV].get("ttft_p99_ms") or math.inf
        checks.append(
            target(
                f"highest hit rate of {group}",
                where,
                {"kv_cache_aware": hit, "best other": best_hit},
                hit >= best_hit,
            )
        )
        checks.append(
            target(
                f"lowest TTFT p99 of {group}",
                where,
                {"kv_cache_aware": ttft, "best other": best_ttft},
                ttft <= best_ttft,
            )
        )
    return checks


def burst_checks(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for cell in (c for c in cells if c["trace"] == "hot-burst" and "routers" in c):
        kv = cell["routers"].get(KV, {}).get("median", {})
        where = f"hot-burst, {cell['num_workers']} workers, load {cell['load']:.0%}"
        ratio, rejected = kv.get("in_flight_max_over_mean"), kv.get("num_rejected")
        checks.append(
            target("burst: max/mean in-flight <= 1.25", where, ratio, ratio is not None and ratio <= 1.25)
        )
        if cell["load"] < 1.0:
            checks.append(target("burst: no rejected request below capacity", where, rejected, rejected == 0))
    return checks


def gateway_checks(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for cell in (c for c in cells if "gateways" in c):
        medians = {
            count: entry.get("median", {}).get("hit_rate") for count, entry in cell["gateways"].items()
        }
        one, four = medians.get("1"), medians.get("4")
        if one and four is not None:
            value = {"1 gateway": one, "4 gateways": four}
            checks.append(
                target("4 gateways' hit rate within 5 % of one's", cell["trace"], value, four >= 0.95 * one)
            )
    return checks


def cell_table(cell: dict[str, Any]) -> str:
    """One cell as markdown: medians over the rounds, the range of the key figures in brackets."""
    oracle_line = cell["oracle"]
    lines = [
        f"**{cell['trace']}, {cell['num_workers']} workers, load {cell['load']:.0%}** "
        f"({cell.get('request_rate', '-')} requests/s, {cell.get('fleet_load', cell['load']):.1%} of this fleet's capacity; "
        f"oracle {oracle_line['oracle_hit_rate']}, ceiling {oracle_line['ceiling_hit_rate']}, "
        f"cold prefill {cell['cold_prefill_ms']} ms)",
        "",
        "| router | hit rate | workers' hit rate | of oracle | TTFT p50 / p99 (ms) | TTFT p99 (cold prefills) "
        "| ITL p99 (ms) | output tok/s | in-flight max/mean | requests max/mean | rejected | rounds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    entries = (
        cell.get("routers")
        or cell.get("harnesses")
        or {f"{count} gateway(s)": e for count, e in cell.get("gateways", {}).items()}
    )
    for name, entry in entries.items():
        m, r = entry.get("median", {}), entry.get("range", {})
        lines.append(
            f"| {name} | {fmt(m, r, 'hit_rate')} | {m.get('worker_hit_rate', '-')} | {fmt(m, r, 'hit_share_of_oracle')} | "
            f"{m.get('ttft_p50_ms', '-')} / {fmt(m, r, 'ttft_p99_ms')} | {m.get('ttft_p99_cold_prefills', '-')} | "
            f"{m.get('itl_p99_ms', '-')} | {m.get('output_tok_s', '-')} | {fmt(m, r, 'in_flight_max_over_mean')} | "
            f"{m.get('requests_max_over_mean', '-')} | "
            f"{m.get('num_rejected', '-')} | {entry.get('num_rounds', 0)} |"
        )
    return "\n".join(lines)


def fmt(median: dict[str, float], spread: dict[str, list[float]], key: str) -> str:
    if key not in median:
        return "-"
    low, high = spread[key]
    return f"{median[key]:.4g} ({low:.4g}-{high:.4g})"


def plot(document: dict[str, Any], out_dir: Path) -> list[Path]:
    """Hit rate (share of the oracle) and TTFT p99 (cold prefills) against fleet size at the sweep's
    load and against load at the sweep's size, one line per router, one PNG per trace and axis."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    settings, written = document["settings"], []
    for trace in dict.fromkeys(cell["trace"] for cell in document["cells"]):
        cells = [c for c in document["cells"] if c["trace"] == trace and "routers" in c]
        by_size = [c for c in cells if c["load"] == settings["load"]]
        by_load = [c for c in cells if c["num_workers"] == settings["sweep_size"]]
        for axis, chosen, x_key in (("size", by_size, "num_workers"), ("load", by_load, "load")):
            if len({c[x_key] for c in chosen}) > 1:
                written.append(plot_axis(trace, axis, chosen, x_key, out_dir))
    return written


def plot_axis(trace: str, axis: str, cells: list[dict[str, Any]], x_key: str, out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 2, figsize=(12, 4.5))
    cells = sorted(cells, key=lambda c: c[x_key])
    routers = dict.fromkeys(name for c in cells for name in c["routers"])
    for panel, key, label in zip(
        panels,
        ("hit_share_of_oracle", "ttft_p99_cold_prefills"),
        ("hit rate / oracle", "TTFT p99 (cold prefills)"),
        strict=True,
    ):
        for name in routers:
            points = [(c[x_key], c["routers"][name]) for c in cells if name in c["routers"]]
            xs = [x * 100 if x_key == "load" else x for x, e in points if key in e.get("median", {})]
            ys = [e["median"][key] for _, e in points if key in e.get("median", {})]
            style = "-o" if name.startswith("herd:") else "--s"
            panel.plot(xs, ys, style, label=name, linewidth=2.5 if name == KV else 1.2)
        panel.set_xlabel("workers" if x_key == "num_workers" else "load (% of capacity)")
        panel.set_ylabel(label)
        if x_key == "num_workers":
            sizes = sorted({c["num_workers"] for c in cells})
            panel.set_xscale("log", base=2)
            panel.set_xticks(sizes, [str(size) for size in sizes])
        panel.grid(alpha=0.3)
    panels[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(f"{trace}: median of the rounds, against {axis}")
    figure.tight_layout()
    path = out_dir / f"routing-scale-{trace}-by-{axis}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def overhead_table(overhead: dict[str, Any]) -> str:
    """Each router's added latency per request over calling the worker directly (medians of the rounds)."""
    lines = [
        "| router | direct p50 (ms) | through the router p50 (ms) | added p50 (ms) | added p99 (ms) | rounds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, entry in overhead.items():
        lines.append(
            f"| {name} | {entry['direct_p50_ms']} | {entry['router_p50_ms']} | {entry['added_p50_ms']} | "
            f"{entry['added_p99_ms']} | {len(entry['rounds'])} |"
        )
    return "\n".join(lines)
