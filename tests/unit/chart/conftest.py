"""Values scenarios of the chart tests: the defaults and every optional part switched on."""

from __future__ import annotations

from typing import Any

import pytest
from support.chart import render_chart

FULL: dict[str, Any] = {
    "redis": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "orchestrator": {
        "replicas": 3,
        "podDisruptionBudget": {"enabled": True},
        "apiKeys": {"existingSecret": "herd-api-keys"},
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "orchestrator"}},
                        },
                    }
                ]
            }
        },
        "extraEnv": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    },
    "operator": {"nodeSelector": {"pool": "system"}, "logLevel": "debug"},
    "imagePullSecrets": [{"name": "registry"}],
    "test": {"apiKey": {"existingSecret": "herd-api-keys", "key": "test-key"}},
}
NAMESPACED: dict[str, Any] = {"watch": {"allNamespaces": False, "namespaces": ["team-a"]}}
EXTERNAL_REDIS: dict[str, Any] = {"redis": {"externalUrl": "rediss://cache.example.internal:6380/2"}}

SCENARIOS: dict[str, dict[str, Any]] = {
    "default": {},
    "full": FULL,
    "namespaced": NAMESPACED,
    "external-redis": EXTERNAL_REDIS,
}


@pytest.fixture(params=list(SCENARIOS.values()), ids=list(SCENARIOS))
def values(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Each scenario's values in turn."""
    scenario: dict[str, Any] = request.param
    return scenario


@pytest.fixture
def manifests(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object the scenario renders, the helm test hook included."""
    return render_chart(values, include_hooks=True)
