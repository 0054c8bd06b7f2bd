"""A broken ``--api-keys-file`` stops ``herd orchestrator`` and ``herd epp`` with a usage error that
names the file (exit 2, one line on stderr), never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd.cli import epp, orchestrator
from herd.cli.main import main

DEEP = 5000
"""Levels of nesting far past Python's recursion limit."""


@pytest.mark.parametrize("command", ["orchestrator", "epp"])
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * DEEP + "]" * DEEP, "nested too deeply"),
        ("tenants:\n  - name: a\n    keys: [k1\n", "not valid YAML"),
        ("tenants: [{name: a, keys: [k, ' k']}]", "once, in one tenant only"),
        ("", "holds no API key"),
        ("# only a comment\n\n", "holds no API key"),
        (b"k1\n\xff\xfe\n", "byte 3 is not UTF-8"),
    ],
    ids=["deep", "syntax-error", "same-key-twice", "empty", "comments-only", "not-utf8"],
)
def test_a_broken_keys_file_is_a_usage_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    text: str | bytes,
    words: str,
) -> None:
    for module in (orchestrator, epp):  # a file read as keys after all would start a server: fail instead
        monkeypatch.setattr(module, "configure_logging", _refuse_to_start)
    keys = tmp_path / "keys"
    if isinstance(text, bytes):
        keys.write_bytes(text)
    else:
        keys.write_text(text)
    argv = [command, "--worker", "tiny=http://127.0.0.1:1,http://127.0.0.1:2", "--api-keys-file", str(keys)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"herd {command}: {keys}: ") and words in error


def _refuse_to_start(*_: object) -> None:
    raise AssertionError("the command went on to serve with a broken keys file")
