"""One container of a pod: started through the sandbox launcher, probed, restarted per the pod's
restartPolicy, stopped by its pid.

Restarts back off 1 s, doubling to 10 s (a kubelet's back-off runs from 10 s to 5 minutes: tests
want a crash-looping container to come back quickly). A container stops the kubelet's way: its
preStop handler, SIGTERM, then SIGKILL when the grace period runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from support.node.addresses import bind_pod_ip
from support.node.env import ConfigError, container_argv, container_env, referenced_sources
from support.node.probes import ProbeCounter, Target, run_action
from support.node.sandbox import EXIT_SANDBOX_FAILED, spec_for
from support.node.status import ContainerRecord, now, terminated, waiting
from support.node.volumes import mounts_for

__all__ = ["ContainerRunner", "PodContext", "should_restart"]

Object = dict[str, Any]
_log = logging.getLogger("herd.node.containers")
BACKOFF_S = (1.0, 10.0)
_CONFIG_RETRY_S = 1.0


class SourceFetcher(Protocol):
    async def __call__(self, kind: str, name: str) -> dict[str, str] | None: ...


@dataclass
class PodContext:
    """What the containers of one pod share: the pod, its IP, folder, volumes and reporting hooks."""

    pod: Object
    pod_ip: str
    folder: Path
    hosts: Path
    image_root: Path
    base_env: dict[str, str]
    launcher_env: dict[str, str]
    entrypoints: Mapping[str, list[str]] = field(default_factory=dict)
    """Image repository -> its entrypoint, for containers that give only ``args``."""
    volumes: dict[str, Path] = field(default_factory=dict)
    fetch: SourceFetcher | None = None
    changed: Callable[[], None] = lambda: None
    event: Callable[[str, str, str, str], Awaitable[None]] | None = None

    @property
    def grace_s(self) -> float:
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    async def report(self, kind: str, reason: str, message: str, container: str) -> None:
        if self.event is not None:
            await self.event(kind, reason, message, container)


def should_restart(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


class ContainerRunner:
    """Runs ``spec`` until it is done (by its pod's restartPolicy) or stopped."""

    def __init__(self, ctx: PodContext, spec: Object, *, is_init: bool = False) -> None:
        self.ctx, self.spec, self.is_init = ctx, spec, is_init
        self.record = ContainerRecord(spec["name"], spec.get("image", ""))
        self.process: subprocess.Popen[bytes] | None = None
        self.target: Target | None = None
        self.is_stopping = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def policy(self) -> str:
        """Init containers restart on failure unless the pod never restarts anything."""
        policy = str(self.ctx.pod["spec"].get("restartPolicy", "Always"))
        return ("Never" if policy == "Never" else "OnFailure") if self.is_init else policy

    async def run(self) -> int:
        """Start, wait, restart as the policy says; returns the last exit code (or -1 when stopped)."""
        backoff = BACKOFF_S[0]
        while not self.is_stopping:
            exit_code = await self._run_once()
            if exit_code is None:  # its configuration is missing: try again shortly
                await asyncio.sleep(_CONFIG_RETRY_S)
                continue
            if self.is_stopping or not should_restart(self.policy, exit_code):
                return exit_code
            message = f"back-off {backoff:g}s restarting failed container={self.name} pod={self.ctx.pod['metadata']['name']}"  # fmt: skip
            self.record.state = waiting("CrashLoopBackOff", message)
            self.ctx.changed()
            await self.ctx.report("Warning", "BackOff", "Back-off restarting failed container", self.name)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_S[1])
            self.record.restart_count += 1
        return -1

    async def _run_once(self) -> int | None:
        """One start of the container until it exits; None when it could not be configured."""
        launched = await self._launch()
        if launched is None:
            return None
        process, started_at = launched
        if "terminated" in self.record.state:  # the sandbox failed: StartError
            return await _wait_exit(process)
        watched = [asyncio.ensure_future(_wait_exit(process)), asyncio.ensure_future(self._probe())]
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        if watched[1] in done and watched[1].result():  # unhealthy: restarted like a kubelet does
            await self.stop(self.ctx.grace_s, is_restart=True)
        exit_code = await watched[0]
        watched[1].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watched[1]
        self.record.ready = self.record.started = False
        self.record.pid, self.process = None, None
        self.record.state = terminated(exit_code, started_at)
        self.ctx.changed()
        return exit_code

    def _env(self, sources: dict[tuple[str, str], dict[str, str] | None]) -> dict[str, str]:
        pod = {**self.ctx.pod, "status": {**(self.ctx.pod.get("status") or {}), "podIP": self.ctx.pod_ip,
                                          "hostIP": "127.0.0.1", "podIPs": [{"ip": self.ctx.pod_ip}]}}  # fmt: skip
        return container_env(pod, self.spec, sources, self.ctx.base_env)

    async def _resolve(self) -> tuple[list[str], dict[str, str]]:
        """The command line and the environment; raises ConfigError when either cannot be made."""
        fetch = self.ctx.fetch
        sources = {ref: (await fetch(*ref) if fetch else None) for ref in referenced_sources(self.spec)}
        env = self._env(sources)
        argv = container_argv(self.spec, env, self.ctx.entrypoints)
        return bind_pod_ip(argv, self.ctx.pod_ip), env

    async def _configure(self) -> tuple[list[str], dict[str, str]] | None:
        """The command line and environment; None (and the reason shown, once) when they cannot be made."""
        try:
            return await self._resolve()
        except ConfigError as error:
            was = self.record.state.get("waiting", {}).get("message")
            self.record.state = waiting("CreateContainerConfigError", str(error))
            if was != str(error):
                self.ctx.changed()
                await self.ctx.report("Warning", "Failed", f"Error: {error}", self.name)
            return None

    async def _launch(self) -> tuple[subprocess.Popen[bytes], str] | None:
        """The container's process and its start time; None when it could not be configured (a
        sandbox that failed leaves the state terminated with StartError)."""
        configured = await self._configure()
        if configured is None:
            return None
        argv, env = configured
        cwd = self.spec.get("workingDir") or str(self.ctx.image_root)
        image = [str(self.ctx.image_root), sys.prefix]  # the agent runs on the venv its pods use
        spec = spec_for(argv, env, cwd, mounts_for(self.spec, self.ctx.volumes), str(self.ctx.hosts), image)
        process, failure = await self._spawn(spec)
        started_at = now()
        self.target = Target(self.ctx.pod_ip, _named_ports(self.spec), env, cwd, process.pid)
        if failure:
            self.record.state = terminated(
                EXIT_SANDBOX_FAILED, started_at, reason="StartError", message=failure
            )
            event = ("Warning", "Failed", f"Error: {failure}")
        else:
            self.record.state, self.record.pid = {"running": {"startedAt": started_at}}, process.pid
            self.record.started = "startupProbe" not in self.spec
            self.record.ready = self.record.started and "readinessProbe" not in self.spec
            event = ("Normal", "Started", f"Started container {self.name}")
        self.ctx.changed()  # the status first: the Event can wait
        await self.ctx.report(*event, self.name)
        return process, started_at

    async def _spawn(self, spec: Object) -> tuple[subprocess.Popen[bytes], str]:
        """The launcher with ``spec``; (process, why the sandbox failed, or "" once the command runs)."""
        spec_path = self.ctx.folder / f"{self.name}.sandbox.json"
        spec_path.write_text(json.dumps(spec))
        read_end, write_end = os.pipe()
        argv = [sys.executable, "-m", "support.node.sandbox", str(spec_path), str(write_end)]
        with (self.ctx.folder / f"{self.name}.log").open("ab") as log:
            # A fork and exec, quick: the wait for the process is on a pidfd, never blocking.
            self.process = subprocess.Popen(  # noqa: ASYNC220
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(write_end,),
                env=self.ctx.launcher_env,
            )  # fmt: skip
        os.close(write_end)
        try:
            error = await asyncio.get_running_loop().run_in_executor(None, _read_all, read_end)
        finally:
            os.close(read_end)
        return self.process, error.decode(errors="replace")

    async def _probe(self) -> bool:
        """Probes the running container; returns True when it must be restarted (startup or
        liveness probe failed), never otherwise."""
        startup = self.spec.get("startupProbe")
        if startup and not await self._until_verdict(startup, "Startup", stop_on=True):
            return True
        self.record.started = True
        readiness = self.spec.get("readinessProbe")
        self.record.ready = readiness is None
        self.ctx.changed()
        tasks = [asyncio.ensure_future(self._readiness(readiness))] if readiness else []
        try:
            liveness = self.spec.get("livenessProbe")
            if liveness is None:
                await asyncio.Event().wait()  # probes run until the container exits
                return False
            return not await self._until_verdict(liveness, "Liveness", stop_on=False)
        finally:
            for task in tasks:
                task.cancel()

    async def _readiness(self, probe: Object) -> None:
        async def set_ready(verdict: bool) -> bool:
            if self.record.ready != verdict:
                self.record.ready = verdict
                self.ctx.changed()
            return False

        await self._probe_loop(probe, "Readiness", set_ready)

    async def _until_verdict(self, probe: Object, kind: str, *, stop_on: bool) -> bool:
        """Probe until ``probe`` reaches a verdict ``stop_on`` or its opposite; returns the verdict
        that ended it (startup: the first verdict; liveness: only a failure ends it)."""
        verdicts: list[bool] = []

        async def decide(verdict: bool) -> bool:
            verdicts.append(verdict)
            return stop_on or not verdict

        await self._probe_loop(probe, kind, decide)
        return verdicts[-1]

    async def _probe_loop(
        self, probe: Object, kind: str, on_verdict: Callable[[bool], Awaitable[bool]]
    ) -> None:
        counter = ProbeCounter.of(probe)
        await asyncio.sleep(probe.get("initialDelaySeconds", 0))
        while True:
            assert self.target is not None
            is_ok, why = await run_action(probe, self.target, float(probe.get("timeoutSeconds", 1)))
            if not is_ok:
                await self.ctx.report("Warning", "Unhealthy", f"{kind} probe failed: {why}", self.name)
            verdict = counter.observe(is_ok)
            if verdict is not None and await on_verdict(verdict):
                if not verdict:
                    message = f"Container {self.name} failed {kind.lower()} probe, will be restarted"
                    await self.ctx.report("Normal", "Killing", message, self.name)
                return
            await asyncio.sleep(probe.get("periodSeconds", 10))

    async def stop(self, grace_s: float, *, is_restart: bool = False) -> None:
        """preStop, SIGTERM, SIGKILL after ``grace_s``; a pod's stop (not a restart) also ends :meth:`run`."""
        self.is_stopping = self.is_stopping or not is_restart
        deadline = time.monotonic() + grace_s
        process = self.process
        if process is not None and process.poll() is None:
            pre_stop = (self.spec.get("lifecycle") or {}).get("preStop")
            if pre_stop and self.target is not None:
                is_ok, why = await run_action(pre_stop, self.target, max(grace_s, 0.1))
                if not is_ok:
                    await self.ctx.report(
                        "Warning", "FailedPreStopHook", f"PreStopHook failed: {why}", self.name
                    )
            await _terminate(process, max(deadline - time.monotonic(), 0.0))

    async def kill(self) -> None:
        """At once (the pod is gone from the apiserver): SIGKILL, reaped."""
        self.is_stopping = True
        if self.process is not None:
            await _terminate(self.process, 0.0)


def _named_ports(spec: Object) -> dict[str, int]:
    return {port["name"]: int(port["containerPort"]) for port in spec.get("ports") or [] if port.get("name")}


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


async def _terminate(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM by pid, SIGKILL after ``grace_s`` (at once when 0), then reaped."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s if grace_s > 0 else None):
            await _wait_exit(process)
            return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    await _wait_exit(process)


async def _wait_exit(process: subprocess.Popen[bytes]) -> int:
    """The exit code once ``process`` ends (128 + the signal that killed it), awaited on a pidfd."""
    if process.poll() is None:
        loop, fd = asyncio.get_running_loop(), os.pidfd_open(process.pid)
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    code = process.wait()
    return 128 - code if code < 0 else code
