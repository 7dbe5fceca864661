"""Atomic writes: an error half-way leaves the previous file or folder intact, no temp files."""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.util.atomic import atomic_file, atomic_write_dir, atomic_write_text


class Boom(Exception):
    pass


def test_write_text_creates_parents_and_writes(tmp_path):
    path = tmp_path / "a" / "b" / "c.txt"
    atomic_write_text(path, "hello")
    assert path.read_text(encoding="utf-8") == "hello"
    assert sorted(p.name for p in path.parent.iterdir()) == ["c.txt"]


def test_write_text_replaces(tmp_path):
    path = tmp_path / "c.txt"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text(encoding="utf-8") == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["c.txt"]


def test_write_text_failure_keeps_the_previous_file(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("old", encoding="utf-8")

    class NotText:  # write_text raises TypeError on a non-str
        pass

    with pytest.raises(TypeError):
        atomic_write_text(path, NotText())  # type: ignore[arg-type]
    assert path.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["c.txt"]


def test_atomic_file_error_midway_keeps_the_previous_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"good")
    with pytest.raises(Boom):
        with atomic_file(path) as tmp:
            assert tmp.parent == tmp_path and tmp != path
            tmp.write_bytes(b"half")
            raise Boom
    assert path.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


def test_atomic_file_error_before_first_write_leaves_nothing(tmp_path):
    path = tmp_path / "new.bin"
    with pytest.raises(Boom):
        with atomic_file(path):
            raise Boom
    assert list(tmp_path.iterdir()) == []


def test_atomic_file_success_replaces(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"old")
    with atomic_file(path) as tmp:
        tmp.write_bytes(b"new")
        assert path.read_bytes() == b"old"  # not visible until the block ends
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]


def _fill(folder: Path, text: str) -> None:
    (folder / "model.txt").write_text(text, encoding="utf-8")
    (folder / "sub").mkdir()
    (folder / "sub" / "part.txt").write_text(text, encoding="utf-8")


def test_write_dir_creates(tmp_path):
    path = tmp_path / "ckpt"
    atomic_write_dir(path, lambda d: _fill(d, "v1"))
    assert (path / "sub" / "part.txt").read_text(encoding="utf-8") == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_write_dir_replaces_the_whole_folder(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "stale.txt").write_text("x", encoding="utf-8")
    atomic_write_dir(path, lambda d: _fill(d, "v2"))
    assert sorted(p.name for p in path.iterdir()) == ["model.txt", "sub"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_write_dir_error_midway_keeps_the_previous_folder(tmp_path):
    path = tmp_path / "ckpt"
    atomic_write_dir(path, lambda d: _fill(d, "good"))

    def half_then_fail(folder: Path) -> None:
        (folder / "model.txt").write_text("half", encoding="utf-8")
        raise Boom

    with pytest.raises(Boom):
        atomic_write_dir(path, half_then_fail)
    assert (path / "model.txt").read_text(encoding="utf-8") == "good"
    assert (path / "sub" / "part.txt").read_text(encoding="utf-8") == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_write_dir_error_with_no_previous_folder_leaves_nothing(tmp_path):
    def fail(folder: Path) -> None:
        raise Boom

    with pytest.raises(Boom):
        atomic_write_dir(tmp_path / "ckpt", fail)
    assert list(tmp_path.iterdir()) == []


def test_write_dir_clears_a_leftover_old_folder(tmp_path):
    # A crash between the two renames of an earlier save leaves `.ckpt.old` behind.
    (tmp_path / ".ckpt.old").mkdir()
    atomic_write_dir(tmp_path / "ckpt", lambda d: _fill(d, "v1"))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_and_folders_get_the_permissions_a_normal_write_gives(tmp_path, umask):
    import os
    import stat
    from modules.util.atomic import atomic_write_dir, atomic_write_text, publish_dir_once
    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")

        def write(folder):
            (folder / "sub").mkdir()
            (folder / "sub" / "w.safetensors").write_bytes(b"w")

        atomic_write_dir(tmp_path / "final", write)
        publish_dir_once(tmp_path / "cache", write)
    finally:
        os.umask(previous)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "a.txt") == 0o666 & ~umask
    for root in ("final", "cache"):
        assert mode(tmp_path / root) == 0o777 & ~umask
        assert mode(tmp_path / root / "sub") == 0o777 & ~umask
        assert mode(tmp_path / root / "sub" / "w.safetensors") == 0o666 & ~umask


def test_a_swap_interrupted_between_its_renames_is_restored_and_others_are_left(tmp_path):
    from modules.util.atomic import remove_temporaries, restore_interrupted_swaps
    # the crash came after `best` -> `.best.old` and before the new folder was renamed in
    (tmp_path / ".best.old").mkdir()
    (tmp_path / ".best.old" / "w.txt").write_text("old best", encoding="utf-8")
    (tmp_path / ".best.abc123.tmp").mkdir()              # the new one, incomplete
    # a leftover `.old` beside a complete folder is only a leftover
    (tmp_path / "final").mkdir()
    (tmp_path / ".final.old").mkdir()
    assert restore_interrupted_swaps([tmp_path, tmp_path / "absent"]) == [tmp_path / "best"]
    assert (tmp_path / "best" / "w.txt").read_text(encoding="utf-8") == "old best"
    remove_temporaries([tmp_path])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "final"]
