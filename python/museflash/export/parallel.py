"""Converting an export's functions in several processes at once.

Tracing and conversion are single-threaded Python and take the export's time (about 35 s per
12-layer target function); functions are independent until they are merged. So the export
process converts some functions itself while helper processes convert others, each writing a
single-function package that the export then merges (`merge.merge_packages`).

A helper is this module run as a program. It reads one JSON request from stdin (the options and
the checkpoint directories), plans and loads the modules exactly as the export does (the same
placeholder rows: each is derived from its tensor's name), prints READY, and then converts one
function per JSON line it is sent, answering DONE or ERROR. Progress lines travel on the same
channel; anything else a library prints goes to its stderr, which the export shows if the
helper fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from museflash.export.options import ExportError, ExportOptions

DEFAULT_PROCESSES = 2  # each process adds ~0.35 GB (torch + coremltools + a converting graph)
READY = "museflash-helper-ready"
DONE = "museflash-helper-done"
ERROR = "museflash-helper-error "
PROGRESS = "[export] "


def process_count(requested: int | None, jobs: int) -> int:
    """Processes converting at once, this one included."""
    wanted = requested if requested is not None else min(DEFAULT_PROCESSES, os.cpu_count() or 1)
    return max(1, min(wanted, jobs))


class HelperProcess:
    """One helper, driven from one thread of the export process."""

    def __init__(self, request: dict[str, Any], echo: Callable[[str], None]):
        self.echo = echo
        self.busy = False
        self.stopped = False
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "museflash.export.parallel"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, env=env,
            text=True, bufsize=1)
        self._send(request)

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except OSError:
            pass  # the helper has exited; _await reports it with the helper's stderr

    def _await(self, expected: str) -> None:
        for line in self.process.stdout:
            line = line.rstrip("\n")
            if line == expected:
                return
            if line.startswith(ERROR):
                raise HelperError(json.loads(line[len(ERROR):]))
            if line.startswith(PROGRESS):
                self.echo(line)
        self.process.wait()
        self.stderr.seek(0)
        tail = self.stderr.read().decode(errors="replace")[-3000:]
        raise HelperError(f"a conversion helper process exited ({self.process.returncode}) "
                          f"before answering; its stderr ends:\n{tail}")

    def wait_ready(self) -> None:
        self._await(READY)

    def convert(self, role: str, function: str, part: Path) -> None:
        self._send({"package": role, "function": function, "part": str(part)})
        self._await(DONE)

    def stop(self) -> None:
        self.stopped = True
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        """Stops the helper if it still runs and releases its pipes and stderr file."""
        self.stop()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            with suppress(OSError):
                stream.close()
        self.stderr.close()


class HelperError(RuntimeError):
    """A helper failed; the message is its own error, or its exit status and stderr."""


@contextmanager
def conversion_helpers(options, plan, progress, numerics) -> Iterator[list[HelperProcess]]:
    """Starts the helper processes this export wants (they load while this process does) and
    stops them on the way out, whatever happened."""
    jobs = sum(len(package.conversions) for package in plan.assets)
    count = process_count(options.conversion_processes, jobs) - 1
    request = {
        # A helper only converts: what else the export writes is this process's business.
        "options": _options_to_json(dataclasses.replace(options, also_export=())),
        "target_dir": str(plan.target_dir),
        "drafter_dir": str(plan.drafter_dir) if plan.drafter_dir else None,
        "numerics": dataclasses.asdict(numerics),
    }
    helpers: list[HelperProcess] = []
    try:
        for number in range(1, count + 1):
            helpers.append(HelperProcess(dict(request, number=number,
                                              progress_start=progress.start), progress.say))
        yield helpers
    finally:
        for helper in helpers:
            helper.close()


def run_conversions(jobs: list, convert_here: Callable[[Any], None],
                    helpers: list[HelperProcess]) -> None:
    """Converts every (package, function, part path) job once: this process and each helper
    take the next job as they become free. The first failure stops everything and is raised."""
    pending = deque(jobs)
    lock = threading.Lock()
    failed = threading.Event()
    errors: list[BaseException] = []

    def take(helper: HelperProcess | None = None):
        with lock:
            if not pending or failed.is_set():
                return None
            if helper is not None:
                helper.busy = True
            return pending.popleft()

    def drive(helper: HelperProcess) -> None:
        try:
            helper.wait_ready()
            while (job := take(helper)) is not None:
                package, function, part = job
                helper.convert(package.role, function.name, part)
                helper.busy = False
        except BaseException as error:  # noqa: BLE001 - handed to the export's thread
            if not helper.stopped:
                errors.append(error)
                failed.set()

    threads = [threading.Thread(target=drive, args=(h,), daemon=True) for h in helpers]
    for thread in threads:
        thread.start()
    try:
        while (job := take()) is not None:
            convert_here(job)
        # No job is left to start: a helper that has none is not needed any more.
        with lock:
            for helper in helpers:
                if not helper.busy:
                    helper.stop()
    except BaseException:
        failed.set()
        for helper in helpers:
            helper.stop()
        raise
    finally:
        for thread in threads:
            thread.join()
    if errors:
        error = errors[0]
        if isinstance(error, HelperError):
            raise ExportError(f"converting in a helper process failed: {error} (to convert "
                              "everything in this process, pass --conversion-processes 1)"
                              ) from error
        raise error


def _options_to_json(options) -> dict[str, Any]:
    return {field.name: (str(value) if isinstance(value, Path) else value)
            for field in dataclasses.fields(options)
            for value in [getattr(options, field.name)]}


def _options_from_json(raw: dict[str, Any]) -> ExportOptions:
    paths = {"output_dir", "checkpoint", "drafter_checkpoint"}
    return ExportOptions(**{name: (Path(value) if name in paths and value is not None
                                   else value) for name, value in raw.items()})


def helper_main(requests: IO[str], answers: IO[str]) -> int:
    from museflash.export.convert import convert_function
    from museflash.export.fp16_range import GraphNumerics
    from museflash.export.placeholders import PlaceholderWeights
    from museflash.export.plan import load_modules, plan_export
    from museflash.export.progress import Progress

    def answer(line: str) -> None:
        answers.write(line + "\n")
        answers.flush()

    try:
        request = json.loads(requests.readline())
        options = _options_from_json(request["options"])
        drafter_dir = Path(request["drafter_dir"]) if request["drafter_dir"] else None
        plan = plan_export(options, Path(request["target_dir"]), drafter_dir)
        modules = load_modules(options, plan, Progress(echo=lambda _line: None),
                               PlaceholderWeights(), GraphNumerics(**request["numerics"]))
        answer(READY)
        progress = Progress(echo=answer)
        progress.start = request["progress_start"]  # CLOCK_MONOTONIC: one clock for all
        for line in requests:
            job = json.loads(line)
            package = plan.asset(job["package"])
            convert_function(modules[package.module], package,
                                    package.function(job["function"]), Path(job["part"]),
                                    progress, where=f"helper {request['number']}")
            answer(DONE)
    except BaseException as error:  # noqa: BLE001 - reported to the export, then exit 1
        traceback.print_exc()
        answer(ERROR + json.dumps(f"{type(error).__name__}: {error}"))
        return 1
    return 0


def _run_as_helper() -> int:
    import logging

    # Answers go to the original stdout; whatever else is printed (coremltools' progress,
    # warnings, C++ libraries) goes to stderr so it cannot be mistaken for an answer.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.getLogger("coremltools").setLevel(logging.WARNING)
    return helper_main(sys.stdin, answers)


if __name__ == "__main__":
    sys.exit(_run_as_helper())
