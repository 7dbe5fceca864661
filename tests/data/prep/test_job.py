"""The shared folder-job machinery (modules/data/prep/job.py), driven by a small real model:
each image's mean colour, written as text. The captioner's and the mask maker's own tests run
the same machinery with their tiny models."""
from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.data.prep.job import (FAIL_FAST_AFTER, LOCK_NAME, FolderJob, JobHooks, JobRefused,
                                   journal_name, run_job)
from modules.util.atomic import atomic_write_text


class MeanColour:
    """A model that reads pixels: the mean RGB of each image. It fails on images 13 px wide."""

    def __init__(self, calls: list[int]) -> None:
        self.calls = calls

    def process(self, images):
        self.calls.append(len(images))
        if any(image.width == 13 for image in images):
            raise ValueError("13 pixels wide")
        return [" ".join(f"{v:.0f}" for v in np.asarray(image).reshape(-1, 3).mean(0))
                for image in images]


def colour_job(calls: list[int], batch_size: int = 2, **settings) -> FolderJob:
    def write(image: Path, text: str) -> list[Path]:
        out = image.with_suffix(".colour")
        atomic_write_text(out, text)
        return [out]

    def needs_work(image: Path) -> str | None:
        return "has a colour file" if image.with_suffix(".colour").exists() else None

    return FolderJob(kind="colour", settings={"batch": batch_size, **settings},
                     load=lambda: MeanColour(calls), needs_work=needs_work, write=write,
                     batch_size=batch_size)


def make_folder(root: Path, n: int = 5) -> Path:
    folder = root / "images"
    folder.mkdir()
    for i in range(n):
        Image.new("RGB", (16, 12), (10 * i, 20, 30)).save(folder / f"img{i}.png")
    return folder


def test_every_image_is_written_with_progress_and_a_report(tmp_path):
    folder = make_folder(tmp_path)
    Image.new("L", (16, 12), 255).save(folder / "img0_mask.png")  # a loss mask: not an image
    (folder / "notes.txt").write_text("not an image")
    calls: list[int] = []
    seen = []
    report = run_job(folder, colour_job(calls), JobHooks(progress=seen.append))
    assert report.status == "finished" and calls == [2, 2, 1]
    assert (folder / "img3.colour").read_text() == "30 20 30"
    assert sorted(p.name for p in report.written) == [f"img{i}.colour" for i in range(5)]
    assert [p.done for p in seen] == [1, 2, 3, 4, 5] and {p.total for p in seen} == {5}
    assert seen[-1].eta_seconds == 0 and seen[0].eta_seconds is not None
    assert not (folder / LOCK_NAME).exists() and not (folder / journal_name("colour")).exists()
    # run again: everything has its file, the model is not even loaded
    again = run_job(folder, colour_job(calls))
    assert len(again.left_alone) == 5 and calls == [2, 2, 1] and not again.written


def test_bad_images_and_model_failures_are_named_and_the_job_goes_on(tmp_path):
    folder = make_folder(tmp_path, 3)
    (folder / "empty.png").write_bytes(b"")
    (folder / "garbage.jpg").write_bytes(b"this is no jpeg at all")
    Image.new("RGB", (13, 12)).save(folder / "narrow.png")  # the model fails on it
    report = run_job(folder, colour_job([], batch_size=4))
    assert report.status == "finished"
    skipped = dict((p.name, reason) for p, reason in report.skipped)
    assert skipped["empty.png"] == "empty file (0 bytes)"
    assert "not a readable image" in skipped["garbage.jpg"]
    assert [(p.name, reason) for p, reason in report.failed] == [
        ("narrow.png", "ValueError: 13 pixels wide")]
    # the batch it was in was retried image by image: its neighbours were written
    assert sorted(p.name for p in report.processed) == ["img0.png", "img1.png", "img2.png"]
    assert not (folder / "narrow.colour").exists() and not (folder / "empty.colour").exists()
    text = "\n".join(report.lines())
    assert "narrow.png: ValueError: 13 pixels wide" in text and "empty.png" in text


def test_a_model_that_fails_on_every_image_ends_the_job(tmp_path):
    folder = tmp_path / "narrow"
    folder.mkdir()
    for i in range(FAIL_FAST_AFTER + 3):
        Image.new("RGB", (13, 12)).save(folder / f"n{i}.png")
    report = run_job(folder, colour_job([], batch_size=FAIL_FAST_AFTER))
    assert report.status == "failed" and len(report.failed) == FAIL_FAST_AFTER
    assert "the model or its settings" in report.error


