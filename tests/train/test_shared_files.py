"""What the files a run writes for sharing say (issue 44): no absolute local path, the base
model by name (and hash, for a single-file base), and an rsLoRA kohya file whose metadata
alpha is the one its tensors hold.

Shared files are the weights folders (final/, checkpoints/, best/: the weights, their
metadata and the A1111 card) and the samples; the local records (run.json, config.json,
backups/, TensorBoard's logs) legitimately hold the run's paths and are not checked.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from modules.config import Config, apply_overrides
from modules.train.trainer import train

SHARED = ("final", "checkpoints", "best", "samples")


def shared_files(output: Path) -> list[Path]:
    return sorted(p for folder in SHARED for p in (output / folder).rglob("*") if p.is_file())


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory):
    """One LoRA run (both layouts, text encoder and rsLoRA on, a checkpoint and a sample) and
    one fine-tune (diffusers folder and single file), under the session's temporary root."""
    root = tmp_path_factory.mktemp("shared")

    def run(name: str, *overrides: str) -> Path:
        config = apply_overrides(Config(), [
            f"general.cache_dir={tempera_cache}", f"output.dir={root / name}",
            "data.resolution=64", "training.batch_size=2", "training.learning_rate=1e-3",
            "logging.tensorboard=false", *overrides])
        return train(config).output_dir

    lora = run("lora", "training.max_steps=2", "output.save_every_steps=1",
               "output.formats=diffusers,kohya", "components.text_encoder.train=true",
               "training.lora_rank=8", "training.lora_alpha=4", "training.use_rslora=true",
               'sampling.prompts=["a red circle"]', "sampling.steps=1")
    fine_tune = run("fine-tune", "training.max_steps=1", "training.method=FINE_TUNE",
                    "training.learning_rate=1e-5", "output.formats=diffusers,single_file",
                    "sampling.prompts=[]")
    return {"lora": lora, "fine_tune": fine_tune, "roots": local_roots(tempera_cache, root)}


def local_roots(*folders: Path) -> list[bytes]:
    """The local folders a shared file must not name, as the bytes a file would hold."""
    found = set()
    for folder in (*folders, Path.home()):
        for form in (str(folder), str(Path(folder).resolve())):
            if len(Path(form).parts) > 2:  # not "/" or "/root": too short to tell apart
                found.add(form.encode())
                found.add(json.dumps(form)[1:-1].encode())  # as escaped in a JSON string
    return sorted(found)


@pytest.mark.parametrize("run", ["lora", "fine_tune"])
def test_no_shared_file_names_a_local_folder(runs, run):
    """Every byte of every shared file (safetensors headers, JSON configs, cards, PNGs)."""
    files = shared_files(runs[run])
    assert any(p.suffix == ".safetensors" for p in files)
    for path in files:
        data = path.read_bytes()
        named = [root.decode() for root in runs["roots"] if root in data]
        assert not named, f"{path.relative_to(runs[run])} names {named}"


def test_lora_files_name_the_base_model(runs):
    final = runs["lora"] / "final"
    diffusers = metadata(final / "pytorch_lora_weights.safetensors")
    adapters = json.loads(diffusers["lora_adapter_metadata"])
    names = {k: v for k, v in adapters.items() if k.endswith("base_model_name_or_path")}
    assert names and set(names.values()) == {diffusers["ss_sd_model_name"]}
    assert diffusers["ss_sd_model_name"].startswith("tiny-sd15")  # the built-in's folder name
    kohya = metadata(final / "lora_kohya.safetensors")
    assert kohya["ss_sd_model_name"] == diffusers["ss_sd_model_name"]
    recorded = json.loads(kohya["tempera.config"])
    assert recorded["model"]["path"] == kohya["ss_sd_model_name"]
    assert recorded["output"]["dir"] == "lora"  # names, not the folders they were in


def test_an_rslora_kohya_file_says_the_alpha_its_tensors_hold(runs):
    path = runs["lora"] / "final" / "lora_kohya.safetensors"
    with safe_open(str(path), "pt") as f:
        alphas = {f.get_tensor(k).item() for k in f.keys() if k.endswith(".alpha")}
        meta = f.metadata()
    (alpha,) = alphas  # every layer's
    assert alpha == pytest.approx(4 * math.sqrt(8))  # alpha / sqrt(rank), times the rank
    assert float(meta["ss_network_alpha"]) == pytest.approx(alpha, rel=1e-6)
