"""Output files of ``herd bench`` commands, checked before a run so that a long run never ends unable
to write its result."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["cannot_write", "check_writable"]

_FIX = "choose a file in a writable folder"


def check_writable(path: Path, option: str) -> None:
    """Raise ``ValueError`` naming ``option`` unless ``path`` can be written, its missing folders made.

    Nothing is left behind: an existing file is opened for appending, otherwise a nameless temporary
    file is made in the nearest folder that exists. A real write is tried because permission bits
    lie to root and on read-only mounts.
    """
    if os.path.isdir(path):
        raise ValueError(f"{option} {path} is a directory: name a file in it, such as {path / 'out.json'}")
    if os.path.lexists(path):
        try:
            with path.open("a"):
                pass
        except OSError as error:
            raise cannot_write(path, option, error) from None
        return
    folder = next(parent for parent in path.absolute().parents if os.path.lexists(parent))
    if not os.path.isdir(folder):
        raise ValueError(f"{option} {path}: {folder} is a file, not a folder: {_FIX}")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(
            f"{option} {path}: cannot create files in {folder} ({error.strerror}): {_FIX}"
        ) from None


def cannot_write(path: Path, option: str, error: OSError) -> ValueError:
    """The error for an output file that could not be written."""
    return ValueError(f"{option} {path}: cannot write it ({error.strerror or error}): {_FIX}")
