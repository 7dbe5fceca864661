"""ComfyUI's split files load text first too (train/setup/text_first.py): a Klein run named
by its three files with its captions cached loads Qwen3 from model.text_encoder_path alone,
caches every caption and prompt, releases it, and only then reads the diffusion-model and VAE
files; a second run finds every caption by the files' key and never loads Qwen3.

A spy on the split loaders (`split_files.load_qwen3`, `klein_files.load_split_rest`) keeps a
weak reference to each model and notes, at each load, how many of the other kind are alive.
Over 10 s: three tiny Klein runs (64 px, 2 steps) from the tiny model written as split files,
one each for the order, the order before it, and the cached case."""
from __future__ import annotations

import gc
import math
import weakref

import pytest

from modules.config import Config, apply_overrides
from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.models.test_klein_files import comfyui_files, klein_folder  # noqa: F401 - fixtures
from tests.train.test_resume import run_json


class SplitSpy:
    """(kind, others alive) at each load of Qwen3 or of the diffusion model from a file."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        from modules.models import klein_files, split_files
        self.refs: dict[str, list[weakref.ref]] = {"encoder": [], "transformer": []}
        self.loads: list[tuple[str, int]] = []
        qwen3, rest = split_files.load_qwen3, klein_files.load_split_rest

        def load_qwen3(*args, **kwargs):
            self.loads.append(("encoder", self.alive("transformer")))
            encoder = qwen3(*args, **kwargs)
            self.refs["encoder"].append(weakref.ref(encoder))
            return encoder

        def load_split_rest(*args, **kwargs):
            self.loads.append(("transformer", self.alive("encoder")))
            transformer, vae = rest(*args, **kwargs)
            self.refs["transformer"].append(weakref.ref(transformer))
            return transformer, vae
        mp.setattr(split_files, "load_qwen3", load_qwen3)
        mp.setattr(klein_files, "load_split_rest", load_split_rest)

    def alive(self, kind: str) -> int:
        return sum(ref() is not None for ref in self.refs[kind])

    def start(self) -> None:
        gc.collect()
        assert self.alive("encoder") == self.alive("transformer") == 0
        self.loads.clear()


def _config(cache, out, files: dict, folder, prefix: str) -> Config:
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", "data.resolution=64",
        f'data.datasets=[{{"path": "builtin:shapes", "caption_prefix": "{prefix}"}}]',
        "model.type=KLEIN", *[f"{field}={path}" for field, path in files.items()],
        f"model.config_path={folder}", f"model.tokenizer_path={folder}",
        "training.max_steps=2", "training.batch_size=2", "training.learning_rate=1e-2",
        "training.lora_rank=4", "logging.tensorboard=false", "data.cache_latents=true",
        "data.cache_text_encoder_outputs=true", 'sampling.prompts=["a red circle"]',
        "sampling.sampler=EULER", "sampling.steps=2", "sampling.guidance_scale=4"])


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory, comfyui_files, klein_folder):  # noqa: F811
    """name -> (output folder, callbacks, the spy's loads): "first" (text first),
    "together" (the whole model at once, as before), "cached" (every caption on disk)."""
    _, files = comfyui_files
    root = tmp_path_factory.mktemp("text-first-split")
    prefix = f"ts{root.name}"
    done = {}
    with pytest.MonkeyPatch.context() as mp:
        spy = SplitSpy(mp)
        for name in ("first", "together", "cached"):
            spy.start()
            with pytest.MonkeyPatch.context() as order:
                if name == "together":
                    from modules.train.setup import prepare
                    order.setattr(prepare, "text_encoder_first", lambda config: "before")
                callbacks = RecordingCallbacks()
                result = train(_config(tempera_cache, root / name, files, klein_folder, prefix),
                               callbacks)
            assert result.status == "finished"
            done[name] = (root / name, callbacks, list(spy.loads))
    return done


def test_split_files_load_qwen3_alone_and_release_it_first(runs):
    out, callbacks, loads = runs["first"]
    assert loads == [("encoder", 0), ("transformer", 0)]
    assert sum("released before the model loads" in s for s in callbacks.statuses) == 1
    record = run_json(out)
    assert "loaded first and alone" in record["memory_plan"]["ram"]["text_encoder_order"]
    assert len(sorted((out / "samples").glob("*.png"))) == 1


def test_the_losses_are_those_of_the_split_files_loaded_at_once(runs):
    assert runs["together"][2] == [("transformer", 0), ("encoder", 1)]  # the old order
    first, together = run_json(runs["first"][0]), run_json(runs["together"][0])
    assert len(first["losses"]) == 2 and all(map(math.isfinite, first["losses"]))
    assert first["losses"] == together["losses"]


def test_a_run_whose_captions_are_cached_never_loads_the_encoder_file(runs):
    out, callbacks, loads = runs["cached"]
    assert loads == [("transformer", 0)]
    assert any("the text encoder is not loaded" in s for s in callbacks.statuses)
    assert run_json(out)["losses"] == run_json(runs["first"][0])["losses"]
