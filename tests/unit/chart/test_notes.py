"""The install notes tell how to reach the endpoint and warn about replicas without shared state."""

from __future__ import annotations

from typing import Any

import pytest
from support.chart import render_templates


def _notes(values: dict[str, Any]) -> str:
    return render_templates(values)["herd/templates/NOTES.txt"]


def test_notes_give_the_endpoint_a_manifest_and_the_test_command() -> None:
    notes = _notes({"test": {"model": "llama-3-8b"}})
    assert "http://herd-orchestrator.herd.svc:8000/v1" in notes
    assert "kubectl port-forward -n herd svc/herd-orchestrator 8000:8000" in notes
    assert "kind: ModelDeployment" in notes
    assert '"model": "llama-3-8b"' in notes
    assert "helm test herd -n herd" in notes


WARNINGS = {
    "one-replica": ({}, False),
    "replicas-without-redis": ({"orchestrator": {"replicas": 3}}, True),
    "replicas-with-redis": ({"orchestrator": {"replicas": 3}, "redis": {"enabled": True}}, False),
    "replicas-with-external-redis": (
        {"orchestrator": {"replicas": 3}, "redis": {"externalUrl": "redis://r:6379"}},
        False,
    ),
}


@pytest.mark.parametrize(("values", "warned"), WARNINGS.values(), ids=WARNINGS.keys())
def test_notes_warn_about_replicas_without_redis(values: dict[str, Any], warned: bool) -> None:
    assert ("WARNING" in _notes(values)) is warned
