"""``herd operator`` refuses to start without credentials, saying what to pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd.cli.main import main


def test_missing_kubeconfig_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "-A", "--kubeconfig", str(tmp_path / "missing.yaml")]) == 2
    assert "--kubeconfig" in capsys.readouterr().err


def test_a_scope_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["operator"])
    assert "--namespace" in capsys.readouterr().err
