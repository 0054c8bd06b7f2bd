"""Probes and lifecycle handlers: one action (``httpGet``, ``tcpSocket``, ``exec``, ``sleep``) run
against a container, and the thresholds that turn single results into a probe's verdict.

``httpGet`` and ``tcpSocket`` dial the pod's IP (a named port resolved from the container's ports);
``exec`` runs inside the container's mount namespace with its environment (``nsenter``), so it sees
the container's volumes and ``/etc/hosts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["ProbeCounter", "Target", "run_action"]

Object = dict[str, Any]
_OUTPUT_LIMIT = 1024


@dataclass
class ProbeCounter:
    """A probe's verdict from consecutive results: success after ``success_threshold`` in a row,
    failure after ``failure_threshold`` in a row; None until the first verdict."""

    success_threshold: int = 1
    failure_threshold: int = 3
    verdict: bool | None = None
    successes: int = 0
    failures: int = 0

    @classmethod
    def of(cls, probe: Object) -> ProbeCounter:
        return cls(probe.get("successThreshold", 1), probe.get("failureThreshold", 3))

    def observe(self, is_ok: bool) -> bool | None:
        """Count one result; returns the verdict when this result reaches a threshold, else None."""
        self.successes, self.failures = (self.successes + 1, 0) if is_ok else (0, self.failures + 1)
        if is_ok and self.successes >= self.success_threshold:
            self.verdict = True
            return True
        if not is_ok and self.failures >= self.failure_threshold:
            self.verdict = False
            return False
        return None


@dataclass(frozen=True)
class Target:
    """The container an action runs against."""

    pod_ip: str
    ports: Mapping[str, int]
    env: Mapping[str, str]
    cwd: str
    pid: int


def _port(port: int | str, target: Target) -> int:
    if isinstance(port, int) or port.isdigit():
        return int(port)
    if port not in target.ports:
        raise ValueError(f"port {port!r} is not a named port of the container ({sorted(target.ports)})")
    return target.ports[port]


async def run_action(action: Object, target: Target, limit_s: float) -> tuple[bool, str]:
    """Run one probe or handler action; (succeeded, why not). ``limit_s`` bounds it."""
    try:
        async with asyncio.timeout(limit_s):
            if "httpGet" in action:
                return await _http_get(action["httpGet"], target, limit_s)
            if "tcpSocket" in action:
                return await _tcp(action["tcpSocket"], target)
            if "exec" in action:
                return await _exec(action["exec"]["command"], target)
            if "sleep" in action:
                await asyncio.sleep(action["sleep"]["seconds"])
                return True, ""
    except TimeoutError:
        return False, f"timed out after {limit_s:g}s"
    except (OSError, ValueError, httpx.HTTPError) as error:
        return False, f"{type(error).__name__}: {error}"
    return False, f"none of httpGet, tcpSocket, exec, sleep in {sorted(action)}"


async def _http_get(get: Object, target: Target, limit_s: float) -> tuple[bool, str]:
    host = get.get("host") or target.pod_ip
    url = f"{get.get('scheme', 'HTTP').lower()}://{host}:{_port(get['port'], target)}{get.get('path', '/')}"
    headers = {header["name"]: header["value"] for header in get.get("httpHeaders") or []}
    async with httpx.AsyncClient(timeout=limit_s, verify=False, trust_env=False) as client:
        response = await client.get(url, headers={"User-Agent": "kube-probe/1.36", **headers})
    if 200 <= response.status_code < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {response.status_code}"


async def _tcp(socket: Object, target: Target) -> tuple[bool, str]:
    _, writer = await asyncio.open_connection(
        socket.get("host") or target.pod_ip, _port(socket["port"], target)
    )
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, ""


async def _exec(command: list[str], target: Target) -> tuple[bool, str]:
    """``command`` in the container's mount namespace (and user namespace, when it has its own)."""
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        return False, "nsenter is not installed: install util-linux to run exec probes and hooks"
    joins = ["--mount"]
    if os.readlink(f"/proc/{target.pid}/ns/user") != os.readlink("/proc/self/ns/user"):
        joins += ["--user", "--preserve-credentials"]
    argv = [nsenter, f"--target={target.pid}", *joins, f"--wd={target.cwd}", "--", *command]
    process = await asyncio.create_subprocess_exec(
        *argv, env=dict(target.env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        output, _ = await process.communicate()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode == 0:
        return True, ""
    return (
        False,
        f"command {command} exited with {process.returncode}: {output[-_OUTPUT_LIMIT:].decode(errors='replace')}",
    )
