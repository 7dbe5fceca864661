"""A stop is prompt (scripts/train.py as a process, real SIGTERM): during sampling it waits for
one denoising step, not the whole sampling pass; during latent caching for one batch of
images. Then the normal stop path runs and the command exits 143."""
from __future__ import annotations

import hashlib
import json
import signal
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

    # sampling at step 2 begins one step after the step-1 backup (its own backup follows it)
    assert wait_for(lambda: bool(list_backups(output))), proc.communicate()
    sampling_began = time.monotonic()
    assert wait_for(lambda: bool(sample_files()) or proc.poll() is not None), proc.communicate()
    one_prompt = time.monotonic() - sampling_began  # over-estimates: sampling began earlier
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _, err = proc.communicate(timeout=600)
    to_exit = time.monotonic() - signalled
    assert proc.returncode == 143, err
    assert len(sample_files()) < len(PROMPTS), "the sampling pass was not cut short"
    # the remaining pass would take about 3 prompts; the stop took well under half of one
    assert to_exit < one_prompt / 2, (to_exit, one_prompt)
    record = json.loads((output / "run.json").read_text())
    assert record["status"] == "stopped"
    step, folder = list_backups(output)[-1]
    assert step == record["steps_done"] == SAMPLE_AT
    verify_backup(folder)  # intact (written by the schedule right after the cut sampling)


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
