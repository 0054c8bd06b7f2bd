"""Output files of ``herd bench`` commands: one that cannot be written is refused before the run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from herd.cli.loadgen.output import check_writable
from herd.cli.main import main

_IS_ROOT = os.geteuid() == 0


def _directory(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "deeper" / "out.json"


def _in_a_read_only_folder(tmp_path: Path) -> Path:
    (tmp_path / "ro").mkdir(mode=0o555)
    return tmp_path / "ro" / "out.json"


def _read_only_file(tmp_path: Path) -> Path:
    (tmp_path / "out.json").write_text("")
    (tmp_path / "out.json").chmod(0o444)
    return tmp_path / "out.json"


def _in_proc(tmp_path: Path) -> Path:
    return Path("/proc/herd-bench/out.json")


_BAD_OUTPUTS = [
    pytest.param(_directory, "is a directory: name a file in it", id="directory"),
    pytest.param(_under_a_file, "file is a file, not a folder", id="under-a-file"),
    pytest.param(
        _in_proc,
        ": cannot create files in /proc",
        id="proc",
        marks=pytest.mark.skipif(not Path("/proc/self").exists(), reason="Linux only"),
    ),
    pytest.param(
        _in_a_read_only_folder,
        "/ro (Permission denied)",
        id="read-only-folder",
        marks=pytest.mark.skipif(_IS_ROOT, reason="root writes anywhere"),
    ),
    pytest.param(
        _read_only_file,
        ": cannot write it (Permission denied)",
        id="read-only-file",
        marks=pytest.mark.skipif(_IS_ROOT, reason="root writes anywhere"),
    ),
]

_COMMANDS = {
    "bench": (["bench", "--url", "http://127.0.0.1:9", "--num-requests", "1", "--json-out"], "--json-out"),
    "bench trace": (["bench", "trace", "--kind", "shared-prefix", "--num-groups", "1", "--out"], "--out"),
    "bench calibrate": (["bench", "calibrate", "--model", "{model}", "--out"], "--out"),
}


@pytest.mark.parametrize("command", list(_COMMANDS))
@pytest.mark.parametrize(("make_path", "problem"), _BAD_OUTPUTS)
def test_an_unwritable_output_is_refused_before_the_run(
    command: str,
    make_path: Callable[[Path], Path],
    problem: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = tmp_path / "model"  # enough of a model for calibrate to reach its checks
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = make_path(tmp_path)
    entries = sorted(tmp_path.rglob("*"))
    args, option = _COMMANDS[command]
    assert main([arg.format(model=model) for arg in args] + [str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"herd {command}: {option} {path}"), error
    assert problem in error
    assert sorted(tmp_path.rglob("*")) == entries  # nothing written, no folder made


@pytest.mark.parametrize(
    "make_path",
    [lambda tmp: tmp / "new" / "deeper" / "out.json", lambda tmp: tmp / "out.json"],
    ids=["new-folders", "existing-file"],
)
def test_a_writable_output_passes_and_is_left_alone(
    make_path: Callable[[Path], Path], tmp_path: Path
) -> None:
    (tmp_path / "out.json").write_text("kept")
    path = make_path(tmp_path)
    entries = sorted(tmp_path.rglob("*"))
    check_writable(path, "--out")
    assert sorted(tmp_path.rglob("*")) == entries
    assert (tmp_path / "out.json").read_text() == "kept"
