"""`tempera-train`: exit codes, messages, and that exit 2 writes nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from modules.cli.train import main

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def small_config(tmp_path, tempera_cache):
    return _write(tmp_path / "run.json5", {
        "general": {"cache_dir": str(tempera_cache)},
        "data": {"resolution": 64},
        "training": {"max_steps": 2, "batch_size": 2},
        "sampling": {"prompts": []},
        "logging": {"tensorboard": False},
        "output": {"dir": "out"},
    })


def test_success_exits_0_and_paths_resolve_against_the_config_folder(small_config, capsys):
    assert main(["--config", str(small_config), "--quiet"]) == 0
    out = small_config.parent / "out"
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert "finished: 2 steps" in capsys.readouterr().out


def test_the_first_status_line_says_where_the_run_writes(tmp_path, tempera_cache, capsys,
                                                         monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    config = _write(tmp_path / "c.json", {
        "general": {"cache_dir": str(tempera_cache)}, "data": {"resolution": 64},
        "training": {"max_steps": 1, "batch_size": 2}, "sampling": {"prompts": []},
        "logging": {"tensorboard": False}, "output": {"dir": "{data}/output/demo"}})
    assert main(["--config", str(config)]) == 0
    out = tmp_path / "share" / "tempera" / "output" / "demo"
    assert (out / "run.json").is_file()
    first = capsys.readouterr().err.splitlines()[0]
    assert first == f"[tempera] output folder: {out}"


def test_invalid_config_exits_2_lists_every_problem_and_writes_nothing(tmp_path, capsys):
    config = _write(tmp_path / "bad.json", {
        "training": {"max_steps": -5, "batch_size": "four"},
        "compile": {"backend": "TURBO"},
        "modle": {},
        "output": {"dir": "out"},
    })
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    for expected in ("training.max_steps", "training.batch_size", "compile.backend",
                     "modle: expected a known key", "did you mean 'model'"):
        assert expected in err
    assert not (tmp_path / "out").exists()


def test_inconsistent_config_exits_2_and_writes_nothing(tmp_path, capsys, tempera_cache):
    config = _write(tmp_path / "c.json", {
        "general": {"cache_dir": str(tempera_cache)},
        "data": {"datasets": [{"path": "missing-folder"}]},
        "output": {"dir": "out"},
    })
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "data.datasets[0].path" in err and "no such folder" in err
    assert not (tmp_path / "out").exists()


def test_empty_dataset_is_a_config_error(tmp_path, capsys, tempera_cache):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "notes.txt").write_text("no images here")
    config = _write(tmp_path / "c.json", {
        "general": {"cache_dir": str(tempera_cache)},
        "data": {"datasets": [{"path": "images"}], "resolution": 64},
        "output": {"dir": "out"},
    })
    assert main(["--config", str(config)]) == 2
    assert "data.datasets" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_set_values_exit_2(small_config, capsys):
    code = main(["--config", str(small_config), "--set", "training.max_steps=lots",
                 "--set", "compile.nope=1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "training.max_steps" in err and "compile.nope" in err


def test_missing_and_malformed_config_files_exit_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text('{"training": {"max_steps": 3,}}')
    assert main(["--config", str(broken)]) == 2
    assert "line 1" in capsys.readouterr().err


def test_earlier_run_is_protected(small_config, capsys):
    assert main(["--config", str(small_config), "--quiet"]) == 0
    out = small_config.parent / "out"
    before = (out / "final" / "pytorch_lora_weights.safetensors").read_bytes()
    assert main(["--config", str(small_config), "--quiet"]) == 2
    assert "earlier run" in capsys.readouterr().err
    assert (out / "final" / "pytorch_lora_weights.safetensors").read_bytes() == before


def test_check_validates_without_training(small_config, capsys):
    assert main(["--config", str(small_config), "--check"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    assert "memory levers:" in out and "text encoders and VAE off the GPU" in out
    assert not (small_config.parent / "out").exists()


def test_check_says_each_lever_is_on_off_or_not_for_this_run_and_why(small_config, capsys):
    """Both caches on, and a dataset that shuffles its tags: the VAE leaves the GPU but the
    text encoder stays, and --check says why instead of "on, or not for this run"."""
    assert main(["--config", str(small_config), "--check", "--set", "data.cache_latents=true",
                 "--set", "data.cache_text_encoder_outputs=true",
                 "--set", "data.datasets[0].shuffle_tags=true"]) == 0
    out = capsys.readouterr().out
    levers = dict(line.strip().split(": ", 1)
                  for line in out.split("memory levers:\n", 1)[1].splitlines()
                  if line.startswith("  "))
    cached = levers["text encoders and VAE off the GPU (their outputs cached)"]
    assert cached.startswith("not for this run: the text encoders stay on the GPU: "
                             "data.datasets[0] (")
    assert cached.endswith("shuffle_tags) change their captions every epoch, so their outputs "
                           "cannot be cached; the VAE leaves it")
    assert levers["the fused backward pass (full fine-tunes)"] == (
        "not for this run: full fine-tunes only (a LoRA's gradients are small)")
    # this run is on the CPU, which runs both 8-bit storages; INT8 is the one the plan picks
    assert levers["frozen linear weights stored as int8"].startswith("off; --set model.weight_st")
    assert levers["frozen linear weights stored as float8"].startswith("off; --set model.weight")
    assert "the 8-bit storage the plan picks on the CPU: INT8" in out
    # and INT8 with every block offloaded, the two levers together (offload.py)
    assert levers["8-bit storage and block offload together"].startswith(
        "off; --set model.weight_storage=INT8 --set model.offload_blocks=")
    assert len(levers) == 8 and all(state == "on" or state.startswith(("off", "not for this "
                                                                       "run: "))
                                    for state in levers.values()), levers


def test_check_says_the_samples_and_compile_cost_of_several_resolutions(small_config, capsys):
    assert main(["--config", str(small_config), "--check", "--set", "data.resolutions=64,128",
                 "--set", "compile.backend=AOT_EAGER"]) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "48 samples x 2 resolutions (64 px: 48, 128 px: 48) = 96 samples per epoch" in text
    assert "compile: 2 shape set(s) (64 px: 1, 128 px: 1): FULL builds 1 denoiser graph(s)" \
        in text
    assert not (small_config.parent / "out").exists()


def test_failure_during_training_exits_1(small_config, capsys, monkeypatch):
    import modules.train.recipe.recipe as recipe_module

    def explode(run, batch, draws):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(recipe_module, "micro_step", explode)
    assert main(["--config", str(small_config), "--quiet"]) == 1
    assert "training failed at step 0" in capsys.readouterr().err


def test_script_runs_from_any_folder_and_documents_itself(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--help"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for text in ("--config", "--set", "--check", "Exit codes"):
        assert text in result.stdout


def test_check_reports_an_installed_torch_below_the_tested_floor(small_config, capsys,
                                                                 monkeypatch):
    import modules.runtime
    monkeypatch.setattr(modules.runtime, "MIN_TORCH", (99, 0))
    assert main(["--config", str(small_config), "--check"]) == 2
    err = capsys.readouterr().err
    assert "torch: expected torch >= 99.0" in err
    assert not (small_config.parent / "out").exists()


def test_stop_file_stops_the_run_with_a_save(small_config, tmp_path, capsys, monkeypatch):
    """The stop file is written by the run's own progress event at step 2, which then waits
    for the watcher (it looks once a second) to request the stop: the run stops after step 2
    whatever the machine's load. (A file present from the start raced the setup: under load
    the watcher's first look came before step 1, and a run stopped before its first step
    saves no weights.)"""
    import threading

    from modules.cli import headless
    from modules.events import TrainerCommands
    stop = tmp_path / "cancel"
    data = json.loads(small_config.read_text())
    data["training"]["max_steps"] = 100_000
    small_config.write_text(json.dumps(data))
    requested = threading.Event()
    request_stop, shown = TrainerCommands.request_stop, headless.TerminalCallbacks.on_progress

    def on_request(self):
        request_stop(self)
        requested.set()

    def on_progress(self, progress):
        shown(self, progress)
        if progress.step == 2:
            stop.touch()
            assert requested.wait(timeout=120), "the stop file watcher did not request a stop"

    monkeypatch.setattr(TrainerCommands, "request_stop", on_request)
    monkeypatch.setattr(headless.TerminalCallbacks, "on_progress", on_progress)
    assert main(["--config", str(small_config), "--progress-file", str(tmp_path / "p.json"),
                 "--stop-file", str(stop)]) == 0
    out = small_config.parent / "out"
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "stopped" and record["steps_done"] == 2
    assert (out / "final").is_dir()  # stopped with a save
    assert f"stop file {stop} appeared" in capsys.readouterr().err


def test_a_second_sigterm_aborts_says_so_exits_143_and_records_what_was_done(
        tmp_path, tempera_cache, capsys, monkeypatch):
    """Real signals, to this process, sent by the trainer's own progress event at step 2 (so
    nothing depends on timing): the first asks for the stop, the second aborts at once."""
    import os
    import signal

    from modules.cli import headless
    from modules.frontend import resume_offer
    from tests.cli.run_settings import backed_up_run
    config = _write(tmp_path / "c.json", backed_up_run(tempera_cache, "out", 40))
    shown = headless.TerminalCallbacks.on_progress

    def on_progress(self, progress):
        shown(self, progress)
        if progress.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # stop: finish the step, back up, save
            os.kill(os.getpid(), signal.SIGTERM)  # again: abort at once

    monkeypatch.setattr(headless.TerminalCallbacks, "on_progress", on_progress)
    assert main(["--config", str(config), "--quiet"]) == 143  # 128 + SIGTERM, as documented
    err = capsys.readouterr().err
    assert "aborted at step 2 while training" in err and "could not start" not in err
    assert "resume with:" in err
    output = tmp_path / "out"
    record = json.loads((output / "run.json").read_text())
    assert record["status"] == "aborted" and record["step"] == 2
    assert record["steps_done"] == 2 and len(record["losses"]) == 2
    assert record["aborted"].startswith("aborted at step 2")
    assert resume_offer(output, 40).backup_step == 1  # the abort wrote none of its own
    assert resume_offer(output, 40).can_resume
