import os
import stat

import pytest

from museflash.export.publish import (
    OutputDirError,
    check_destination,
    publish_directories,
    publish_directory,
)


def _snapshot(root):
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_publishes_new_directory(tmp_path):
    dest = tmp_path / "out"
    with publish_directory(dest) as staging:
        assert staging.parent == tmp_path
        assert not dest.exists()
        (staging / "pkg").mkdir()
        (staging / "pkg" / "a.bin").write_bytes(b"abc")
    assert _snapshot(dest) == {"pkg/a.bin": b"abc"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failure_midway_leaves_no_trace(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with publish_directory(dest) as staging:
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_interrupt_keeps_existing_destination(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with publish_directory(dest, overwrite=True) as staging:
            (staging / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert _snapshot(dest) == {"old.txt": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_contents(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with publish_directory(dest, overwrite=True) as staging:
        (staging / "new.txt").write_text("new")
    assert _snapshot(dest) == {"new.txt": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_refuses_non_empty_destination_without_overwrite(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("keep")
    with pytest.raises(OutputDirError, match="--overwrite"):
        with publish_directory(dest):
            raise AssertionError("must fail before the body runs")
    assert _snapshot(dest) == {"keep.txt": b"keep"}


def test_empty_existing_directory_is_usable(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    with publish_directory(dest) as staging:
        (staging / "f").write_text("1")
    assert _snapshot(dest) == {"f": b"1"}


def test_destination_that_is_a_file_is_rejected(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(OutputDirError, match="not a directory"):
        check_destination(target, overwrite=True)


def test_missing_parent_is_rejected(tmp_path):
    with pytest.raises(OutputDirError, match="does not exist"):
        check_destination(tmp_path / "no" / "such" / "out", overwrite=False)


def test_published_files_are_readable_by_others(tmp_path):
    dest = tmp_path / "out"
    with publish_directory(dest) as staging:
        secret = staging / "pkg" / "weight.bin"
        secret.parent.mkdir()
        secret.write_bytes(b"w")
        os.chmod(secret, 0o600)
        os.chmod(secret.parent, 0o700)
    assert stat.S_IMODE((dest / "pkg" / "weight.bin").stat().st_mode) & 0o044 == 0o044
    assert stat.S_IMODE((dest / "pkg").stat().st_mode) & 0o055 == 0o055


def test_everything_is_flushed_to_disk_before_the_swap(tmp_path, monkeypatch):
    """Each staged file, then each directory (deepest first), is fsync'd before the rename
    publishes them; then the parent, whose entry the rename changed."""
    from museflash.export import publish

    events = []
    real_fsync, real_open = os.fsync, os.open
    opened = {}

    def tracking_open(path, flags, *args):
        descriptor = real_open(path, flags, *args)
        opened[descriptor] = os.path.relpath(path, tmp_path)
        return descriptor

    def tracking_fsync(descriptor):
        events.append(("fsync", opened.get(descriptor)))
        real_fsync(descriptor)

    real_swap = publish._swap_in
    monkeypatch.setattr(publish.os, "open", tracking_open)
    monkeypatch.setattr(publish.os, "fsync", tracking_fsync)
    monkeypatch.setattr(publish, "_swap_in", lambda *a: (events.append(("swap",)), real_swap(*a)))
    dest = tmp_path / "out"
    with publish_directory(dest) as staging:
        (staging / "pkg" / "Data").mkdir(parents=True)
        (staging / "pkg" / "Data" / "weight.bin").write_bytes(b"w")
        (staging / "metadata.json").write_text("{}")
    name = staging.name
    assert sorted(events[:2]) == [("fsync", f"{name}/metadata.json"),
                                  ("fsync", f"{name}/pkg/Data/weight.bin")]
    assert events[2:] == [("fsync", f"{name}/pkg/Data"), ("fsync", f"{name}/pkg"),
                          ("fsync", name), ("swap",), ("fsync", ".")]


def test_several_destinations_are_published_together(tmp_path):
    first, second = tmp_path / "fp16", tmp_path / "4bit"
    with publish_directories([first, second]) as stagings:
        for staging, text in zip(stagings, ("a", "b"), strict=True):
            (staging / "metadata.json").write_text(text)
    assert (first / "metadata.json").read_text() == "a"
    assert (second / "metadata.json").read_text() == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4bit", "fp16"]


def test_none_is_published_when_a_later_destination_became_unusable(tmp_path):
    """Every destination is checked again before the first is swapped in: the second one
    filled up while the export ran, so neither is published and nothing is staged."""
    first, second = tmp_path / "fp16", tmp_path / "4bit"
    with pytest.raises(OutputDirError, match="4bit is not empty"):
        with publish_directories([first, second]) as stagings:
            for staging in stagings:
                (staging / "metadata.json").write_text("new")
            second.mkdir()
            (second / "theirs.txt").write_text("keep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4bit"]
    assert [p.name for p in second.iterdir()] == ["theirs.txt"]
