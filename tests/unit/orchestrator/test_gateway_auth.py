"""API keys: loaded from a file or HERD_API_KEYS, checked in constant time against the Bearer token."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd.orchestrator.auth import API_KEYS_ENV, ApiKeys, load_api_keys


@pytest.mark.parametrize(
    ("authorization", "is_allowed"),
    [
        ("Bearer k1", True),
        ("bearer k2", True),
        ("Bearer  k1 ", True),
        ("Bearer k3", False),
        ("Bearer ", False),
        ("k1", False),
        (None, False),
    ],
    ids=["first", "scheme-case", "extra-spaces", "unknown", "empty-token", "no-scheme", "missing"],
)
def test_allows(authorization: str | None, is_allowed: bool) -> None:
    assert ApiKeys(["k1", "k2"]).allows(authorization) is is_allowed


def test_no_keys_means_no_authentication() -> None:
    keys = ApiKeys([])
    assert not keys.is_enabled and keys.allows(None)


def test_keys_from_file_skip_blanks_and_comments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "from-env")
    path = tmp_path / "keys"
    path.write_text("# team a\nk1\n\n  k2  \n")
    keys = load_api_keys(path)
    assert keys.allows("Bearer k1") and keys.allows("Bearer k2") and not keys.allows("Bearer from-env")


def test_keys_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "a, b,")
    keys = load_api_keys()
    assert keys.allows("Bearer a") and keys.allows("Bearer b") and not keys.allows("Bearer ")
