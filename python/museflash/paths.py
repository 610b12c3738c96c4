"""Paths the user typed, shared by every command line and tool (no flags, no museflash
imports, so anything can use it)."""

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
