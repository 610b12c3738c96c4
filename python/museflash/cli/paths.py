"""Path handling shared by the command lines (kept free of absl flags, so any CLI can import
it without defining another CLI's flags)."""

from __future__ import annotations

import os
from pathlib import Path


def resolve_user_path(value: str | None) -> Path | None:
    """`bazel run` starts tools inside the runfiles tree; a relative path means relative to
    where the user typed the command (BUILD_WORKING_DIRECTORY), else the current directory."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    base = os.environ.get("BUILD_WORKING_DIRECTORY") or os.getcwd()
    return Path(base) / path
