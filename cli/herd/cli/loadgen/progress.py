"""A one-line progress bar on stderr, redrawn at most ten times a second (no dependencies).

It counts requests sent as well as answered, is drawn from the start, and a ticker thread redraws it
every half second, so a run whose first answers take long still shows what it sent and its clock (and,
for a timed run, its bar) moving; ``close`` stops the ticker.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 30
_REDRAW_S = 0.1
_TICK_S = 0.5


class Progress:
    """Counts sent and finished requests; the bar fills by finished against ``total`` requests or by
    time against ``duration_s`` seconds."""

    def __init__(
        self,
        *,
        total: int | None,
        duration_s: float | None,
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.total = total
        self.duration_s = duration_s
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.num_sent = 0
        self.num_done = 0
        self.num_errors = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._lock = threading.Lock()  # the ticker and the run's updates write the same line
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="herd-bench-progress", daemon=True)
        if enabled:
            self._draw(self._start)
            self._ticker.start()

    def sent(self) -> None:
        self.num_sent += 1
        self._maybe_draw()

    def update(self, *, is_ok: bool) -> None:
        self.num_done += 1
        self.num_errors += not is_ok
        self._maybe_draw()

    def _maybe_draw(self) -> None:
        now = time.monotonic()
        if now - self._last_draw >= _REDRAW_S:
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._stopped.set()
            self._ticker.join(timeout=2 * _TICK_S)
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = now - self._start
        fraction = self._fraction(elapsed)
        filled = round(fraction * _WIDTH)
        rate = self.num_done / elapsed if elapsed > 0 else 0.0
        bar = "#" * filled + "." * (_WIDTH - filled)
        counts = f"{self.num_sent} sent, {self.num_done} done, {self.num_errors} errors"
        return f"[{bar}] {counts}, {rate:.1f} req/s, {elapsed:.0f}s"

    def _fraction(self, elapsed: float) -> float:
        fractions = []
        if self.total:
            fractions.append(self.num_done / self.total)
        if self.duration_s:
            fractions.append(elapsed / self.duration_s)
        return min(1.0, max(fractions, default=0.0))

    def _tick(self) -> None:
        while not self._stopped.wait(_TICK_S):
            self._draw(time.monotonic())

    def _draw(self, now: float) -> None:
        if self.enabled:
            with self._lock:
                self.stream.write("\r" + self.line(now))
                self.stream.flush()
