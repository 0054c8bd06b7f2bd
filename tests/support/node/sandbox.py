"""The launcher of one container: ``python -m support.node.sandbox <spec.json> <status-fd>``.

It enters a private mount namespace (``unshare(CLONE_NEWNS)``; as a non-root user whom that is
refused, a user namespace too, mapping the user to root inside), makes every mount private so that
nothing leaks to the host, bind-mounts the pod's volumes at their mount paths (``readOnly`` remounted
read-only; the mount point created when missing) and the pod's own ``/etc/hosts``, asks the kernel
to SIGKILL it when the agent dies (``PR_SET_PDEATHSIG``), changes to the working directory and
``execvpe``s the container's command: the pid the agent holds becomes the container's own.

Whatever stops the container from starting is written to ``status-fd`` (closed on exec, so the agent
reads end-of-file on success) and the launcher exits 128.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

__all__ = ["SandboxError", "main", "spec_for"]

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
EXIT_SANDBOX_FAILED = 128

_libc = ctypes.CDLL(None, use_errno=True)


class SandboxError(Exception):
    """The sandbox could not be made; the message says what failed and what to do."""


def spec_for(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    mounts: list[dict[str, Any]],
    hosts: str,
    image: list[str],
) -> dict[str, Any]:
    """The launcher's spec: ``mounts`` are ``{source, target, readOnly}``; ``hosts`` the pod's hosts
    file; ``image`` the folders that stand for the image's files (the image root, the venv)."""
    return {"argv": argv, "env": env, "cwd": cwd, "mounts": mounts, "hosts": hosts, "image": image}


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise SandboxError(f"{what}: {os.strerror(errno)} (errno {errno})")


def _enter_namespace() -> None:
    if _libc.unshare(CLONE_NEWNS) == 0:
        return
    if ctypes.get_errno() != 1 or os.getuid() == 0:  # EPERM as a non-root user: try a user namespace
        _check(-1, "unshare(CLONE_NEWNS)")
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")


def _mount(source: str | None, target: str, flags: int) -> None:
    _check(
        _libc.mount(source and source.encode(), target.encode(), None, flags, None),
        f"mount {source or ''} at {target} (flags {flags:#x})",
    )


def _bind(source: int, target: str, *, read_only: bool) -> None:
    """Bind the file or directory open as ``source`` (an ``O_PATH`` descriptor) at ``target``,
    creating the mount point (a directory, or an empty file for a file) when it is missing."""
    path, origin = Path(target), f"/proc/self/fd/{source}"
    if os.path.isdir(origin):
        path.mkdir(parents=True, exist_ok=True)
    elif not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    _mount(origin, target, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY)


def _binds(spec: dict[str, Any]) -> list[tuple[int, str, bool]]:
    """Every bind as (source descriptor, target, read-only), parents before children as a kubelet
    mounts them. The sources are opened before the first mount: a volume mounted at ``/tmp`` would
    otherwise hide the next one's source when the pod folders lie under ``/tmp``."""
    mounts = sorted(spec["mounts"], key=lambda mount: Path(mount["target"]).parts)
    binds = [(mount["source"], mount["target"], bool(mount.get("readOnly"))) for mount in mounts]
    binds.append((spec["hosts"], "/etc/hosts", False))
    return [(os.open(source, os.O_PATH | os.O_CLOEXEC), target, ro) for source, target, ro in binds]


def _image_binds(spec: dict[str, Any]) -> list[tuple[int, str, bool]]:
    """The image's folders, to bind back where a volume hid them: a real image's files lie under its
    volumes' mount points, but here the image is this machine's filesystem, and a volume at ``/tmp``
    (the chart's) would hide a checkout and its venv under ``/tmp`` (a CI clone's)."""
    return [(os.open(path, os.O_PATH | os.O_CLOEXEC), path, False) for path in spec["image"]]


def _is_hidden(source: int, target: str) -> bool:
    try:
        seen, kept = os.stat(target), os.fstat(source)
    except OSError:
        return True
    return (seen.st_dev, seen.st_ino) != (kept.st_dev, kept.st_ino)


def _prepare(spec: dict[str, Any]) -> None:
    try:
        _enter_namespace()
        _mount(None, "/", MS_REC | MS_PRIVATE)
        # Opened inside the namespace (a bind's source must be one of its mounts), before any mount.
        binds, image = _binds(spec), _image_binds(spec)
        for source, target, read_only in binds:
            _bind(source, target, read_only=read_only)
            os.close(source)
        for source, target, _ in image:
            if _is_hidden(source, target):
                _bind(source, target, read_only=False)
            os.close(source)
        _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    except (OSError, SandboxError) as error:
        raise SandboxError(
            f"cannot make the container's sandbox: {error}; the node agent needs to create mount "
            "namespaces (run it as root, or where unprivileged user namespaces are allowed)"
        ) from None
    try:
        os.chdir(spec["cwd"])
    except OSError as error:
        raise SandboxError(
            f"working directory {spec['cwd']}: {error.strerror}; pods share this machine's filesystem, "
            "so a volume mounted over a parent of it hides it: mount the volume elsewhere"
        ) from None


def main(argv: list[str]) -> None:
    spec_path, status_fd = argv[0], int(argv[1])
    spec = json.loads(Path(spec_path).read_text())
    os.set_inheritable(status_fd, False)
    try:
        _prepare(spec)
        if os.getppid() == 1:  # the agent died before PR_SET_PDEATHSIG took hold
            os._exit(EXIT_SANDBOX_FAILED)
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except (OSError, SandboxError) as error:
        message = str(error) if isinstance(error, SandboxError) else f"exec {spec['argv'][0]!r}: {error}"
        os.write(status_fd, message.encode())
        os._exit(EXIT_SANDBOX_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
