"""The run's inputs on disk, checked before anything is written (exit 2 from the CLI): the
family of a diffusers folder, missing component folders, damaged weights, and an output folder
that cannot be written or has no room."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modules.cli.train import main
from modules.model_types import ModelType
from modules.models.families.sd import detect_folder_type
from modules.models.tiny import ensure_builtin_model
from modules.train.setup.inputs import check_inputs


@pytest.fixture
def model_copy(tempera_cache, tmp_path):
    """A writable copy of a built-in tiny model folder."""
    def make(name: str) -> Path:
        target = tmp_path / name.split(":")[1]
        shutil.copytree(ensure_builtin_model(name, tempera_cache), target)
        return target
    return make


def problems(config) -> dict[str, str]:
    return {p.path: str(p) for p in check_inputs(config)}


@pytest.mark.parametrize("name, family", [("builtin:tiny-sd15", ModelType.SD15),
                                          ("builtin:tiny-sd2", ModelType.SD2),
                                          ("builtin:tiny-sdxl", ModelType.SDXL)])
def test_the_family_of_a_folder_comes_from_its_component_configs(tempera_cache, name, family):
    assert detect_folder_type(ensure_builtin_model(name, tempera_cache))[0] == family


def test_an_sd2_folder_under_the_default_sd15_type_is_refused_with_the_type_to_set(
        tiny_config, model_copy, tmp_path, capsys):
    folder = model_copy("builtin:tiny-sd2")  # model_index.json names the SD 1 pipeline class too
    config = tiny_config(f"model.path={folder}")
    found = problems(config)
    assert "set model.type=SD2" in found["model.type"]
    config_file = tmp_path / "c.json"
    config_file.write_text(json.dumps({"model": {"path": str(folder)},
                                       "output": {"dir": str(tmp_path / "out")}}))
    assert main(["--config", str(config_file)]) == 2
    assert "model.type=SD2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_component_folder_is_named(tiny_config, model_copy):
    folder = model_copy("builtin:tiny-sd15")
    shutil.rmtree(folder / "unet")
    message = problems(tiny_config(f"model.path={folder}"))["model.path"]
    assert "has no unet/ folder" in message and "config.json" not in message


def test_truncated_weights_are_found_before_loading(tiny_config, model_copy):
    folder = model_copy("builtin:tiny-sd15")
    [weights] = (folder / "unet").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-1000])
    message = problems(tiny_config(f"model.path={folder}"))["model.path"]
    assert str(weights) in message and "incomplete" in message


def test_an_output_folder_under_a_regular_file_is_refused(tiny_config, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    message = problems(tiny_config(f"output.dir={blocker / 'out'}"))["output.dir"]
    assert "is a file, so no folder can be made under it" in message


def test_a_read_only_output_folder_is_refused(tiny_config, tmp_path, monkeypatch):
    import modules.train.setup.inputs as inputs
    monkeypatch.setattr(inputs.os, "access", lambda path, mode: False)
    monkeypatch.setattr(inputs, "_read_only", lambda path: True)
    message = problems(tiny_config(f"output.dir={tmp_path / 'out'}"))["output.dir"]
    assert "read-only file system" in message


def test_an_output_disk_without_room_for_one_save_is_refused(tiny_config, model_copy,
                                                              tmp_path, monkeypatch):
    import modules.train.setup.inputs as inputs
    folder = model_copy("builtin:tiny-sd15")
    monkeypatch.setattr(inputs, "free_bytes", lambda path: 1000)
    config = tiny_config(f"model.path={folder}", f"output.dir={tmp_path / 'out'}",
                         "training.method=FINE_TUNE", 'output.formats=["DIFFUSERS"]')
    message = problems(config)["output.dir"]
    assert "MB needed" in message and "MB free" in message
    assert not (tmp_path / "out").exists()


def test_check_runs_every_input_check_a_start_runs(tmp_path, tempera_cache, capsys):
    images = tmp_path / "images"
    images.mkdir()
    (images / "only.png").write_bytes(b"not a png at all")
    config_file = tmp_path / "c.json"
    config_file.write_text(json.dumps({
        "general": {"cache_dir": str(tempera_cache)},
        "data": {"datasets": [{"path": str(images)}], "resolution": 64},
        "output": {"dir": str(tmp_path / "out")}}))
    assert main(["--config", str(config_file), "--check"]) == 2  # the only image is corrupt
    assert "data.datasets" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_error_at_run_start_is_one_line_not_a_traceback(tmp_path, tempera_cache, capsys,
                                                            monkeypatch):
    import modules.train.setup.start as start
    config_file = tmp_path / "c.json"
    config_file.write_text(json.dumps({
        "general": {"cache_dir": str(tempera_cache)}, "data": {"resolution": 64},
        "training": {"max_steps": 1}, "sampling": {"prompts": []},
        "output": {"dir": str(tmp_path / "out")}}))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device", str(tmp_path / "out" / "config.json"))

    monkeypatch.setattr(start, "atomic_write_text", disk_full)  # config.json is written first
    assert main(["--config", str(config_file), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the run could not start: OSError: [Errno 28]")
    assert not any("Traceback" in line for line in err)
    from modules.train.setup.output_lock import busy_message
    assert busy_message(tmp_path / "out") is None  # the failed start let the folder go


def test_leftovers_of_interrupted_saves_are_removed_at_the_next_start(tiny_config, tmp_path):
    from modules.events import RecordingCallbacks
    from modules.config.problems import ConfigError
    from modules.train.setup.output_lock import OutputLock
    from modules.train.trainer import train
    out = tmp_path / "out"
    # `.final.old` beside a final/ is the replaced one a finished swap had still to delete;
    # `.step-000008.old` alone is the last complete step-000008/ (a swap cut between its two
    # renames): that one is put back, never deleted (modules/util/atomic.py)
    (out / "final").mkdir(parents=True)
    leftovers = [out / ".final.k2j3.tmp", out / "checkpoints" / ".step-000010.x9.tmp",
                 out / ".final.old", out / "backups" / ".step-000004.q1.tmp"]
    interrupted = out / "checkpoints" / ".step-000008.old"
    for folder in [*leftovers, interrupted]:
        folder.mkdir(parents=True)
        (folder / "unet.safetensors").write_bytes(b"\0" * 300_000)
    (out / ".run.json.abcd.tmp").write_text("{}")
    config = tiny_config(f"output.dir={out}")
    lock = OutputLock(out).acquire()  # a live run's leftovers are never touched
    try:
        with pytest.raises(ConfigError):
            train(config)
        assert all(folder.exists() for folder in leftovers)
    finally:
        lock.release()
    assert interrupted.exists()
    callbacks = RecordingCallbacks()
    train(config, callbacks)
    assert not any(folder.exists() for folder in leftovers)
    assert not (out / ".run.json.abcd.tmp").exists()
    assert any("partly written saves" in s and "1.1 MB freed" in s for s in callbacks.statuses)
    restored = out / "checkpoints" / "step-000008" / "unet.safetensors"
    assert not interrupted.exists() and restored.stat().st_size == 300_000
    assert "restored step-000008/: a save that was replacing it was interrupted before the new "\
           "one was in place" in callbacks.statuses
