"""``herd orchestrator``'s queue bounds: defaults from ``QueueSettings``, numbers above zero only."""

from __future__ import annotations

import pytest

from herd.cli.main import build_parser
from herd.orchestrator.admission.waiting import QueueSettings


def parse(*flags: str) -> tuple[int, float]:
    argv = ["orchestrator", *flags]
    args = build_parser(argv).parse_args(argv)
    return args.queue_max_size, args.queue_max_wait


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), (QueueSettings().max_size, QueueSettings().max_wait_seconds)),
        (("--queue-max-size", "8"), (8, QueueSettings().max_wait_seconds)),
        (("--queue-max-wait", "0.5"), (QueueSettings().max_size, 0.5)),
    ],
)
def test_queue_bounds(flags: tuple[str, ...], expected: tuple[int, float]) -> None:
    assert parse(*flags) == expected


@pytest.mark.parametrize(
    "flags", [("--queue-max-size", "0"), ("--queue-max-wait", "-1"), ("--queue-max-size", "x")]
)
def test_a_bound_not_above_zero_is_a_usage_error(
    flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*flags)
    assert flags[0] in capsys.readouterr().err
