"""The Dockerfiles (no Docker engine runs here) pin their bases, run as non-root and install this repo."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCKERFILES = {
    name: REPO / "docker" / f"{name}.Dockerfile" for name in ("operator", "orchestrator", "worker")
}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(maxsplit=1)[0].upper(), line.split(maxsplit=1)[1]) for line in lines]


def _base_images(path: Path) -> list[str]:
    args = dict(
        re.match(r"(\w+)=(\S+)", arguments).groups()  # type: ignore[union-attr]
        for instruction, arguments in _instructions(path)
        if instruction == "ARG" and "=" in arguments
    )
    images = [arguments.split()[0] for instruction, arguments in _instructions(path) if instruction == "FROM"]
    return [re.sub(r"\$\{(\w+)\}", lambda match: args[match.group(1)], image) for image in images]


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_base_images_are_pinned_to_a_patch_release(path: Path) -> None:
    for image in _base_images(path):
        _, _, tag = image.partition(":")
        assert re.match(r"\d+\.\d+\.\d+-", tag), f"{path.name}: {image} is not pinned to a patch release"


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_the_final_stage_runs_as_a_numeric_non_root_user(path: Path) -> None:
    users = [arguments for instruction, arguments in _instructions(path) if instruction == "USER"]
    assert users, f"{path.name} never drops root"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) > 0, "Kubernetes can verify runAsNonRoot only for a numeric user"


@pytest.mark.parametrize("path", DOCKERFILES.values(), ids=DOCKERFILES.keys())
def test_every_copied_path_exists_and_the_repo_is_pip_installed(path: Path) -> None:
    instructions = _instructions(path)
    for instruction, arguments in instructions:
        if instruction == "COPY" and not arguments.startswith("--from"):
            for source in arguments.split()[:-1]:
                assert (REPO / source).exists(), f"{path.name}: COPY {source} is not in the repository"
    runs = " ".join(arguments for instruction, arguments in instructions if instruction == "RUN")
    assert re.search(r"pip install (--no-deps )?\.( |$)", runs), f"{path.name} does not pip install the repo"
    assert ("ENTRYPOINT", '["herd"]') in instructions


def test_control_plane_requirements_leave_torch_out_and_keep_the_rest() -> None:
    result = subprocess.run(
        [sys.executable, "docker/requirements.py", "--without", "torch"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = [line for line in dependencies if re.match(r"torch\b", line)]
    assert torch, "pyproject.toml no longer depends on torch"
    assert result.stdout.split() == [line for line in dependencies if line not in torch]
