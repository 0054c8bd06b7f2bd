"""Print the project's runtime requirements from pyproject.toml, one per line, leaving some out.

The operator and orchestrator images never import torch, and ``pip install .`` would pull its
multi-GB CUDA build into the control plane; they install these requirements, then the project
with ``--no-deps``. Usage: ``python docker/requirements.py --without torch > requirements.txt``.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path

__all__ = ["requirements"]

_NAME = re.compile(r"^[A-Za-z0-9._-]+")


def requirements(pyproject: Path, without: set[str]) -> list[str]:
    """The ``project.dependencies`` of ``pyproject`` whose distribution name is not in ``without``."""
    dependencies: list[str] = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [line for line in dependencies if _name(line) not in without]


def _name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot read a package name from the requirement {requirement!r} in pyproject.toml")
    return match.group().lower().replace("_", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--without", action="append", default=[], help="a package to leave out (repeatable)")
    args = parser.parse_args()
    print("\n".join(requirements(args.pyproject, {name.lower() for name in args.without})))


if __name__ == "__main__":
    main()
