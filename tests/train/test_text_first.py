"""The text encoder loaded first and alone (train/setup/text_first.py, issue 56 item 2): with
every caption cached up front, a Klein or Z-Image run loads Qwen3, caches every caption and
prompt, releases it, and only then loads the transformer, so the two are never in RAM together.

A spy on `from_pretrained` of Qwen3Model and of both transformer classes keeps a weak reference
to every model loaded and notes, at each load, how many of the other kind are still alive (no
`gc.collect()` in the spy: the run itself must have let go). The runs are tiny (64 px, 4 steps);
their captions carry a prefix of this session, so the first run encodes them for real."""
from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.trainer import train
from tests.train.test_resume import StopAt, run_json

STEPS = 2


class LiveModels:
    """Weak references to every text encoder and transformer a spy saw loaded, and at each
    load how many models of the other kind were alive: (kind, others alive)."""

    def __init__(self) -> None:
        self.refs: dict[str, list[weakref.ref]] = {"encoder": [], "transformer": []}
        self.loads: list[tuple[str, int]] = []

    def alive(self, kind: str) -> int:
        return sum(ref() is not None for ref in self.refs[kind])

    def start(self) -> None:
        """Forget the earlier runs' models (collected first: they are done)."""
        gc.collect()
        assert self.alive("encoder") == self.alive("transformer") == 0
        self.loads.clear()


class LoadSpy(LiveModels):
    """`LiveModels` of the loads through `from_pretrained` (Qwen3 and both transformers)."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        from diffusers import Flux2Transformer2DModel, ZImageTransformer2DModel
        from transformers import Qwen3Model
        super().__init__()
        for cls, kind in ((Qwen3Model, "encoder"), (Flux2Transformer2DModel, "transformer"),
                          (ZImageTransformer2DModel, "transformer")):
            mp.setattr(cls, "from_pretrained", classmethod(self._spy(
                cls.from_pretrained.__func__, kind)))

    def _spy(self, original, kind: str):
        other = "transformer" if kind == "encoder" else "encoder"

        def load(cls, *args, **kwargs):
            self.loads.append((kind, self.alive(other)))
            model = original(cls, *args, **kwargs)
            self.refs[kind].append(weakref.ref(model))
            return model
        return load


def _config(cache: Path, out: Path, model_type: str, prefix: str, *overrides: str) -> Config:
    builtin = {"KLEIN": "builtin:tiny-klein", "ZIMAGE": "builtin:tiny-zimage"}[model_type]
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", "data.resolution=64",
        f'data.datasets=[{{"path": "builtin:shapes", "caption_prefix": "{prefix}"}}]',
        f"model.type={model_type}", f"model.path={builtin}", f"training.max_steps={STEPS}",
        "training.batch_size=2", "training.learning_rate=1e-2", "training.lora_rank=4",
        "training.lora_alpha=8", "logging.tensorboard=false", 'output.formats=["DIFFUSERS"]',
        "data.cache_latents=true", "data.cache_text_encoder_outputs=true",
        'sampling.prompts=["a red circle"]', "sampling.negative_prompt=blurry",
        "sampling.sampler=EULER", "sampling.steps=2", "sampling.guidance_scale=4", *overrides])


def _today(mp: pytest.MonkeyPatch) -> None:
    """The whole model loaded at once, as before text-first (the order's one switch)."""
    from modules.train.setup import prepare
    mp.setattr(prepare, "text_encoder_first", lambda config: "the order before it")


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory):
    """Every run the tests read: per family the text-first run and the same run loaded all at
    once; for Klein also a run stopped at step 2 and resumed, and one with the cache off.
    (name -> (output folder, callbacks, the spy's loads))."""
    root = tmp_path_factory.mktemp("text-first")
    prefix = f"tf{root.name}"  # this session's captions: encoded for real by the first run
    done = {}
    with pytest.MonkeyPatch.context() as mp:
        spy = LoadSpy(mp)

        def run(name: str, model_type: str, *overrides: str, today: bool = False,
                stop_at: int | None = None):
            spy.start()
            out = root / name
            config = _config(tempera_cache, out, model_type, prefix, *overrides)
            with pytest.MonkeyPatch.context() as order:
                if today:
                    _today(order)
                callbacks = RecordingCallbacks()
                if stop_at is not None:
                    commands = TrainerCommands()
                    train(config, StopAt(commands, stop_at), commands)
                    config.training.resume_from = "latest"
                    spy.start()
                result = train(config, callbacks)
            assert result.status == "finished"
            done[name] = (out, callbacks, list(spy.loads))

        run("klein", "KLEIN")
        run("klein-today", "KLEIN", today=True)
        run("klein-resumed", "KLEIN", "output.backup_every_steps=1", stop_at=1)
        run("klein-uncached", "KLEIN", "data.cache_text_encoder_outputs=false")
        # Z-Image's with 8-bit storage: the encoder stored as prepare_trainable stores it
        run("zimage", "ZIMAGE", "model.weight_storage=INT8")
        run("zimage-today", "ZIMAGE", "model.weight_storage=INT8", today=True)
    return done


