"""bench/gateway_decision.py's ``--max-in-flight``: the model's per-worker limit, which has ``decide``'s
capacity filter run on every timed decision, and the command each tree runs under ``--baseline``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import gateway_decision


@pytest.mark.parametrize(("max_in_flight", "most"), [(None, 8), (6, 6), (5, 5)], ids=["none", "6", "5"])
def test_max_in_flight_bounds_every_chosen_worker(max_in_flight: int | None, most: int) -> None:
    """Round robin takes each worker in turn, whatever it holds: without a limit it reaches the
    fleet's busiest (7 in flight, 8 once counted); with one, the filter keeps it to the limit."""
    figures = asyncio.run(
        gateway_decision.time_steps(
            "round_robin", 20, 60, "reused", seed=0, max_in_flight=max_in_flight, num_warmup=5
        )
    )
    assert figures["most_in_flight"] == most
    assert min(figures["cpu_p50_us"], figures["interactive_cpu_p50_us"], figures["batch_cpu_p50_us"]) > 0


COMMON = ["--workers", "1000", "--decisions", "3000", "--rounds", "1", "--strategies", "least_request"]


@pytest.mark.parametrize(
    ("extra", "script", "tail"),
    [
        ([], Path("/base/bench/gateway_decision.py"), ["--seed", "0"]),
        (
            ["--max-in-flight", "8"],
            Path(gateway_decision.__file__).resolve(),
            ["--seed", "0", "--max-in-flight", "8"],
        ),
    ],
    ids=["the-trees-own-script", "this-checkouts-script-with-the-limit"],
)
def test_a_baseline_round_runs_the_script_that_takes_the_options(
    extra: list[str], script: Path, tail: list[str]
) -> None:
    parser_args = ["--baseline", "450ae74", "--strategies", "least_request", *extra]
    args = gateway_decision.parse_args(parser_args)
    assert gateway_decision.tree_command(args, Path("/base")) == [str(script), *COMMON, *tail]


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_a_limit_below_one_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gateway_decision.parse_args(["--max-in-flight", value])
    assert "--max-in-flight" in capsys.readouterr().err
