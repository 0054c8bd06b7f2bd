"""Argparse types for the commands' numeric flags: a value outside its range is a usage error that
names the flag and says what it must be, never a server that starts and then fails every request
(a negative body limit answering 413 to all) or a traceback from deep inside (a port past 65535)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["at_least_zero", "port", "positive", "share"]


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """A finite number above zero."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text} is not a finite number above zero")
        return value

    return parse


def at_least_zero(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """A finite number of zero or more."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{text} is not a finite number of zero or more")
        return value

    return parse


def share(text: str) -> float:
    """A fraction in [0, 1)."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1)")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1 to 65535)")
    return value
