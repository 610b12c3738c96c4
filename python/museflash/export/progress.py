"""What the export shows on the console: its own stage lines on stdout, and nothing else.

Libraries talk a lot while converting (coremltools' per-pass progress bars, the untested-torch
notice, native-library load failures, int64 narrowing warnings). `quiet_console` sends all of
that, at the file-descriptor level, to a log file; the command line prints the log's path when
the export fails and removes it when it succeeds. `--verbose` leaves the console alone.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Progress:
    """One line per stage with elapsed time and bytes, on stdout."""

    def __init__(self, echo=print):
        self.echo = echo
        self.start = time.monotonic()
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        """Echoes one line whole, also when helper threads report at the same time."""
        with self._lock:
            self.echo(line)

    @contextmanager
    def stage(self, name: str, detail: str = "") -> Iterator[dict[str, Any]]:
        began = time.monotonic()
        info: dict[str, Any] = {}
        yield info
        took = time.monotonic() - began
        size = f", {human_bytes(info['bytes'])}" if "bytes" in info else ""
        extra = f" ({detail})" if detail else ""
        note = f"; {info['summary']}" if "summary" in info else ""
        self.say(f"[export] {name}{extra}: {took:.1f} s{size}{note} "
                 f"[total {time.monotonic() - self.start:.1f} s]")


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB"):
        if value < 1024:
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} GB"


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def log_path_for(output_dir: Path) -> Path:
    """The console log's place: beside the output directory, never inside it (the output is
    published whole or not at all)."""
    output_dir = Path(output_dir).absolute()
    return output_dir.parent / f"{output_dir.name}.export.log"


@contextmanager
def quiet_console(log_path: Path) -> Iterator[Path]:
    """Everything written to stderr (by Python or native code), every warning and every log
    record goes to `log_path` inside the block; stdout stays the console's."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    saved_stderr = sys.stderr
    saved_showwarning = warnings.showwarning
    root = logging.getLogger()
    with open(log_path, "w", buffering=1) as log:
        os.dup2(log.fileno(), 2)
        sys.stderr = log
        handler = logging.StreamHandler(log)
        root.addHandler(handler)

        def to_log(message, category, filename, lineno, file=None, line=None):
            log.write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = to_log
        try:
            yield Path(log_path)
        finally:
            log.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            sys.stderr = saved_stderr
            warnings.showwarning = saved_showwarning
            root.removeHandler(handler)
