"""Checkpoints a run keeps: saved every N steps and every N epochs, the oldest removed beyond
output.keep_checkpoints (never final/, backups or the user's own folders), the same ones after
a resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.state.backup_files import list_backups
from modules.train.outputs.checkpoints import due_checkpoint, rotate_checkpoints
from modules.train.state.resume_offer import SAVED_STEP_FILE
from modules.train.trainer import train
from tests.train.test_resume import StopAt

CAPTIONS = ["red, circle, plain", "red, square", "blue, circle", "red, triangle, plain",
            "green, circle"]


def caption_folder(folder: Path, captions: list[str] = CAPTIONS) -> Path:
    """One small noise PNG per caption, with the caption in a same-name .txt file (written
    once: PIL's noise is not seeded, and runs compared with each other need the same images)."""
    if folder.is_dir():
        return folder
    folder.mkdir(parents=True)
    for i, caption in enumerate(captions):
        Image.effect_noise((64, 64), 20 + i).convert("RGB").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(caption, encoding="utf-8")
    return folder


def epoch_config(tiny_config, tmp_path: Path, *overrides: str):
    """5 images, batch 1, accumulation 2: 3 optimizer steps per epoch (the last window of
    each epoch is one micro-batch), 3 epochs = 9 steps."""
    images = caption_folder(tmp_path / "images")
    return tiny_config(f"data.datasets[0].path={images}", "training.batch_size=1",
                       "training.gradient_accumulation=2", "training.max_steps=0",
                       "training.epochs=3", *overrides)


def saved(output: Path) -> dict[str, int]:
    root = output / "checkpoints"
    return {folder.name: json.loads((folder / SAVED_STEP_FILE).read_text())["step"]
            for folder in sorted(root.iterdir()) if (folder / SAVED_STEP_FILE).is_file()}


def run_json(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


@pytest.mark.parametrize("args, expected", [
    # (step, total, epoch, batches_done, batches/epoch, every_steps, every_epochs, asked)
    ((3, 9, 0, 5, 5, 0, 1, False), "epoch-000001"),   # epoch 1 complete after a short window
    ((2, 9, 0, 4, 5, 0, 1, False), None),             # mid-epoch
    ((6, 9, 1, 5, 5, 0, 2, False), "epoch-000002"),   # every 2nd epoch
    ((3, 9, 0, 5, 5, 0, 2, False), None),             # epoch 1 is not a 2nd
    ((9, 9, 2, 5, 5, 0, 1, False), None),             # the last step: final/ holds it
    ((6, 9, 1, 5, 5, 3, 1, False), "epoch-000002"),   # due by both: saved once, epoch name
    ((4, 9, 1, 2, 5, 2, 1, False), "step-000004"),
    ((9, 9, 2, 5, 5, 3, 0, True), "step-000009"),     # "save now" at the last step still saves
    ((5, 5, 1, 3, 10, 0, 1, False), None),            # max_steps ends mid-epoch: no epoch save
])
def test_due_checkpoint(args, expected):
    assert due_checkpoint(*args) == expected


def test_epoch_checkpoints_with_accumulation_and_the_step_of_each_in_run_json(tiny_config,
                                                                             tmp_path):
    result = train(epoch_config(tiny_config, tmp_path, "output.save_every_epochs=1"))
    assert result.steps == 9
    assert saved(result.output_dir) == {"epoch-000001": 3, "epoch-000002": 6}
    assert run_json(result.output_dir)["checkpoints"] == {
        "epoch-000001": {"step": 3, "epoch": 1}, "epoch-000002": {"step": 6, "epoch": 2}}
    assert (result.output_dir / "final" / SAVED_STEP_FILE).is_file()


def test_epoch_checkpoints_stop_where_max_steps_ends_the_run(tiny_config, tmp_path):
    # 7 steps: epochs end at steps 3 and 6; the third epoch is cut at step 7
    result = train(epoch_config(tiny_config, tmp_path, "training.max_steps=7",
                                "output.save_every_epochs=1", "output.save_every_steps=4"))
    assert saved(result.output_dir) == {"epoch-000001": 3, "step-000004": 4, "epoch-000002": 6}


def test_keep_checkpoints_removes_exactly_the_oldest_and_nothing_else(tiny_config, tmp_path):
    config = epoch_config(tiny_config, tmp_path, "output.save_every_steps=1",
                          "output.keep_checkpoints=2", "output.backup_every_steps=2",
                          "output.keep_backups=10")
    out = Path(config.output.dir)
    own = out / "checkpoints" / "my-favourite"            # the user's own folder
    unmarked = out / "checkpoints" / "step-000000"        # named like ours, but no marker
    for folder in (own, unmarked):
        folder.mkdir(parents=True)
        (folder / "weights.bin").write_bytes(b"mine")
    result = train(config)
    assert saved(out) == {"step-000007": 7, "step-000008": 8}
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "my-favourite", "step-000000", "step-000007", "step-000008"]
    assert (own / "weights.bin").read_bytes() == b"mine"
    assert (unmarked / "weights.bin").read_bytes() == b"mine"
    assert (out / "final" / SAVED_STEP_FILE).is_file()
    assert [step for step, _ in list_backups(out)] == [2, 4, 6, 8, 9]  # 9: the run's end
    record = run_json(out)
    assert list(record["checkpoints"]) == ["step-000007", "step-000008"]
    assert record["checkpoints_removed"] == [f"step-{n:06d}" for n in range(1, 7)]
    assert not any("step-000006" in f for f in record["output_files"])
    assert result.steps == 9


def test_rotation_never_counts_a_later_checkpoint_left_from_before_a_resume(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 8):
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / SAVED_STEP_FILE).write_text(json.dumps({"step": step}))
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / SAVED_STEP_FILE).write_text(json.dumps({"step": 9}))
    # the run resumed at step 3 and just saved step 4: step 8 is not counted, 4 is kept
    assert rotate_checkpoints(tmp_path, 1, newest_step=4) == [root / "step-000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000004", "step-000008"]
    assert rotate_checkpoints(tmp_path, 0, newest_step=8) == []  # 0 keeps all
    assert (tmp_path / "final").is_dir()


def checkpoint_tensors(output: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted((output / "checkpoints").rglob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors[f"{path.relative_to(output)}:{key}"] = value
    return tensors


def test_resumed_run_saves_the_same_checkpoints_and_keeps_counting(tiny_config, tmp_path):
    settings = ("output.save_every_epochs=1", "output.save_every_steps=2",
                "output.keep_checkpoints=3")
    whole = epoch_config(tiny_config, tmp_path, *settings, f"output.dir={tmp_path / 'whole'}")
    train(whole)
    parts = epoch_config(tiny_config, tmp_path, *settings, f"output.dir={tmp_path / 'parts'}")
    commands = TrainerCommands()
    first = train(parts, StopAt(commands, 3), commands)  # stopped right at epoch 1's end
    assert first.status == "stopped"
    assert saved(tmp_path / "parts") == {"step-000002": 2, "epoch-000001": 3}
    parts.training.resume_from = "latest"
    train(parts, RecordingCallbacks())
    expected = {"step-000004": 4, "epoch-000002": 6, "step-000008": 8}
    assert saved(tmp_path / "whole") == expected == saved(tmp_path / "parts")
    want, have = checkpoint_tensors(tmp_path / "whole"), checkpoint_tensors(tmp_path / "parts")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)
    assert run_json(tmp_path / "parts")["checkpoints"] == run_json(tmp_path / "whole")[
        "checkpoints"]

