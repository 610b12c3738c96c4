"""Publish an output directory all at once, or not at all.

Exports take minutes and write several packages. A crash, an exception or Ctrl-C half-way must
leave the destination exactly as it was, so everything is built in a staging directory beside
the destination (same filesystem, so the final rename is atomic) and swapped in at the end,
after every file and directory in it has been flushed to disk (`sync_tree`): a crash after the
swap cannot leave a bundle whose name is published but whose weights are not on disk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


class OutputDirError(ValueError):
    """The destination cannot be used; the message names the path and the fix."""


def check_destination(destination: Path, overwrite: bool) -> None:
    """Fails before any work if publishing to `destination` could not succeed."""
    destination = Path(destination)
    if destination.exists() and not destination.is_dir():
        raise OutputDirError(
            f"output path {destination} exists and is not a directory; "
            "choose another output directory or remove that file"
        )
    if destination.is_dir() and any(destination.iterdir()) and not overwrite:
        raise OutputDirError(
            f"output directory {destination} is not empty; pass --overwrite to replace it "
            "or choose another output directory"
        )
    parent = destination.absolute().parent
    if not parent.is_dir():
        raise OutputDirError(
            f"the parent of the output directory, {parent}, does not exist; create it first"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputDirError(
            f"cannot write in {parent} (needed to stage and rename the output); "
            "choose a writable output directory"
        )


def make_readable_by_all(root: Path) -> None:
    """Some writers (coremltools among them) create files 0600; exported bundles are shared."""
    for path in [root, *Path(root).rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        extra = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
        if path.is_dir():
            extra |= stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
        path.chmod(mode | extra)


def sync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (directories last, so their entries are
    flushed after what they name)."""
    paths = [p for p in Path(root).rglob("*") if not p.is_symlink()]
    for path in [p for p in paths if p.is_file()] + sorted(
            [p for p in paths if p.is_dir()] + [Path(root)], key=lambda p: -len(p.parts)):
        _sync(path)


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def publish_directory(destination: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yields an empty staging directory; on normal exit it replaces `destination`.

    On any exception (KeyboardInterrupt included) the staging directory is removed and the
    destination is untouched.
    """
    with publish_directories([destination], overwrite) as (staging,):
        yield staging


@contextlib.contextmanager
def publish_directories(destinations: list[Path], overwrite: bool = False
                        ) -> Iterator[list[Path]]:
    """`publish_directory` for several destinations at once: one staging directory each, and
    none is swapped in until every one is complete and every destination checked again."""
    destinations = [Path(d).absolute() for d in destinations]
    for destination in destinations:
        check_destination(destination, overwrite)
    stagings: list[Path] = []
    try:
        for destination in destinations:
            stagings.append(Path(tempfile.mkdtemp(prefix=f".{destination.name}.staging-",
                                                  dir=destination.parent)))
        yield list(stagings)
        for staging in stagings:
            make_readable_by_all(staging)
            sync_tree(staging)
        # Checked again: a destination may have appeared while the export ran.
        for destination in destinations:
            check_destination(destination, overwrite)
        for staging, destination in zip(stagings, destinations, strict=True):
            _swap_in(staging, destination, overwrite)
            _sync(destination.parent)
    except BaseException:
        for staging in stagings:  # those already swapped in are gone from here
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_in(staging: Path, destination: Path, overwrite: bool) -> None:
    # Checked again: the destination may have appeared while the export ran.
    check_destination(destination, overwrite)
    if not destination.exists():
        staging.rename(destination)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
    retired.rmdir()
    destination.rename(retired)
    try:
        staging.rename(destination)
    except BaseException:
        retired.rename(destination)
        raise
    shutil.rmtree(retired, ignore_errors=True)
