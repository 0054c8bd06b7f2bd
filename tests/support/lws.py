"""The LeaderWorkerSet CRD for tests, fetched with the Go toolchain (never vendored into the repo).

``go mod download sigs.k8s.io/lws@VERSION`` brings the module source through the Go module proxy;
its ``config/crd/bases`` holds the CRD that the LWS project installs. The CRD is copied once into
``~/.cache/herd/lws/VERSION``. Only the CRD is installed: no LWS controller runs, so a LeaderWorkerSet
makes no pods; the tests are about what herd's operator writes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

LWS_VERSION = "v0.7.0"
LWS_CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
_CRD_FILE = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
_CACHE = Path.home() / ".cache" / "herd" / "lws"


class LWSUnavailableError(RuntimeError):
    """The CRD could not be fetched (no Go toolchain, or the module proxy is out of reach)."""


def lws_crd(version: str = LWS_VERSION) -> Path:
    """The LeaderWorkerSet CRD of ``version``, fetched into the cache on first use."""
    cached = _CACHE / version / _CRD_FILE
    if cached.is_file():
        return cached
    go = shutil.which("go")
    if go is None:
        raise LWSUnavailableError("no Go toolchain on PATH to fetch sigs.k8s.io/lws (install Go)")
    done = subprocess.run(
        [go, "mod", "download", "-json", f"sigs.k8s.io/lws@{version}"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=Path.home(),  # outside any Go module: a plain download
    )
    if done.returncode != 0:
        raise LWSUnavailableError(
            f"go mod download sigs.k8s.io/lws@{version} failed: {done.stdout}{done.stderr}"
        )
    source = Path(json.loads(done.stdout)["Dir"]) / "config" / "crd" / "bases" / _CRD_FILE
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, cached)
    return cached
