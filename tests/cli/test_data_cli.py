"""`tempera-data caption` (modules/cli/data.py), run in-process with the tiny WD tagger built
by tests/data/prep/tiny_captioners.py: exit codes, one-line refusals, the progress bar, Ctrl+C."""
from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
from PIL import Image

from modules.cli import data as cli
from modules.data.prep.job import LOCK_NAME, JobHooks

from tests.data.prep.tiny_captioners import build_tiny_wd_tagger

pytest.importorskip("onnxruntime", reason="the `data` extra (onnxruntime) runs the WD taggers")


@pytest.fixture(scope="module")
def tagger(tmp_path_factory) -> Path:
    return build_tiny_wd_tagger(tmp_path_factory.mktemp("tagger") / "wd")


@pytest.fixture
def folder(tmp_path) -> Path:
    images = tmp_path / "images"
    images.mkdir()
    for i, colour in enumerate([(230, 20, 20), (20, 230, 20), (90, 90, 90)]):
        Image.new("RGB", (16, 16), colour).save(images / f"{i}.png")
    return images


def caption(folder: Path, *options: str) -> int:
    return cli.main(["caption", str(folder), "--device", "cpu", *options])


def test_the_tags_preset_captions_the_folder_with_a_progress_bar(tagger, folder, capsys):
    code = caption(folder, "--preset", "tags", "--model", str(tagger), "--prefix", "sks",
                   "--exclude-tags", "^_^, simple background")
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (folder / "0.txt").read_text() == "sks, hakurei reimu, red theme, 1girl\n"
    assert "caption job finished: 3 image(s) done, 3 file(s) written" in out
    assert "3/3" in err and "loading WD v3 tagger" in err


def test_a_bad_option_value_exits_2_with_the_usage(folder, capsys):
    with pytest.raises(SystemExit) as exit_:
        caption(folder, "--existing", "overwrite")
    assert exit_.value.code == 2
    assert "invalid choice: 'overwrite'" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    (["--prompt", "hello"], "prompt: Florence-2 captions with a task token"),
    (["--captioner", "wd-tagger", "--model", "someone/absent", "--offline"],
     "someone/absent is not in the Hugging Face cache"),
])
def test_a_refusal_is_one_line_and_exit_2(folder, capsys, options, message):
    assert caption(folder, *options) == 2
    refusal = [line for line in capsys.readouterr().err.splitlines() if "tempera-data" in line]
    assert len(refusal) == 1 and refusal[0].startswith("tempera-data caption: ")
    assert message in refusal[0]
    assert not list(folder.glob("*.txt"))


def test_a_missing_folder_and_a_held_lock_exit_2(tagger, folder, tmp_path, capsys):
    assert caption(tmp_path / "nowhere", "--captioner", "wd-tagger",
                   "--model", str(tagger)) == 2
    assert "does not exist" in capsys.readouterr().err
    (folder / LOCK_NAME).write_text(json.dumps(  # a job of this process (alive) holds it
        {"kind": "mask", "pid": os.getpid(), "host": socket.gethostname(), "started": "now"}))
    assert caption(folder, "--captioner", "wd-tagger", "--model", str(tagger)) == 2
    assert "is in use by a mask job" in capsys.readouterr().err
    assert not list(folder.glob("*.txt"))


def test_ctrl_c_finishes_the_batch_and_exits_130_then_the_rerun_continues(
        tagger, folder, monkeypatch, capsys):
    """SIGINT arrives as the first image is done: its batch is written, the job stops."""
    real = cli.COMMANDS["caption"]

    def interrupted(args, hooks, stop):
        def progress(progress):
            hooks.progress(progress)
            if progress.done == 1:
                os.kill(os.getpid(), signal.SIGINT)  # main's handler sets the stop event
        return real.run(args, JobHooks(progress=progress, status=hooks.status), stop)

    monkeypatch.setitem(cli.COMMANDS, "caption", cli.Command(real.help, real.add_options,
                                                             interrupted))
    options = ("--captioner", "wd-tagger", "--model", str(tagger), "--batch-size", "2")
    assert caption(folder, *options) == 130
    out, err = capsys.readouterr()
    assert "SIGINT: finishing the batch" in err and "continue where it stopped" in out
    assert sorted(p.name for p in folder.glob("*.txt")) == ["0.txt", "1.txt"]
    monkeypatch.setitem(cli.COMMANDS, "caption", real)
    assert caption(folder, *options) == 0
    assert "2 image(s) were done by the earlier, stopped job" in capsys.readouterr().out
    assert (folder / "2.txt").exists()
