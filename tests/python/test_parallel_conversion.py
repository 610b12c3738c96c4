"""Functions converted in several processes: every job exactly once, failures stop everything
and name their cause, and a real helper process reports its own errors."""

import dataclasses
import threading
from pathlib import Path

import pytest

from museflash.export import parallel as parallel_conversion
from museflash.export.fp16_range import GraphNumerics
from museflash.export.options import ExportError, ExportOptions
from museflash.export.parallel import HelperError, HelperProcess, process_count, run_conversions
from museflash.export.plan import AssetPlan, plan_export


def _jobs(count):
    package = AssetPlan("target", "fused_target", "target", (), "main", [])
    return [(package, _Function(f"f{i}"), Path(f"f{i}.mlpackage")) for i in range(count)]


class _Function:
    def __init__(self, name):
        self.name = name


WAIT = 60  # seconds; only reached when run_conversions is broken (then the test fails, not hangs)


class _FakeHelper:
    """Stands in for a HelperProcess: converts by recording, after `before_convert` (which may
    block, or raise like a failing or killed helper)."""

    def __init__(self, before_convert=lambda function: None):
        self.busy = False
        self.stopped = False
        self.stopped_event = threading.Event()
        self.done = []
        self.before_convert = before_convert

    def wait_ready(self):
        pass

    def convert(self, asset, function, part):
        self.before_convert(function)
        self.done.append(function)

    def stop(self):
        self.stopped = True
        self.stopped_event.set()


def _wait(event):
    assert event.wait(WAIT), "run_conversions did not get here"


def test_every_job_is_converted_once_here_or_in_a_helper():
    """Each of the three converters blocks in its first job until all three hold one: so all
    of them take part, whatever the scheduling."""
    everyone_busy = threading.Barrier(3, timeout=WAIT)
    here = []

    def first_waits(converted):
        def before(_function):
            if not converted:
                everyone_busy.wait()
        return before

    def convert_here(job):
        first_waits(here)(job[1].name)
        here.append(job[1].name)

    helpers = [_FakeHelper(), _FakeHelper()]
    for helper in helpers:
        helper.before_convert = first_waits(helper.done)
    run_conversions(_jobs(12), convert_here, helpers)
    converted = here + helpers[0].done + helpers[1].done
    assert sorted(converted) == sorted(f"f{i}" for i in range(12))
    assert here and helpers[0].done and helpers[1].done


def test_without_helpers_everything_converts_here():
    here = []
    run_conversions(_jobs(3), lambda job: here.append(job[1].name), [])
    assert here == ["f0", "f1", "f2"]


def test_a_failing_helper_stops_the_export_and_names_its_error():
    """The helper fails while this process converts its first job, which lasts until the
    helper's thread has finished reporting the failure; then nothing new may start here."""
    before = set(threading.enumerate())
    converting_here, helper_failed = threading.Event(), threading.Event()
    here = []

    def fail(function):
        _wait(converting_here)
        helper_failed.set()
        raise HelperError(f"ValueError: cannot convert {function}")

    helper = _FakeHelper(fail)

    def convert_here(job):
        here.append(job[1].name)
        if len(here) == 1:
            converting_here.set()
            _wait(helper_failed)
            for thread in set(threading.enumerate()) - before:
                thread.join(WAIT)

    with pytest.raises(ExportError, match="helper process failed: ValueError: cannot convert f"):
        run_conversions(_jobs(6), convert_here, [helper])
    # Nothing new starts once a conversion has failed.
    assert len(here) == 1


def test_a_failure_here_stops_the_helpers():
    """The helper's conversion lasts until it is stopped (a real one is killed); the failure
    here is raised, the helper is stopped, and nothing it had started counts as converted."""
    def until_stopped(_function):
        _wait(helper.stopped_event)
        raise HelperError("killed")

    helper = _FakeHelper(until_stopped)

    def convert_here(job):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_conversions(_jobs(6), convert_here, [helper])
    assert helper.stopped
    assert helper.done == []


@pytest.mark.parametrize(("requested", "jobs", "cpus", "expected"), [
    (None, 4, 8, 2), (None, 4, 1, 1), (None, 1, 8, 1), (3, 4, 1, 3), (8, 4, 8, 4), (1, 4, 8, 1),
])
def test_process_count(monkeypatch, requested, jobs, cpus, expected):
    monkeypatch.setattr(parallel_conversion.os, "cpu_count", lambda: cpus)
    assert process_count(requested, jobs) == expected


def test_options_travel_to_the_helper_unchanged(tmp_path):
    options = ExportOptions(output_dir=tmp_path / "out", checkpoint=tmp_path / "t",
                            drafter_checkpoint=None, fused_target=True, num_draft_tokens=3,
                            conversion_processes=2)
    raw = parallel_conversion._options_to_json(options)
    assert parallel_conversion._options_from_json(raw) == options
    assert isinstance(parallel_conversion._options_from_json(raw).checkpoint, Path)


def test_a_real_helper_reports_its_own_error(tmp_path):
    """The helper process plans the export itself; a checkpoint that vanished before it read
    it is reported with the loader's own message, not as a bare exit status."""
    from museflash.builtin.demo_checkpoint import write_tiny_checkpoints

    target_dir, drafter_dir = write_tiny_checkpoints(tmp_path / "demo")
    options = ExportOptions(output_dir=tmp_path / "out", fused_target=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir)
    plan = plan_export(options, target_dir, drafter_dir)
    for shard in target_dir.glob("*.safetensors"):
        shard.unlink()
    lines = []
    helper = HelperProcess({"options": parallel_conversion._options_to_json(options),
                            "target_dir": str(plan.target_dir),
                            "drafter_dir": str(plan.drafter_dir), "number": 1,
                            "numerics": dataclasses.asdict(GraphNumerics()),
                            "progress_start": 0.0}, lines.append)
    try:
        with pytest.raises(HelperError, match="CheckpointError: .*safetensors"):
            helper.wait_ready()
    finally:
        helper.stop()
        helper.close()
    assert helper.process.returncode != 0
