"""The generated CRD: up to date, structural, and validating every example manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from herd.api import load_manifest
from herd.api.crd_schema import crd_manifest
from herd.cli.crds import FILE_NAME, render

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def spec_validator() -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas use Draft 4's boolean exclusiveMinimum; x-kubernetes-* keys are ignored.
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(schema)


def test_crds_folder_is_up_to_date() -> None:
    assert (REPO / "crds" / FILE_NAME).read_text() == render(), "run `make crds` and commit crds/"


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found.extend(walk(value, f"{path}.{key}"))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(walk(value, f"{path}[{index}]"))
    return found


def test_schema_is_structural() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert not {"$ref", "$defs", "oneOf", "anyOf", "allOf", "title", "const"} & node.keys(), path
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if node.get("type") == "object" and "properties" in node:
            for name in node.get("required", []):
                assert name in node["properties"], f"{path}.required names {name}"


def test_crd_has_subresources_columns_and_short_name() -> None:
    spec = crd_manifest()["spec"]
    version = spec["versions"][0]
    assert spec["names"]["shortNames"] == ["md"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    columns = [column["name"] for column in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Mode", "Workers", "Prefill", "Decode", "Strategy", "Endpoint", "Age"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_validate_against_the_crd_schema(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        spec_validator().validate(document)
    assert load_manifest(path)


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"workers": {"replicas": -2}}, "replicas"),
        ({"routing": {"strategy": "fastest"}}, "strategy"),
        ({"engine": {"dtype": "int3"}}, "dtype"),
        ({"serving": {"mode": "split"}}, "mode"),
    ],
    ids=["negative-replicas", "unknown-strategy", "unknown-dtype", "unknown-mode"],
)
def test_invalid_manifest_is_rejected_naming_the_field(patch: dict[str, Any], field: str) -> None:
    document = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    for key, value in patch.items():
        document["spec"][key] = {**document["spec"].get(key, {}), **value}
    errors = list(spec_validator().iter_errors(document))
    assert errors
    assert any(field in list(error.absolute_path) for error in errors), [e.message for e in errors]
