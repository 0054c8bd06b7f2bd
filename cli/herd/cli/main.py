"""The ``herd`` command. Thin: it parses arguments and calls the components."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# Each module registers one subcommand through `register(subparsers)`; imported lazily so that
# `herd crds` does not pay for torch and `herd worker` does not pay for kopf.
_COMMANDS = {
    "up": "herd.cli.up",
    "worker": "herd.cli.worker",
    "sidecar": "herd.cli.sidecar",
    "orchestrator": "herd.cli.orchestrator",
    "epp": "herd.cli.epp",
    "operator": "herd.cli.operator",
    "bench": "herd.cli.bench",
    "model": "herd.cli.model",
    "crds": "herd.cli.crds",
    "plan": "herd.cli.plan",
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="herd", description="Kubernetes-native LLM serving.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, module in _COMMANDS.items():
        if wanted in (None, name) or wanted not in _COMMANDS:
            try:
                importlib.import_module(module).register(subparsers)
            except ModuleNotFoundError as error:
                if error.name != module:
                    raise
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(args_list).parse_args(args_list)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
