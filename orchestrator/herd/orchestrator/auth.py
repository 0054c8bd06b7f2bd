"""Optional API keys: ``Authorization: Bearer <key>``, from a file (one per line) or ``HERD_API_KEYS``."""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["API_KEYS_ENV", "ApiKeys", "load_api_keys"]

API_KEYS_ENV = "HERD_API_KEYS"
"""Comma-separated keys, used when no keys file is given."""


class ApiKeys:
    """The accepted keys; empty means authentication is off."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """Constant-time compare against every key, so timing does not reveal a near miss."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        offered = token.strip().encode() if scheme.lower() == "bearer" else b""
        matches = [hmac.compare_digest(offered, key) for key in self._keys]
        return any(matches)


def load_api_keys(path: Path | None = None) -> ApiKeys:
    """Keys from ``path`` (blank lines and ``#`` comments skipped), else from the environment."""
    if path is not None:
        lines = (line.strip() for line in path.read_text().splitlines())
        return ApiKeys([line for line in lines if line and not line.startswith("#")])
    return ApiKeys([key.strip() for key in os.environ.get(API_KEYS_ENV, "").split(",")])
