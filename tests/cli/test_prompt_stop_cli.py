"""A stop is prompt (scripts/train.py as a process, real SIGTERM): during sampling it waits for
one denoising step, not the whole sampling pass; during validation for one forward, not the
whole pass; during latent caching for one batch of images. Then the normal stop path runs and
the command exits 143. Each test asserts on what was done (samples written, forwards scored,
steps recorded), not on how long it took."""
from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

from modules.train.state.backup import verify_backup
from modules.train.state.backup_files import list_backups
from tests.cli.test_damaged_backup_cli import train_process
from tests.cli.test_resume_cli import wait_for

PROMPTS = ["a red circle", "a blue square", "a green triangle", "a yellow star"]
SAMPLE_AT = 2


def write_config(folder: Path, cache: Path, **sections) -> Path:
    config = {
        "general": {"cache_dir": str(cache)},
        "data": {"resolution": 64},
        "training": {"max_steps": 40, "batch_size": 2, "learning_rate": 1e-3},
        "sampling": {"prompts": []},
        "logging": {"tensorboard": False},
        "output": {"dir": "run", "backup_every_steps": 1},
        "validation": {},
    }
    for name, values in sections.items():
        config[name].update(values)
    path = folder / "config.json.in"
    path.write_text(json.dumps(config))
    return path


def test_sigterm_during_sampling_waits_for_one_denoising_step_not_the_pass(tmp_path,
                                                                          tempera_cache):
    # 500 denoising steps per prompt: one prompt takes seconds to tens of seconds, the pass
    # four times that. The test times the first prompt, stops during the second.
    config = write_config(tmp_path, tempera_cache,
                          sampling={"prompts": PROMPTS, "steps": 500,
                                    "every_steps": SAMPLE_AT})
    output = tmp_path / "run"
    samples = output / "samples"
    proc = train_process(config, "--quiet")

    def sample_files() -> list[Path]:
        return sorted(samples.glob(f"step-{SAMPLE_AT:06d}-*.png")) if samples.is_dir() else []

    # the pass is on once its first sample is written: stop during the second prompt
    assert wait_for(lambda: bool(sample_files()) or proc.poll() is not None), proc.communicate()
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 143, err
    written = len(sample_files())
    assert written < len(PROMPTS), "the sampling pass was not cut short"
    assert f"cut short by Stop ({written} of {len(PROMPTS)} samples written)" in err
    record = json.loads((output / "run.json").read_text())
    assert record["status"] == "stopped"
    step, folder = list_backups(output)[-1]
    assert step == record["steps_done"] == SAMPLE_AT
    verify_backup(folder)  # intact (written by the schedule right after the cut sampling)


def test_sigterm_during_validation_waits_for_one_forward_not_the_pass(tmp_path, tempera_cache):
    """12 held-out images at 1,000 timesteps: 12,000 forwards, far more than a stop's few."""
    config = write_config(tmp_path, tempera_cache,
                          validation={"split_ratio": 0.25, "every_steps": 2,
                                      "timesteps": 1000, "batch_size": 1})
    output = tmp_path / "run"
    proc = train_process(config)  # not quiet: the status line says when the pass begins
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    assert wait_for(lambda: any("validating at step 2" in line for line in lines)
                    or proc.poll() is not None), "".join(lines)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)
    reader.join(timeout=60)
    err = "".join(lines)
    assert proc.returncode == 143, err
    record = json.loads((output / "run.json").read_text())
    cut = record["validation"]["cut_short"]
    assert cut["step"] == 2 and cut["forwards"] == 12 * 1000
    assert cut["forwards_scored"] < cut["forwards"], "the validation pass ran to its end"
    assert record["validation"]["history"] == []  # a cut pass is not a score
    assert record["status"] == "stopped" and record["steps_done"] == 2
    step, folder = list_backups(output)[-1]
    assert step == 2
    verify_backup(folder)


def noise_images(folder: Path, count: int, size: int) -> Path:
    """`count` different noise images (their content is new to the shared latent cache)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(int(hashlib.sha256(str(folder).encode()).hexdigest()[:8], 16))
    for i in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:04d}.png")
    return folder


def test_sigterm_during_latent_caching_stops_between_batches(tmp_path, tempera_cache):
    count = 400
    images = noise_images(tmp_path / "images", count, 64)
    config = write_config(tmp_path, tempera_cache,
                          data={"resolution": 64, "cache_latents": True,
                                "datasets": [{"path": str(images)}]})
    latents = tempera_cache / "latents"
    before = set(latents.glob("*.safetensors")) if latents.is_dir() else set()

    def new_latents() -> int:
        return len(set(latents.glob("*.safetensors")) - before) if latents.is_dir() else 0

    output = tmp_path / "run"
    proc = train_process(config, "--quiet")
    assert wait_for(lambda: new_latents() > 0 or proc.poll() is not None), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=600)
    to_exit = time.monotonic() - signalled
    assert proc.returncode == 143, err
    assert new_latents() < count, "latent caching ran to the end"
    assert to_exit < 30, to_exit
    record = json.loads((output / "run.json").read_text())
    assert record["status"] == "stopped" and record["stopped_during"] == "latent caching"
    assert not (output / "final").exists()  # nothing was trained, nothing is saved
