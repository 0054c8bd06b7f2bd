"""The admission flags ``herd orchestrator`` and ``herd epp`` share: the queue's bounds (defaults from
``QueueSettings``, numbers above zero only), the slot reserve (default ``SlotReserve``'s, in [0, 1)) and
the idle headroom (``IdleHeadroom``'s);
a bad value is a usage error that names the flag and says what it must be."""

from __future__ import annotations

import argparse

import pytest

from herd.cli.epp import epp_settings
from herd.cli.main import build_parser
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.routing.headroom import IdleHeadroom
from herd.orchestrator.routing.reserve import SlotReserve

COMMANDS = ["orchestrator", "epp"]
DEFAULTS = {
    "queue_max_size": QueueSettings().max_size,
    "queue_max_wait": QueueSettings().max_wait_seconds,
    "slot_reserve": SlotReserve().share,
    "batch_idle_max_share": IdleHeadroom().max_share,
    "batch_idle_window": IdleHeadroom().window_s,
    "batch_idle_min_workers": IdleHeadroom().min_workers,
}


def parsed(command: str, *flags: str) -> argparse.Namespace:
    argv = [command, *flags]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("flags", "changed"),
    [
        ((), {}),
        (("--queue-max-size", "8"), {"queue_max_size": 8}),
        (("--queue-max-wait", "0.5"), {"queue_max_wait": 0.5}),
        (("--slot-reserve", "0"), {"slot_reserve": 0.0}),
        (("--slot-reserve", "0.5"), {"slot_reserve": 0.5}),
        (("--batch-idle-max-share", "0"), {"batch_idle_max_share": 0.0}),
        (
            ("--batch-idle-max-share", "0.5", "--batch-idle-window", "30"),
            {"batch_idle_max_share": 0.5, "batch_idle_window": 30.0},
        ),
        (("--batch-idle-min-workers", "2"), {"batch_idle_min_workers": 2}),
    ],
)
def test_admission_flags(command: str, flags: tuple[str, ...], changed: dict[str, float]) -> None:
    args = parsed(command, *flags)
    assert {name: getattr(args, name) for name in DEFAULTS} == DEFAULTS | changed


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--queue-max-size", "0"), "0 is not a finite number above zero"),
        (("--queue-max-wait", "-1"), "-1 is not a finite number above zero"),
        (("--queue-max-size", "x"), "invalid"),
        (("--queue-max-wait", "nan"), "nan is not a finite number above zero"),
        (("--queue-max-wait", "inf"), "inf is not a finite number above zero"),
        (("--slot-reserve", "1"), "1 is not in [0, 1)"),
        (("--slot-reserve", "-0.1"), "-0.1 is not in [0, 1)"),
        (("--slot-reserve", "half"), "invalid"),
        (("--batch-idle-max-share", "1"), "1 is not in [0, 1)"),
        (("--batch-idle-max-share", "-0.1"), "-0.1 is not in [0, 1)"),
        (("--batch-idle-window", "0"), "0 is not a finite number above zero"),
        (("--batch-idle-min-workers", "-1"), "-1 is not a finite number of zero or more"),
        (("--batch-idle-min-workers", "one"), "invalid"),
    ],
)
def test_a_bad_admission_flag_is_a_usage_error_naming_it(
    command: str, flags: tuple[str, ...], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parsed(command, *flags)
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {flags[0]}: " in error and words in error


def test_the_endpoint_pickers_admission_is_what_its_flags_say() -> None:
    flags = ("--queue-max-size", "8", "--queue-max-wait", "2.5", "--slot-reserve", "0.5")
    headroom = ("--batch-idle-max-share", "0.5", "--batch-idle-window", "3", "--batch-idle-min-workers", "1")
    picker = epp_settings(parsed("epp", *flags, *headroom), None).picker
    assert picker.queue == QueueSettings(max_size=8, max_wait_seconds=2.5)
    assert picker.slot_reserve == SlotReserve(share=0.5)
    assert picker.idle_headroom == IdleHeadroom(max_share=0.5, window_s=3.0, min_workers=1)
    defaults = epp_settings(parsed("epp"), None).picker
    assert (defaults.queue, defaults.slot_reserve, defaults.idle_headroom) == (
        QueueSettings(),
        SlotReserve(),
        IdleHeadroom(),
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_the_redis_timeout_defaults_to_half_a_second_and_takes_finite_positive_seconds(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parsed(command).redis_timeout == 0.5
    assert parsed(command, "--redis-timeout", "5").redis_timeout == 5.0
    with pytest.raises(SystemExit):
        parsed(command, "--redis-timeout", "0")
    assert "argument --redis-timeout: 0 is not a finite number above zero" in capsys.readouterr().err
