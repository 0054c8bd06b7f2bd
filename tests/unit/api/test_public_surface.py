"""Pins what herd.api exports (the httpx way): a change here is a contract change."""

from __future__ import annotations

import importlib
import subprocess
import sys

import herd.api

EXPECTED = {
    "BlockHash",
    "ManifestError",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "PromptError",
    "PromptRenderer",
    "RoutingSpec",
    "block_hashes",
    "crd",
    "hash_block",
    "load_manifest",
    "metrics",
    "openai",
    "parse_manifest",
    "protocol",
    "root_hash",
}


def test_exports_are_pinned() -> None:
    assert set(herd.api.__all__) == EXPECTED
    for name in herd.api.__all__:
        assert hasattr(herd.api, name)


def test_every_module_declares_all() -> None:
    for name in (
        "backends",
        "body",
        "crd",
        "errors",
        "crd_schema",
        "kv_events",
        "kv_hash",
        "logs",
        "manifest",
        "metrics",
        "openai",
        "prompt",
        "protocol",
        "tools",
        "worker_status",
    ):
        assert hasattr(importlib.import_module(f"herd.api.{name}"), "__all__"), name


def test_components_import_and_operator_is_still_the_stdlib_module() -> None:
    code = (
        "import herd.api, herd.worker, herd.orchestrator, herd.operator, operator, sys;"
        "assert operator.__file__.startswith(sys.base_prefix), operator.__file__;"
        "assert operator.itemgetter(1)([0, 7]) == 7"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
