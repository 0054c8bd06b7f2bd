"""The Grafana dashboard ships as a sidecar ConfigMap and queries only metrics herd exposes."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from support.chart import CHART, find, render_chart

from herd.api import metrics

DASHBOARD = CHART / "dashboards" / "herd.json"
# prometheus_client appends _total to counters and _bucket/_sum/_count to histograms.
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")
METRIC = re.compile(r"\b((?:vllm:|herd_)[a-z0-9_:]+)")


def _panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return panels


def _queried_metrics() -> set[str]:
    return {
        name
        for panel in _panels()
        for target in panel.get("targets", [])
        for name in METRIC.findall(target["expr"])
    }


def _base_name(exposed: str) -> str:
    for name in (*metrics.WORKER_METRICS, *metrics.ORCHESTRATOR_METRICS):
        stem = name.removesuffix("_total")
        if exposed in {stem + suffix for suffix in SUFFIXES}:
            return name
    raise AssertionError(f"the dashboard queries {exposed}, which herd.api.metrics does not define")


def test_every_queried_metric_is_one_herd_exposes() -> None:
    assert {_base_name(name) for name in _queried_metrics()}


@pytest.mark.parametrize(
    "name",
    [
        metrics.NUM_REQUESTS_RUNNING,
        metrics.NUM_REQUESTS_WAITING,
        metrics.KV_CACHE_USAGE_PERC,
        metrics.PREFIX_CACHE_HITS,
        metrics.TIME_TO_FIRST_TOKEN_SECONDS,
        metrics.INTER_TOKEN_LATENCY_SECONDS,
        metrics.GENERATION_TOKENS_TOTAL,
        metrics.HERD_ROUTER_REQUESTS_TOTAL,
        metrics.HERD_ROUTER_ERRORS_TOTAL,
        metrics.HERD_ROUTER_DECISION_SECONDS,
        metrics.HERD_ROUTER_TTFT_SECONDS,
        metrics.HERD_ROUTER_IN_FLIGHT,
        metrics.HERD_KV_TIER_USAGE_PERC,
        metrics.HERD_KV_TIER_STORED_TOTAL,
        metrics.HERD_KV_TIER_RESTORED_TOTAL,
        metrics.HERD_KV_TIER_EVICTED_TOTAL,
        metrics.HERD_KV_PEER_PULLS_TOTAL,
    ],
)
def test_the_key_serving_metrics_have_a_panel(name: str) -> None:
    assert name in {_base_name(queried) for queried in _queried_metrics()}


def test_panels_have_unique_ids_and_use_the_datasource_variable() -> None:
    panels = _panels()
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_dashboard_configmap_carries_the_sidecar_label_and_the_json() -> None:
    values = {"dashboards": {"annotations": {"grafana_folder": "LLM"}, "namespace": "monitoring"}}
    (config_map,) = find(render_chart(values), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["herd.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("name", [metrics.TIME_TO_FIRST_TOKEN_SECONDS, metrics.INTER_TOKEN_LATENCY_SECONDS])
def test_worker_latency_panels_split_by_role(name: str) -> None:
    """A prefill worker's TTFT is its pool's prefill latency: mixed with the decode workers' it
    would mean neither (the PodMonitor puts the pod's herd.dev/role on every series as ``role``)."""
    exprs = [
        target["expr"] for panel in _panels() for target in panel.get("targets", []) if name in target["expr"]
    ]
    assert exprs
    assert all("sum by (le, model_name, role)" in expr for expr in exprs), exprs
