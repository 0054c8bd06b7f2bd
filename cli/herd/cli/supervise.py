"""Supervision of ``herd up``'s child processes, as the kubelet restarts a pod's containers.

A child that exits while herd up runs is started again with the same command line (so a worker keeps
its ports and the orchestrator finds it again; a fresh process means a fresh KV event epoch). Restarts
back off exponentially (``BackoffPolicy``: 1 s doubling to 30 s, CrashLoopBackOff's shape with shorter
steps), and a child that stayed up for ``stable_after_s`` starts again from the shortest delay. Each
restart is one JSON log line naming the process, how it ended, the attempt and the delay. Children are
stopped by their own pids, and never restarted once stopping has begun. A child can be parked (stopped
on purpose, as a pool scaled to zero: SIGTERM, SIGKILL after the grace period, never restarted) and
started again later with the same command line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BackoffPolicy", "Child", "ChildSpec", "Supervisor", "describe_exit"]

log = logging.getLogger("herd.up")


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """How long to wait before restarting a child, given how often it has failed in a row."""

    initial_s: float = 1.0
    cap_s: float = 30.0
    stable_after_s: float = 60.0
    """A child up at least this long failed for a new reason: its next restart is attempt 1 again."""

    def next_attempt(self, previous_attempt: int, uptime_s: float) -> int:
        """The attempt number of the coming restart (1 for the first restart of a stable child)."""
        return 1 if uptime_s >= self.stable_after_s else previous_attempt + 1

    def delay_s(self, attempt: int) -> float:
        """``initial_s`` doubled per earlier attempt, never more than ``cap_s``."""
        # The exponent is bounded first: a long crash loop must not overflow the float.
        return min(self.cap_s, self.initial_s * 2.0 ** min(attempt - 1, 62))


def describe_exit(returncode: int) -> dict[str, int | str]:
    """How a child ended, for a log line: its exit code, or the signal that killed it."""
    if returncode >= 0:
        return {"exit_code": returncode}
    try:
        return {"signal": signal.Signals(-returncode).name}
    except ValueError:
        return {"signal": str(-returncode)}


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One process to keep running: its name, command line and environment, and where its output goes."""

    name: str
    kind: str
    """What it is (``worker``, ``orchestrator``): with ``url``, what the "started process" line names."""
    url: str
    argv: tuple[str, ...]
    env: dict[str, str]
    log_path: Path | None = None
    """``None``: the child writes to herd up's own stdout and stderr."""


class Child:
    """A ``ChildSpec``'s current process, its restart count and when its next start is due."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.attempt = 0
        self.restart_at: float | None = None
        self.kill_at: float | None = None
        """Parked: when a process that ignored SIGTERM gets SIGKILL; ``None`` while it runs."""

    @property
    def is_parked(self) -> bool:
        return self.kill_at is not None

    def start(self) -> None:
        env = {**os.environ, **self.spec.env}
        if self.spec.log_path is None:
            self.process = subprocess.Popen(self.spec.argv, env=env)
        else:
            # Appended: the output of the run that crashed stays readable after the restart.
            with self.spec.log_path.open("ab") as sink:
                self.process = subprocess.Popen(
                    self.spec.argv, stdout=sink, stderr=subprocess.STDOUT, env=env
                )
        self.started_at, self.restart_at, self.kill_at = time.monotonic(), None, None
        spec = self.spec
        fields: dict[str, object] = {
            "process_name": spec.name,
            "kind": spec.kind,
            "pid": self.process.pid,
            "url": spec.url,
        }
        if self.spec.log_path is not None:
            fields["log"] = str(self.spec.log_path)
        log.info("started process", extra=fields)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()


class Supervisor:
    """Starts children, restarts those that exit (with ``policy``'s backoff), stops them all by pid."""

    def __init__(self, policy: BackoffPolicy) -> None:
        self.policy = policy
        self.children: list[Child] = []
        self.is_stopping = False

    def start(self, spec: ChildSpec) -> Child:
        child = Child(spec)
        self.children.append(child)
        child.start()
        return child

    def step(self) -> None:
        """One pass: schedule a restart for each child that has exited, start those that are due."""
        if self.is_stopping:
            return
        now = time.monotonic()
        for child in self.children:
            if child.kill_at is not None:
                if now >= child.kill_at and child.process is not None and child.exit_code() is None:
                    log.warning(
                        "parked process did not stop in time; killing it", extra={"pid": child.process.pid}
                    )
                    child.process.kill()
            elif child.restart_at is None and (code := child.exit_code()) is not None:
                self._schedule(child, code, now)
            elif child.restart_at is not None and now >= child.restart_at:
                child.start()

    def _schedule(self, child: Child, code: int, now: float) -> None:
        child.attempt = self.policy.next_attempt(child.attempt, now - child.started_at)
        delay = self.policy.delay_s(child.attempt)
        child.restart_at = now + delay
        fields = {
            "process_name": child.spec.name,
            **describe_exit(code),
            "attempt": child.attempt,
            "delay_s": delay,
        }
        log.warning("process exited; restarting it", extra=fields)

    def park(self, child: Child, grace_s: float = 10.0) -> None:
        """Stop ``child`` on purpose: SIGTERM now, SIGKILL after ``grace_s``, and no restart."""
        child.kill_at, child.restart_at = time.monotonic() + grace_s, None
        if child.process is not None and child.exit_code() is None:
            child.process.send_signal(signal.SIGTERM)

    def unpark(self, child: Child) -> None:
        """Start a parked child again (once its last process has exited), attempts counted afresh."""
        if child.process is not None and child.exit_code() is None:
            child.process.kill()  # still draining: the pool is wanted now
            child.process.wait(timeout=10)
        child.attempt = 0
        child.start()

    def run_forever(self, interval_s: float = 0.2, tick: Callable[[], None] | None = None) -> None:
        """``step`` (then ``tick``) until interrupted (Ctrl-C, or SIGTERM turned into
        ``KeyboardInterrupt``)."""
        while True:
            time.sleep(interval_s)
            self.step()
            if tick is not None:
                tick()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every running child by pid, then SIGKILL those still running after ``grace_s``.

        From here on ``step`` restarts nothing: the children's exits are the shutdown, not crashes.
        """
        self.is_stopping = True
        running = [child.process for child in self.children if child.exit_code() is None]
        _stop([process for process in running if process is not None], grace_s)


def _stop(processes: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("process did not stop in time; killing it", extra={"pid": process.pid})
            process.kill()
            process.wait(timeout=grace_s)
