"""``herd bench``'s progress line: drawn from the start, counting what was sent, kept moving before any
answer, stopped by close."""

from __future__ import annotations

import io
import time

import pytest

from herd.cli.loadgen.progress import Progress


def drawn(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().split("\r") if line]


def test_the_line_shows_and_ticks_before_the_first_answer() -> None:
    stream = io.StringIO()
    progress = Progress(total=10, duration_s=None, stream=stream)
    try:
        assert drawn(stream) == [f"[{'.' * 30}] 0 sent, 0 done, 0 errors, 0.0 req/s, 0s"]
        progress.sent()
        assert drawn(stream)[-1].startswith(f"[{'.' * 30}] 1 sent, 0 done"), "the first request sent shows"
        deadline = time.monotonic() + 5.0
        while len(drawn(stream)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(drawn(stream)) >= 3, "the ticker did not redraw the line while no request finished"
    finally:
        progress.close()
    assert stream.getvalue().endswith("\n")
    closed = stream.getvalue()
    time.sleep(0.6)  # longer than a tick: nothing more is written once closed
    assert stream.getvalue() == closed


@pytest.mark.parametrize(
    ("total", "duration_s", "num_done", "elapsed", "expected_bar"),
    [
        (10, None, 5, 1.0, "#" * 15 + "." * 15),
        (None, 60.0, 0, 30.0, "#" * 15 + "." * 15),
        (10, 60.0, 2, 30.0, "#" * 15 + "." * 15),
        (None, None, 3, 1.0, "." * 30),
    ],
    ids=["by requests", "by time, before any answer", "the further of the two", "unbounded: no bar"],
)
def test_the_bar_fills_by_requests_or_time(
    total: int | None, duration_s: float | None, num_done: int, elapsed: float, expected_bar: str
) -> None:
    progress = Progress(total=total, duration_s=duration_s, enabled=False)
    for _ in range(num_done):
        progress.update(is_ok=True)
    assert progress.line(time.monotonic() + elapsed).startswith(f"[{expected_bar}] 0 sent, {num_done} done")


def test_a_disabled_line_writes_nothing() -> None:
    stream = io.StringIO()
    progress = Progress(total=10, duration_s=None, stream=stream, enabled=False)
    progress.update(is_ok=False)
    progress.close()
    time.sleep(0.6)  # longer than a tick
    assert stream.getvalue() == ""
