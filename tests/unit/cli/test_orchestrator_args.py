"""``herd orchestrator``'s queue bounds and batch idle headroom: defaults from the settings, validated."""

from __future__ import annotations

import pytest

from herd.cli.main import build_parser
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.routing.headroom import IdleHeadroom


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


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), (IdleHeadroom().max_share, IdleHeadroom().window_s)),
        (("--batch-idle-max-share", "0"), (0.0, IdleHeadroom().window_s)),
        (("--batch-idle-max-share", "0.5", "--batch-idle-window", "30"), (0.5, 30.0)),
    ],
)
def test_batch_idle_headroom(flags: tuple[str, ...], expected: tuple[float, float]) -> None:
    argv = ["orchestrator", *flags]
    args = build_parser(argv).parse_args(argv)
    assert (args.batch_idle_max_share, args.batch_idle_window) == expected


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--batch-idle-max-share", "1"), "1 is not in [0, 1)"),
        (("--batch-idle-max-share", "-0.1"), "-0.1 is not in [0, 1)"),
        (("--batch-idle-window", "0"), "0 is not above zero"),
    ],
)
def test_a_bad_idle_headroom_is_a_usage_error(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(*flags)
    err = capsys.readouterr().err
    assert flags[0] in err and message in err
