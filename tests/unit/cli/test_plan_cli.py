"""``herd plan -f``: the operator's planned children as YAML documents, no cluster needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from herd.api.manifest import load_manifest
from herd.cli.main import main
from herd.operator.plan import plan
from herd.operator.settings import PlanSettings

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert main(["plan", *argv]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_every_child_the_planner_makes_is_printed_as_one_document(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = [obj.body for md in load_manifest(path) for obj in plan(md, PlanSettings()).objects]
    assert printed(capsys, "-f", str(path)) == expected


def test_the_output_reads_like_helm_templates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "-f", str(REPO / "examples" / "smollm2-disagg.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("---\n# Source: ModelDeployment default/smollm2-disagg\napiVersion: apps/v1\n")
    assert out.count("\n---\n") == 3 and "&id" not in out  # four documents, no YAML anchors


def test_namespace_flags_and_the_manifests_labels_reach_the_children(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    manifest["metadata"]["labels"] = {"team": "chat", "herd.dev/role": "not-copied-over-herds-own"}
    manifest["spec"]["gateway"] = {"inferencePool": True}
    path = tmp_path / "md.yaml"
    path.write_text(yaml.safe_dump(manifest))
    docs = printed(
        capsys, "-f", str(path), "-n", "models", "--worker-image", "me/worker:7", "--epp-image", "me/epp:7"
    )
    kinds = [doc["kind"] for doc in docs]
    assert kinds.count("InferencePool") == 1 and "ServiceAccount" in kinds
    assert {doc["metadata"]["namespace"] for doc in docs} == {"models"}
    assert all(doc["metadata"]["labels"]["team"] == "chat" for doc in docs)
    workers = next(
        doc for doc in docs if doc["metadata"]["name"] == "smollm2-workers" and doc["kind"] == "Deployment"
    )
    assert workers["metadata"]["labels"]["herd.dev/role"] == "unified"
    assert workers["spec"]["template"]["spec"]["containers"][0]["image"] == "me/worker:7"
    epp = next(
        doc for doc in docs if doc["metadata"]["name"] == "smollm2-epp" and doc["kind"] == "Deployment"
    )
    assert epp["spec"]["template"]["spec"]["containers"][0]["image"] == "me/epp:7"


def test_an_invalid_manifest_names_the_field_and_prints_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    manifest["spec"]["engine"]["kvCache"]["blockSize"] = 12
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert main(["plan", "-f", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "spec.engine.kvCache.blockSize" in captured.err
