"""``herd operator`` autoscaler flags reach the operator's settings."""

from __future__ import annotations

from herd.cli.main import build_parser
from herd.cli.operator import operator_config
from herd.operator.settings import AutoscalerSettings


def test_autoscale_flags() -> None:
    argv = [
        "operator",
        "-A",
        "--autoscale-interval",
        "5",
        "--autoscale-window",
        "60",
        "--demand-interval",
        "0.5",
    ]
    scaler = operator_config(build_parser(argv).parse_args(argv)).autoscaler
    assert (scaler.interval_s, scaler.stabilization_s, scaler.demand_interval_s) == (5.0, 60.0, 0.5)


def test_autoscale_defaults() -> None:
    argv = ["operator", "-n", "default"]
    assert operator_config(build_parser(argv).parse_args(argv)).autoscaler == AutoscalerSettings()
