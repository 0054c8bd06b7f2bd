"""The chart's CRD is the generated one, kept on uninstall, and cannot drift from crds/."""

from __future__ import annotations

from pathlib import Path

import yaml
from support.chart import CHART, find, render_chart

GENERATED = Path(__file__).resolve().parents[3] / "crds" / "herd.dev_modeldeployments.yaml"
CHART_COPY = CHART / "files" / GENERATED.name


def test_chart_copy_equals_the_generated_crd() -> None:
    assert CHART_COPY.read_text() == GENERATED.read_text(), (
        f"{CHART_COPY} drifted from {GENERATED}: run `cp {GENERATED.relative_to(GENERATED.parents[1])} "
        f"{CHART_COPY.relative_to(GENERATED.parents[1])}` after `make crds`"
    )


def test_rendered_crd_is_the_generated_one_with_keep_policy() -> None:
    (rendered,) = find(render_chart({}), "CustomResourceDefinition")
    generated = yaml.safe_load(GENERATED.read_text())
    assert rendered["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    rendered_labels = rendered["metadata"].pop("labels")
    assert generated["metadata"].pop("labels").items() <= rendered_labels.items()
    assert rendered_labels["app.kubernetes.io/managed-by"] == "Helm"
    assert rendered == generated


def test_crd_can_be_left_to_another_installer() -> None:
    assert find(render_chart({"crds": {"install": False}}), "CustomResourceDefinition") == []
