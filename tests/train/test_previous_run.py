"""What a fresh start in an output folder would remove: read from the disk, and exactly what
`clear_previous_run` removes (plus final/, which the new run's first save replaces)."""
from __future__ import annotations

import json
from pathlib import Path

from modules.train.outputs.previous_run import free_sibling, previous_run
from modules.train.setup.start import clear_previous_run
from modules.train.state.resume_offer import SAVED_STEP_FILE


def finished_run(output: Path, step: int = 16) -> None:
    """A folder as a finished LoRA run leaves it: final/, backups, samples, logs, checkpoints."""
    (output / "final").mkdir(parents=True)
    (output / "final" / "lora.safetensors").write_bytes(b"w")
    (output / "final" / SAVED_STEP_FILE).write_text(json.dumps({"step": step}))
    for backup in (5, 10, step):
        folder = output / "backups" / f"step-{backup:06d}"
        folder.mkdir(parents=True)
        (folder / "backup.json").write_text("{}")
        (folder / "tensors.safetensors").write_bytes(b"")
    (output / "samples").mkdir()
    for index in range(3):
        (output / "samples" / f"step-{step:06d}-{index}.png").write_bytes(b"")
    (output / "tensorboard").mkdir()
    (output / "checkpoints" / "step-000008").mkdir(parents=True)
    (output / "checkpoints" / "step-000008" / SAVED_STEP_FILE).write_text('{"step": 8}')
    (output / "run.json").write_text(json.dumps({"status": "finished", "step": step}))


def test_a_finished_run_is_described_by_what_a_fresh_start_removes(tmp_path):
    output = tmp_path / "lora"
    finished_run(output)
    found = previous_run(output)
    assert found is not None and found.status == "finished" and found.step == 16
    assert found.final and found.final_step == 16 and found.backups == (5, 10, 16)
    assert found.samples == 3 and found.checkpoints == ("step-000008",)
    removed = found.removed()
    assert removed[0].startswith("final/ (the weights of step 16")
    assert "3 backups (step 5, 10, 16)" in removed and "3 samples (samples/)" in removed
    assert "1 checkpoint (step-000008)" in removed
    assert "TensorBoard logs (tensorboard/)" in removed
    assert found.describe().startswith(f"The run in {output} finished at step 16.")

    # what it names is what the overwrite removes (final/ stays until the new run saves)
    cleared = clear_previous_run(output)
    assert cleared and not (output / "backups").exists() and not (output / "samples").exists()
    after = previous_run(output)
    assert after is not None and after.removed() == [removed[0]]  # read again: final/ only


def test_nothing_to_remove_is_none_and_a_free_sibling_is_numbered(tmp_path):
    output = tmp_path / "lora"
    assert previous_run(output) is None           # no folder
    output.mkdir()
    (output / "run.json").write_text('{"status": "failed", "step": 0}')
    assert previous_run(output) is None           # a run that saved nothing
    assert free_sibling(output) == tmp_path / "lora-2"
    (tmp_path / "lora-2").mkdir()
    (tmp_path / "lora-2" / "run.json").write_text("{}")
    (tmp_path / "lora-3").mkdir()                  # empty: free
    assert free_sibling(output) == tmp_path / "lora-3"
    assert free_sibling(tmp_path / "lora-2") == tmp_path / "lora-3"  # not lora-2-2
