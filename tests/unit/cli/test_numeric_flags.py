"""Every command's numeric flags refuse what no server could run with: a usage error (exit 2) that
names the flag and its range, before anything starts."""

from __future__ import annotations

import pytest

from herd.cli.main import build_parser

REQUIRED = {
    "worker": ["--model", "m"],
    "sidecar": ["--served-name", "m", "--model", "m", "--block-size", "16"],
    "up": ["manifest.yaml"],
    "bench calibrate": [],
    "operator": ["-A"],
}


def parse(command: str, *flags: str) -> object:
    argv = [*command.split(), *REQUIRED.get(command, []), *flags]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize(
    ("command", "flag", "value", "words"),
    [
        ("orchestrator", "--port", "70000", "70000 is not a TCP port (1 to 65535)"),
        ("orchestrator", "--port", "0", "0 is not a TCP port"),
        ("orchestrator", "--max-body-bytes", "-1", "-1 is not a finite number above zero"),
        ("orchestrator", "--body-timeout", "nan", "nan is not a finite number above zero"),
        ("orchestrator", "--request-timeout", "inf", "inf is not a finite number above zero"),
        ("orchestrator", "--max-header-bytes", "0", "0 is not a finite number above zero"),
        ("orchestrator", "--keep-alive-timeout", "-5", "-5 is not a finite number above zero"),
        ("orchestrator", "--batch-concurrency", "0", "0 is not a finite number above zero"),
        ("orchestrator", "--max-resumes", "-1", "-1 is not a finite number of zero or more"),
        ("orchestrator", "--redis-timeout", "0", "0 is not a finite number above zero"),
        ("epp", "--port", "65536", "65536 is not a TCP port"),
        ("epp", "--max-body-bytes", "0", "0 is not a finite number above zero"),
        ("operator", "--retry-delay", "-1", "-1 is not a finite number above zero"),
        ("operator", "--autoscale-interval", "nan", "nan is not a finite number above zero"),
        ("operator", "--autoscale-window", "0", "0 is not a finite number above zero"),
        ("operator", "--demand-interval", "inf", "inf is not a finite number above zero"),
        ("worker", "--port", "99999", "99999 is not a TCP port"),
        ("worker", "--internal-port", "-1", "-1 is not a TCP port"),
        ("worker", "--replicas", "0", "0 is not a finite number above zero"),
        ("worker", "--max-body-bytes", "0", "0 is not a finite number above zero"),
        ("worker", "--drain-timeout", "-1", "-1 is not a finite number of zero or more"),
        ("sidecar", "--port", "70000", "70000 is not a TCP port"),
        ("sidecar", "--block-size", "0", "0 is not a finite number above zero"),
        ("up", "--port", "0", "0 is not a TCP port"),
        ("up", "--ready-timeout", "nan", "nan is not a finite number above zero"),
        ("bench calibrate", "--output-len", "0", "0 is not a finite number above zero"),
    ],
)
def test_a_flag_outside_its_range_is_a_usage_error_naming_it(
    command: str, flag: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(command, flag, value)
    assert exited.value.code == 2
    assert f"argument {flag}: {words}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "flag", "value", "attribute", "parsed"),
    [
        ("orchestrator", "--port", "65535", "port", 65535),
        ("orchestrator", "--max-resumes", "0", "max_resumes", 0),
        ("worker", "--drain-timeout", "0", "drain_timeout", 0.0),
        ("operator", "--retry-delay", "0.5", "retry_delay", 0.5),
    ],
)
def test_a_value_at_the_edge_of_its_range_is_taken(
    command: str, flag: str, value: str, attribute: str, parsed: float
) -> None:
    assert getattr(parse(command, flag, value), attribute) == parsed