def test_stop_mid_job_leaves_whole_files_and_a_rerun_continues(tmp_path):
    folder = make_folder(tmp_path, 7)
    stop = threading.Event()

    def stop_after_three(progress):
        if progress.done == 3:  # in the middle of the second batch
            stop.set()

    calls: list[int] = []
    job = colour_job(calls, batch_size=2, mode="replace")
    # a job that ignores existing files, so only the journal tells what is done
    job = FolderJob(**{**job.__dict__, "needs_work": lambda image: None})
    first = run_job(folder, job, JobHooks(progress=stop_after_three), stop)
    assert first.status == "stopped" and len(first.processed) == 4  # the batch was finished
    assert not list(folder.glob(".*.tmp")) and not (folder / LOCK_NAME).exists()
    assert all(len((folder / f"img{i}.colour").read_text().split()) == 3 for i in range(4))
    assert (folder / journal_name("colour")).exists()
    assert "continue where it stopped" in "\n".join(first.lines())
    statuses: list[str] = []
    second = run_job(folder, job, JobHooks(status=statuses.append))
    assert second.status == "finished" and second.earlier == 4
    assert sorted(p.name for p in second.processed) == ["img4.png", "img5.png", "img6.png"]
    assert calls == [2, 2, 2, 1] and any("4 image(s) already done" in s for s in statuses)
    assert not (folder / journal_name("colour")).exists()


def test_a_journal_of_other_settings_starts_over(tmp_path):
    folder = make_folder(tmp_path, 2)
    (folder / journal_name("colour")).write_text(
        json.dumps({"settings": {"batch": 9}}) + '\n{"done": "img0.png"}\n{"do')
    statuses: list[str] = []
    report = run_job(folder, colour_job([]), JobHooks(status=statuses.append))
    assert report.earlier == 0 and len(report.processed) == 2
    assert any("other settings" in s for s in statuses)


def test_a_second_job_on_the_folder_is_refused(tmp_path):
    folder = make_folder(tmp_path, 2)
    refusals = []

    def load_and_try_another():
        with pytest.raises(JobRefused) as err:
            run_job(folder, colour_job([]))
        refusals.append(str(err.value))
        return MeanColour([])

    job = FolderJob(**{**colour_job([]).__dict__, "load": load_and_try_another})
    assert run_job(folder, job).status == "finished"
    assert f"is in use by a colour job (process {os.getpid()}" in refusals[0]
    assert "img0.colour" not in refusals[0]


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    folder = make_folder(tmp_path, 1)
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket
    (folder / LOCK_NAME).write_text(json.dumps(
        {"kind": "mask", "pid": dead.pid, "host": socket.gethostname()}))
    statuses: list[str] = []
    assert run_job(folder, colour_job([]), JobHooks(status=statuses.append)).processed
    assert any("no longer runs" in s for s in statuses)


@pytest.mark.parametrize("problem", ["missing", "file", "empty"])
def test_a_folder_that_cannot_be_worked_on_is_refused(tmp_path, problem):
    target = tmp_path / "x"
    if problem == "file":
        target.write_text("")
    elif problem == "empty":
        target.mkdir()
        (target / "a.txt").write_text("")
    with pytest.raises(JobRefused, match={"missing": "does not exist", "file": "not a folder",
                                          "empty": "holds no images"}[problem]):
        run_job(target, colour_job([]))


def test_a_folder_that_is_not_writable_is_refused(read_only_folder):
    with pytest.raises(JobRefused, match="is not writable"):
        run_job(read_only_folder, colour_job([]))


def test_a_write_that_fails_ends_the_job_with_the_file_named(tmp_path):
    folder = make_folder(tmp_path, 3)
    job = colour_job([], batch_size=1)

    def write(image: Path, text: str) -> list[Path]:
        if image.name == "img1.png":
            raise OSError(28, "No space left on device")
        return job.write(image, text)

    report = run_job(folder, FolderJob(**{**job.__dict__, "write": write}))
    assert report.status == "failed" and "img1.png" in report.error
    assert "No space left" in report.error and [p.name for p in report.processed] == ["img0.png"]
    assert (folder / journal_name("colour")).exists()  # a re-run continues after img0
