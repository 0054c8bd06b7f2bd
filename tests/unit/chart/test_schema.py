"""values.schema.json refuses bad values with a message naming the key, before anything renders."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from support.chart import CHART, render_chart

BAD_VALUES = {
    "unknown-top-level-key": ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    "unknown-nested-key": ({"orchestrator": {"replica": 2}}, "additional properties 'replica' not allowed"),
    "replicas-as-string": ({"orchestrator": {"replicas": "two"}}, "/orchestrator/replicas"),
    "negative-replicas": ({"orchestrator": {"replicas": -1}}, "/orchestrator/replicas"),
    "two-operators": ({"operator": {"replicas": 2}}, "/operator/replicas"),
    "pull-policy-enum": ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    "service-type-enum": ({"orchestrator": {"service": {"type": "Ingress"}}}, "/orchestrator/service/type"),
    "port-out-of-range": ({"orchestrator": {"port": 70000}}, "/orchestrator/port"),
    "log-level-enum": ({"operator": {"logLevel": "verbose"}}, "/operator/logLevel"),
    "redis-url-scheme": ({"redis": {"externalUrl": "http://redis:6379"}}, "/redis/externalUrl"),
    "namespace-not-dns": ({"watch": {"namespaces": ["Team_A"]}}, "/watch/namespaces/0"),
    "bool-as-string": ({"redis": {"enabled": "yes"}}, "/redis/enabled"),
    "resources-quantity": (
        {"operator": {"resources": {"limits": {"memory": "lots"}}}},
        "/operator/resources",
    ),
    "pdb-percent-format": (
        {"orchestrator": {"podDisruptionBudget": {"maxUnavailable": "half"}}},
        "/orchestrator/podDisruptionBudget/maxUnavailable",
    ),
    "scrape-interval": ({"serviceMonitor": {"interval": "often"}}, "/serviceMonitor/interval"),
    "empty-test-model": ({"test": {"model": ""}}, "/test/model"),
    "unpinned-redis-tag": ({"redis": {"image": {"tag": ""}}}, "/redis/image/tag"),
}


@pytest.mark.parametrize(("values", "message"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_values_are_refused_naming_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as caught:
        render_chart(values)
    assert message in str(caught.value)


def test_scenario_values_are_accepted(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)


RENDER_FAILURES = {
    "redis-both-ways": (
        {"redis": {"enabled": True, "externalUrl": "redis://elsewhere:6379"}},
        "redis.enabled and redis.externalUrl are exclusive",
    ),
    "pdb-both-bounds": (
        {"orchestrator": {"podDisruptionBudget": {"enabled": True, "minAvailable": 1}}},
        "set exactly one of minAvailable and maxUnavailable",
    ),
    "pdb-no-bound": (
        {"orchestrator": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": None}}},
        "set exactly one of minAvailable and maxUnavailable",
    ),
}


@pytest.mark.parametrize(("values", "message"), RENDER_FAILURES.values(), ids=RENDER_FAILURES.keys())
def test_contradictory_values_fail_with_the_fix(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_chart(values)
