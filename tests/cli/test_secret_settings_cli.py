"""A token in a run's settings (scripts/train.py as a process): the run warns naming the field
and trains with the value as given, but no file it writes holds the value: config.json,
run.json, backups, saved weights' metadata, samples' folder, TensorBoard logs. A resume with
the same settings sees no difference."""
from __future__ import annotations

import json
import signal

from modules.train.state.backup_files import list_backups
from tests.cli.test_damaged_backup_cli import train_process
from tests.cli.test_resume_cli import wait_for
from tests.util.test_library_noise import assert_no_library_noise
from tests.util.test_secrets import HF


def test_a_token_in_a_prompt_is_warned_about_and_never_written(tmp_path, tempera_cache):
    config = tmp_path / "config.json.in"
    config.write_text(json.dumps({
        "general": {"cache_dir": str(tempera_cache)},
        "data": {"resolution": 64},
        "training": {"max_steps": 40, "batch_size": 2, "learning_rate": 1e-3},
        "sampling": {"prompts": ["a red circle", f"a blue square {HF}"], "steps": 2,
                     "every_steps": 1},
        "logging": {"tensorboard": True},
        "output": {"dir": "run", "backup_every_steps": 1, "save_every_steps": 1},
    }))
    output = tmp_path / "run"
    proc = train_process(config)
    assert wait_for(lambda: len(list_backups(output)) >= 1), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err
    assert_no_library_noise(out + err)  # transformers' torchvision warnings, torchao's noise
    assert "warning: sampling.prompts[1] looks like it holds a Hugging Face token" in err, err
    assert HF not in err
    written = [p for p in output.rglob("*") if p.is_file()]
    kinds = {p.name for p in written}
    assert {"config.json", "run.json", "backup.json", "tensors.safetensors",
            "pytorch_lora_weights.safetensors"} <= kinds, kinds
    assert any("events.out.tfevents" in name for name in kinds), kinds
    holding = [str(p) for p in written if HF.encode() in p.read_bytes()]
    assert holding == []
    saved = json.loads((output / "config.json").read_text())
    assert saved["sampling"]["prompts"][1] == "a blue square [masked Hugging Face token]"

    resumed = train_process(config, "--resume", "latest", "--quiet", "--set",
                            "training.max_steps=" + str(list_backups(output)[-1][0] + 1))
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert_no_library_noise(out + err)
    finished_at = json.loads((output / "run.json").read_text())["steps_done"]
    assert (output / "samples" / f"step-{finished_at:06d}-0.png").is_file()  # it did sample
    record = json.loads((output / "run.json").read_text())
    assert not [c for c in record["resume_changed"] if c.startswith("sampling.prompts")]
    assert [str(p) for p in output.rglob("*") if p.is_file() and HF.encode() in p.read_bytes()
            ] == []
