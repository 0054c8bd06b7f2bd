"""pytest fixtures: import them into a test module (``from support.kube.fixtures import kube``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .emulator import Emulator, kube_emulator

__all__ = ["kube", "kube_module"]


@pytest.fixture
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """A fresh emulator for one test."""
    with kube_emulator(tmp_path_factory.mktemp("kube")) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def kube_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """One emulator shared by a test module (use distinct names or namespaces per test)."""
    with kube_emulator(tmp_path_factory.mktemp("kube")) as emulator:
        yield emulator
