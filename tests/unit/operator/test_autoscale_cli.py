"""``herd operator`` autoscaler flags reach the operator's settings."""

from __future__ import annotations

from herd.cli.main import build_parser
from herd.cli.operator import operator_config
from herd.operator.settings import AutoscalerSettings


def test_autoscale_flags() -> None:
    argv = ["operator", "-A", "--autoscale-interval", "5", "--autoscale-window", "60"]
    config = operator_config(build_parser(argv).parse_args(argv))
    assert (config.autoscaler.interval_s, config.autoscaler.stabilization_s) == (5.0, 60.0)


def test_autoscale_defaults() -> None:
    argv = ["operator", "-n", "default"]
    assert operator_config(build_parser(argv).parse_args(argv)).autoscaler == AutoscalerSettings()