@pytest.mark.parametrize("name", ["klein", "zimage"])
def test_the_encoder_is_gone_before_the_transformer_loads(runs, name):
    out, callbacks, loads = runs[name]
    assert loads == [("encoder", 0), ("transformer", 0)]  # one encoder, released first
    said = [s for s in callbacks.statuses if "released before the model loads" in s]
    assert len(said) == 1, callbacks.statuses
    record = run_json(out)
    assert record["placement"]["text_encoder"]["device"] == "cpu"


@pytest.mark.parametrize("name", ["klein", "zimage"])
def test_the_losses_are_those_of_the_whole_model_loaded_at_once(runs, name):
    _, _, today_loads = runs[f"{name}-today"]
    assert today_loads == [("transformer", 0), ("encoder", 1)]  # the old order: together
    first, today = run_json(runs[name][0]), run_json(runs[f"{name}-today"][0])
    assert len(first["losses"]) == STEPS and all(map(math.isfinite, first["losses"]))
    assert first["losses"] == today["losses"]


@pytest.mark.parametrize("name", ["klein", "zimage"])
def test_samples_are_drawn_from_the_cached_prompts(runs, name):
    out, callbacks, _ = runs[name]
    samples = sorted((out / "samples").glob("*.png"))
    assert len(samples) == 1 and callbacks.samples, samples
    # the prompt and the negative prompt were encoded before the model loaded
    [said] = [s for s in callbacks.statuses if "released before the model loads" in s]
    from PIL import Image
    today = sorted((runs[f"{name}-today"][0] / "samples").glob("*.png"))
    assert Image.open(samples[0]).tobytes() == Image.open(today[0]).tobytes()


def test_a_resumed_run_does_not_load_the_encoder_and_continues_the_run(runs):
    out, callbacks, loads = runs["klein-resumed"]
    assert loads == [("transformer", 0)]  # every caption on disk: the encoder never loads
    assert any("the text encoder is not loaded" in s for s in callbacks.statuses)
    record, whole = run_json(out), run_json(runs["klein"][0])
    assert record["resume_count"] == 1 and record["losses"] == whole["losses"]


def test_a_run_without_the_cache_loads_the_model_at_once_and_trains(runs):
    out, callbacks, loads = runs["klein-uncached"]
    assert loads == [("transformer", 0), ("encoder", 1)]
    assert not any("released" in s for s in callbacks.statuses)
    losses = run_json(out)["losses"]
    # captions encoded at each step, by the same encoder: the cached run's losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(run_json(runs["klein"][0])[
        "losses"]), rtol=1e-4, atol=1e-5)
    assert len(sorted((out / "samples").glob("*.png"))) == 1


def test_a_caption_not_cached_before_the_encoder_was_released_is_refused_by_name():
    from modules.model_types import ModelType
    from modules.models.bundle import ModelBundle
    from modules.train.recipe.text_cache import TextEncoderCache
    cache = TextEncoderCache(ModelBundle(ModelType.KLEIN, Path("."), None, None, {}, {}, None),
                             torch.device("cpu"))
    assert cache.encoders_left()  # released: samples take the cached prompts
    with pytest.raises(ValueError, match="'a blue square'.*data.cache_text_encoder_outputs"):
        cache.encode(["a blue square"])


def test_the_encoder_files_key_follows_the_files_and_a_damaged_note_is_a_miss(tmp_path):
    from modules.train.recipe.text_store import (encoder_files_key, known_identity,
                                                 remember_identity)
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text('{"layers": 2}')
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    names, load = ["text_encoder", "tokenizer"], {"model_type": "KLEIN"}
    key = encoder_files_key(tmp_path, names, load)
    assert key == encoder_files_key(tmp_path, names, load)
    assert key != encoder_files_key(tmp_path, names, {"model_type": "ZIMAGE"})
    (tmp_path / "text_encoder" / "config.json").write_text('{"layers": 3}')
    assert encoder_files_key(tmp_path, names, load) != key
    root = tmp_path / "cache"
    assert known_identity(root, key) is None
    remember_identity(root, key, "abc")
    assert known_identity(root, key) == "abc"
    (root / "by-files" / f"{key}.json").write_text("not json")
    assert known_identity(root, key) is None  # the encoder is loaded and its identity computed
