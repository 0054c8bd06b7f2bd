"""``herd bench calibrate``: fit the simulated engine's cost model to the real engine on a model.

It runs herd's engine on the model at each batch size and context length of the grid, times the
runner's steps and writes the fitted ``costModel`` as JSON, ready for a manifest's
``spec.engine.simulation.costModel`` (``herd.worker.calibrate`` does the work).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from herd.cli._args import positive
from herd.cli.loadgen.output import cannot_write, check_writable
from herd.cli.worker import engine_spec

__all__ = ["register", "run"]


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1,2,4, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"every size must be at least 1, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    from herd.worker.calibrate import CalibrationGrid, calibrate
    from herd.worker.config import EngineConfig

    try:
        spec = engine_spec(args.engine_json, {"device": "cpu" if args.engine_json is None else None})
        config = EngineConfig(model_path=args.model, served_name=args.model.name, engine=spec)
    except (ValidationError, ValueError) as error:
        print(f"herd bench calibrate: invalid settings: {error}", file=sys.stderr)
        return 2
    grid = CalibrationGrid(args.batch_sizes, args.context_lens, args.output_len)
    longest = max(grid.context_lens) + grid.output_len
    if longest > config.max_model_len:
        print(
            f"herd bench calibrate: the longest context ({longest} tokens) exceeds maxModelLen "
            f"{config.max_model_len}: lower --context-lens or raise maxModelLen in --engine-json",
            file=sys.stderr,
        )
        return 2
    if args.out:
        try:
            check_writable(args.out, "--out")
        except ValueError as error:
            print(f"herd bench calibrate: {error}", file=sys.stderr)
            return 2
    cost = calibrate(config, grid).model_dump(by_alias=True)
    text = json.dumps(cost, indent=2) + "\n"
    print(text, end="")
    if args.out:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        except OSError as error:  # checked before the run, but the disk may have filled since
            print(f"herd bench calibrate: {cannot_write(args.out, '--out', error)}", file=sys.stderr)
            return 1
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="fit the simulated backend's cost model (engine.simulation.costModel) to the real engine",
    )
    parser.add_argument("--model", type=Path, required=True, help="HF-format model folder")
    parser.add_argument(
        "--engine-json", help="the manifest's engine block as camelCase JSON (default: CPU, the defaults)"
    )
    parser.add_argument("--batch-sizes", type=_sizes, default=(1, 2, 4, 8), help="default 1,2,4,8")
    parser.add_argument(
        "--context-lens", type=_sizes, default=(32, 128, 384), help="prompt tokens; default 32,128,384"
    )
    parser.add_argument(
        "--output-len", type=positive(int), default=16, help="decoded tokens per request (default 16)"
    )
    parser.add_argument("--out", type=Path, help="also write the cost model as JSON to this file")
    parser.set_defaults(func=run)
