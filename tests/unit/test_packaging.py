"""Every package folder is in pyproject's explicit package list, so `pip install .` ships it."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("api", "kube", "worker", "orchestrator", "operator", "sidecar", "cli")


def test_every_package_folder_is_listed() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(REPO / component).parts)
        for component in COMPONENTS
        for init in (REPO / component).rglob("__init__.py")
    }
    assert on_disk == listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    for package in listed:
        root = ".".join(package.split(".")[:2])
        assert package.startswith(root) and root in config["package-dir"], package


def test_no_init_file_shadows_the_stdlib_operator_module() -> None:
    assert not (REPO / "operator" / "__init__.py").exists()
    assert not (REPO / "operator" / "herd" / "__init__.py").exists()
