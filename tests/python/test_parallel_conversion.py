"""Functions converted in several processes: every job exactly once, failures stop everything
and name their cause, and a real helper process reports its own errors."""

import threading
import time
from pathlib import Path

import pytest

from museflash import parallel_conversion
from museflash.export import ExportError, ExportOptions, PackagePlan, plan_export
from museflash.parallel_conversion import HelperError, HelperProcess, process_count, run_conversions


def _jobs(count):
    package = PackagePlan("target", "fused_target", "target", (), "main", [])
    return [(package, _Function(f"f{i}"), Path(f"f{i}.mlpackage")) for i in range(count)]


class _Function:
    def __init__(self, name):
        self.name = name


class _FakeHelper:
    """Stands in for a HelperProcess: converts by recording, optionally failing."""

    def __init__(self, fails=False, delay=0.0):
        self.busy = False
        self.stopped = False
        self.done = []
        self.fails = fails
        self.delay = delay

    def wait_ready(self):
        pass

    def convert(self, asset, function, part):
        time.sleep(self.delay)
        if self.fails:
            raise HelperError(f"ValueError: cannot convert {function}")
        self.done.append(function)

    def stop(self):
        self.stopped = True


def test_every_job_is_converted_once_here_or_in_a_helper():
    here = []
    lock = threading.Lock()

    def convert_here(job):
        time.sleep(0.02)
        with lock:
            here.append(job[1].name)

    helpers = [_FakeHelper(delay=0.02), _FakeHelper(delay=0.02)]
    run_conversions(_jobs(12), convert_here, helpers)
    converted = here + helpers[0].done + helpers[1].done
    assert sorted(converted) == sorted(f"f{i}" for i in range(12))
    assert here and helpers[0].done and helpers[1].done


def test_without_helpers_everything_converts_here():
    here = []
    run_conversions(_jobs(3), lambda job: here.append(job[1].name), [])
    assert here == ["f0", "f1", "f2"]


def test_a_failing_helper_stops_the_export_and_names_its_error():
    here = []
    helper = _FakeHelper(fails=True)

    def convert_here(job):
        here.append(job[1].name)
        time.sleep(0.2)  # the helper takes a job meanwhile, and fails

    with pytest.raises(ExportError, match="helper process failed: ValueError: cannot convert f"):
        run_conversions(_jobs(6), convert_here, [helper])
    # Nothing new starts once a conversion has failed.
    assert len(here) == 1


def test_a_failure_here_stops_the_helpers():
    helper = _FakeHelper(delay=0.05)

    def convert_here(job):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_conversions(_jobs(6), convert_here, [helper])
    assert helper.stopped
    assert len(helper.done) <= 1


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
    from museflash.demo_checkpoint import write_demo_checkpoints

    target_dir, drafter_dir = write_demo_checkpoints(tmp_path / "demo")
    options = ExportOptions(output_dir=tmp_path / "out", fused_target=True,
                            checkpoint=target_dir, drafter_checkpoint=drafter_dir)
    plan = plan_export(options, target_dir, drafter_dir)
    for shard in target_dir.glob("*.safetensors"):
        shard.unlink()
    lines = []
    helper = HelperProcess({"options": parallel_conversion._options_to_json(options),
                            "target_dir": str(plan.target_dir),
                            "drafter_dir": str(plan.drafter_dir), "number": 1,
                            "progress_start": 0.0}, lines.append)
    try:
        with pytest.raises(HelperError, match="CheckpointError: .*safetensors"):
            helper.wait_ready()
    finally:
        helper.stop()
        helper.close()
    assert helper.process.returncode != 0
