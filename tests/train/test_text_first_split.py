"""ComfyUI's split files load text first too (train/setup/text_first.py): a Klein or Z-Image
run named by its three files with its captions cached loads Qwen3 from model.text_encoder_path alone,
caches every caption and prompt, releases it, and only then reads the diffusion-model and VAE
files; a second run finds every caption by the files' key and never loads Qwen3.

A spy on the split loaders (`split_files.load_qwen3`, each family's `load_split_rest`) keeps a
weak reference to each model and notes, at each load, how many of the other kind are alive.
Over 10 s: five tiny runs (64 px, 2 steps) from the tiny models written as split files: per
family the order and the order before it, and Klein's cached case."""
from __future__ import annotations

import math
import weakref

import pytest

from modules.config import Config, apply_overrides
from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.models.test_klein_files import comfyui_files, klein_folder  # noqa: F401 - fixtures
from tests.models.test_zimage_files import split_files  # noqa: F401 - a fixture
from tests.train.test_resume import run_json
from tests.train.test_text_first import LiveModels


class SplitSpy(LiveModels):
    """`LiveModels` of the loads of Qwen3 or of the diffusion model from a file."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        from modules.models import klein_files, zimage_files
        from modules.models import split_files as files
        super().__init__()
        qwen3 = files.load_qwen3

        def load_qwen3(*args, **kwargs):
            self.loads.append(("encoder", self.alive("transformer")))
            encoder = qwen3(*args, **kwargs)
            self.refs["encoder"].append(weakref.ref(encoder))
            return encoder

        def spied(rest):
            def load_split_rest(*args, **kwargs):
                self.loads.append(("transformer", self.alive("encoder")))
                transformer, vae = rest(*args, **kwargs)
                self.refs["transformer"].append(weakref.ref(transformer))
                return transformer, vae
            return load_split_rest
        mp.setattr(files, "load_qwen3", load_qwen3)
        for module in (klein_files, zimage_files):
            mp.setattr(module, "load_split_rest", spied(module.load_split_rest))


def _config(cache, out, model_type: str, files: dict, folder, prefix: str) -> Config:
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", "data.resolution=64",
        f'data.datasets=[{{"path": "builtin:shapes", "caption_prefix": "{prefix}"}}]',
        f"model.type={model_type}", *[f"{field}={path}" for field, path in files.items()],
        f"model.config_path={folder}", f"model.tokenizer_path={folder}",
        "training.max_steps=2", "training.batch_size=2", "training.learning_rate=1e-2",
        "training.lora_rank=4", "logging.tensorboard=false", "data.cache_latents=true",
        "data.cache_text_encoder_outputs=true", 'sampling.prompts=["a red circle"]',
        "sampling.sampler=EULER", "sampling.steps=2", "sampling.guidance_scale=4"])


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory, comfyui_files, klein_folder,  # noqa: F811
         split_files, zimage_folder):  # noqa: F811
    """name -> (output folder, callbacks, the spy's loads): per family "first" (text first)
    and "together" (the whole model at once, as before); Klein's "cached" (every caption on
    disk)."""
    _, paths = split_files
    zimage = {"model.path": paths["transformer"], "model.text_encoder_path": paths["text_encoder"],
              "model.vae_path": paths["vae"]}
    families = {"KLEIN": (comfyui_files[1], klein_folder), "ZIMAGE": (zimage, zimage_folder)}
    root = tmp_path_factory.mktemp("text-first-split")
    prefix = f"ts{root.name}"
    done = {}
    with pytest.MonkeyPatch.context() as mp:
        spy = SplitSpy(mp)
        for name in ("first", "together", "cached", "zimage-first", "zimage-together"):
            spy.start()
            files, folder = families["ZIMAGE" if name.startswith("zimage") else "KLEIN"]
            with pytest.MonkeyPatch.context() as order:
                if name.endswith("together"):
                    from modules.train.setup import prepare
                    order.setattr(prepare, "text_encoder_first", lambda config: "before")
                callbacks = RecordingCallbacks()
                model_type = "ZIMAGE" if name.startswith("zimage") else "KLEIN"
                result = train(_config(tempera_cache, root / name, model_type, files, folder,
                                       prefix), callbacks)
            assert result.status == "finished"
            done[name] = (root / name, callbacks, list(spy.loads))
    return done


@pytest.mark.parametrize("family", ["", "zimage-"])
def test_split_files_load_qwen3_alone_and_release_it_first(runs, family):
    out, callbacks, loads = runs[f"{family}first"]
    assert loads == [("encoder", 0), ("transformer", 0)]
    assert sum("released before the model loads" in s for s in callbacks.statuses) == 1
    record = run_json(out)
    assert "loaded first and alone" in record["memory_plan"]["ram"]["text_encoder_order"]
    assert len(sorted((out / "samples").glob("*.png"))) == 1


@pytest.mark.parametrize("family", ["", "zimage-"])
def test_the_losses_are_those_of_the_split_files_loaded_at_once(runs, family):
    # the old order
    assert runs[f"{family}together"][2] == [("transformer", 0), ("encoder", 1)]
    first, together = (run_json(runs[f"{family}{name}"][0]) for name in ("first", "together"))
    assert len(first["losses"]) == 2 and all(map(math.isfinite, first["losses"]))
    assert first["losses"] == together["losses"]


def test_a_run_whose_captions_are_cached_never_loads_the_encoder_file(runs):
    out, callbacks, loads = runs["cached"]
    assert loads == [("transformer", 0)]
    assert any("the text encoder is not loaded" in s for s in callbacks.statuses)
    assert run_json(out)["losses"] == run_json(runs["first"][0])["losses"]
