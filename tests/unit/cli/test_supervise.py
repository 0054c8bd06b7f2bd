"""herd up's supervision: the backoff rule, how an exit is described, and restarts of real processes."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import wait_until

from herd.cli.supervise import BackoffPolicy, ChildSpec, Supervisor, describe_exit

POLICY = BackoffPolicy(initial_s=1.0, cap_s=30.0, stable_after_s=60.0)


@pytest.mark.parametrize(
    ("attempt", "delay_s"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (5, 16.0), (6, 30.0), (7, 30.0), (10_000, 30.0)],
    ids=["first", "second", "third", "fifth", "capped", "past-cap", "long-crash-loop"],
)
def test_delay_doubles_up_to_the_cap(attempt: int, delay_s: float) -> None:
    assert POLICY.delay_s(attempt) == delay_s


@pytest.mark.parametrize(
    ("previous", "uptime_s", "expected"),
    [(0, 0.5, 1), (3, 5.0, 4), (5, 59.9, 6), (5, 60.0, 1), (9, 3600.0, 1)],
    ids=["first-crash", "crash-loop", "just-short-of-stable", "stable-resets", "long-run-resets"],
)
def test_a_child_that_stayed_up_starts_over(previous: int, uptime_s: float, expected: int) -> None:
    assert POLICY.next_attempt(previous, uptime_s) == expected


@pytest.mark.parametrize(
    ("returncode", "expected"),
    [(0, {"exit_code": 0}), (3, {"exit_code": 3}), (-9, {"signal": "SIGKILL"}), (-15, {"signal": "SIGTERM"})],
    ids=["clean", "error", "kill-9", "sigterm"],
)
def test_describe_exit(returncode: int, expected: dict[str, object]) -> None:
    assert describe_exit(returncode) == expected


def spec(tmp_path: Path, code: str) -> ChildSpec:
    argv = (sys.executable, "-c", code)
    return ChildSpec("child", "test", "http://127.0.0.1:1", argv, {}, tmp_path / "child.log")


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    supervisor = Supervisor(BackoffPolicy(initial_s=0.05, cap_s=0.2, stable_after_s=60.0))
    yield supervisor
    supervisor.stop_all(grace_s=5.0)


def test_a_crashing_child_is_restarted_with_growing_delays(
    supervisor: Supervisor, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="herd.up")
    child = supervisor.start(spec(tmp_path, "import sys; print('run', flush=True); sys.exit(3)"))

    def restarts() -> list[logging.LogRecord]:
        supervisor.step()
        return [record for record in caplog.records if record.msg == "process exited; restarting it"]

    wait_until(lambda: len(restarts()) >= 3, timeout=30, what="three restarts")
    first, second, third = restarts()[:3]
    assert [(r.attempt, r.delay_s, r.exit_code) for r in (first, second, third)] == [  # type: ignore[attr-defined]
        (1, 0.05, 3),
        (2, 0.1, 3),
        (3, 0.2, 3),
    ]
    assert first.process_name == "child"  # type: ignore[attr-defined]
    assert child.spec.log_path is not None and child.spec.log_path.read_text().count("run") >= 3


def test_a_killed_child_comes_back_as_a_new_process(supervisor: Supervisor, tmp_path: Path) -> None:
    child = supervisor.start(spec(tmp_path, "import time; time.sleep(60)"))
    assert child.process is not None
    first_pid = child.process.pid
    child.process.kill()

    def restarted() -> bool:
        supervisor.step()
        return child.process is not None and child.process.pid != first_pid and child.exit_code() is None

    wait_until(restarted, timeout=30, what="the killed child running again")


def test_stop_all_stops_every_child_by_pid_and_restarts_none(supervisor: Supervisor, tmp_path: Path) -> None:
    children = [supervisor.start(spec(tmp_path, "import time; time.sleep(60)")) for _ in range(2)]
    pids = [child.process.pid for child in children if child.process is not None]
    supervisor.stop_all(grace_s=5.0)
    supervisor.step()
    assert [child.exit_code() for child in children] == [-15, -15]
    assert [child.process.pid for child in children if child.process is not None] == pids


def test_a_parked_child_stays_stopped_until_it_is_started_again(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    child = supervisor.start(spec(tmp_path, "import time; time.sleep(60)"))
    supervisor.park(child)
    assert child.process is not None and child.process.wait(timeout=10) == -15
    for _ in range(5):  # past the restart delay: a parked child is not restarted
        supervisor.step()
        time.sleep(0.1)
    assert child.is_parked and child.exit_code() == -15
    supervisor.unpark(child)
    assert not child.is_parked and child.exit_code() is None


def test_a_parked_child_that_ignores_sigterm_is_killed_after_the_grace(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    ignoring = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    child = supervisor.start(spec(tmp_path, ignoring))
    assert child.spec.log_path is not None
    wait_until(lambda: "up" in child.spec.log_path.read_text(), timeout=30, what="the handler installed")  # type: ignore[union-attr]
    supervisor.park(child, grace_s=0.2)

    def killed() -> bool:
        supervisor.step()
        return child.exit_code() == -9

    wait_until(killed, timeout=30, what="SIGKILL after the grace period")
