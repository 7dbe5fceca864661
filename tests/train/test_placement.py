"""Text encoders and VAE off the device when their outputs are cached (train/recipe/placement.py,
issue 46 item 3): which components leave for which config (one rule for every family), where each
one is at every point of a real run on the tiny SD 1.5, the memory plan without them, and samples
from cached prompts that are the SD/SDXL pipelines' own.

The CPU has one device, so a real run here targets `cpu:0` and a recorder wraps each component's
`.to`: where a component is, is where the trainer's last `.to` sent it (`cpu:0`, the run's
device, or `cpu`), and the trainer's one question "is this module on the device"
(`text_cache.module_device`) is answered from that record. A move the trainer leaves out leaves
the record at the other device, and the assertions below fail."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.prompts import SamplePrompt
from modules.config.schema import PredictionType
from modules.model_types import ModelType
from modules.models.families import family_of
from modules.train.outputs.sampling import prompt_texts
from modules.train.recipe import text_cache
from modules.train.recipe.placement import borrowed, components_off_device
from modules.train.recipe.text_cache import TextEncoderCache
from modules.train.recipe.text_store import TextEmbeddingStore, encoder_identity

DEVICE = torch.device("cpu", 0)  # the run's device; `cpu` is where components are kept off it
CACHED = ("data.cache_latents=true", "data.cache_text_encoder_outputs=true")


def _config(*overrides: str) -> Config:
    return apply_overrides(Config(), list(overrides))


@pytest.mark.parametrize("model_type, encoders", [
    ("SD15", ["text_encoder"]), ("SD2", ["text_encoder"]),
    ("SDXL", ["text_encoder", "text_encoder_2"]), ("ZIMAGE", ["text_encoder"])])
def test_one_rule_for_every_family(model_type, encoders):
    assert components_off_device(_config(f"model.type={model_type}")) == {}
    off = components_off_device(_config(f"model.type={model_type}", *CACHED))
    assert sorted(off) == sorted([*encoders, "vae"])
    assert "data.cache_latents" in off["vae"][0] and "sampling" in off["vae"][1]
    only_latents = components_off_device(_config(f"model.type={model_type}", CACHED[0]))
    assert list(only_latents) == ["vae"]


def test_what_the_step_needs_stays():
    trained = _config(*CACHED, "training.method=FINE_TUNE", "components.text_encoder.train=true")
    assert list(components_off_device(trained)) == ["vae"]
    shuffled = _config(*CACHED, 'data.datasets=[{"path": "builtin:shapes", '
                                '"shuffle_tags": true}]')
    assert list(components_off_device(shuffled)) == ["vae"]


def test_borrowed_moves_in_and_back_also_when_the_block_raises():
    moves: list[torch.device] = []

    class Spy(torch.nn.Linear):
        def to(self, *args, **kwargs):
            moves.append(torch.device(args[0]))
            return self
    with pytest.raises(RuntimeError, match="inside"):
        with borrowed({"m": Spy(2, 2)}, DEVICE):  # on `cpu`: it comes to `cpu:0`
            assert moves == [DEVICE]
            raise RuntimeError("inside")
    assert moves == [DEVICE, torch.device("cpu")]
    with borrowed({"m": Spy(2, 2)}, torch.device("cpu")):  # there already: no move
        pass
    assert moves == [DEVICE, torch.device("cpu")]


class Recorder:
    """Each component's `.to` target (`cpu:0` or `cpu`), and what every component's was at the
    moments the hooks below see."""

    def __init__(self) -> None:
        self.where: dict[str, str] = {}
        self.names: dict[int, str] = {}
        self.seen: dict[str, list[dict[str, str]]] = {}

    def install(self, bundle) -> None:
        for name, module in bundle.components().items():
            self.names[id(module)], self.where[name] = name, "cpu"
            module.to = self._wrap(name, module.to)
        hooks = {"text encoding": bundle.text_encoders["text_encoder"],
                 "vae encode": bundle.vae.encoder, "vae decode": bundle.vae.decoder,
                 "denoiser": bundle.denoiser}
        for moment, module in hooks.items():
            module.register_forward_pre_hook(self._snapshot(moment))

    def _wrap(self, name, original):
        def to(*args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)):
                self.where[name] = "device" if torch.device(target) == DEVICE else "cpu"
            return original(*args, **kwargs)
        return to

    def _snapshot(self, moment):
        def hook(module, args):
            label = moment
            if moment == "denoiser":
                label = "training step" if torch.is_grad_enabled() else "denoiser, no grad"
            self.seen.setdefault(label, []).append(dict(self.where))
        return hook

    def device_of(self, module) -> torch.device:
        return DEVICE if self.where.get(self.names.get(id(module), ""), "") == "device" \
            else torch.device("cpu")


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory, tempera_cache):
    """One real run on the tiny SD 1.5 with latents and captions cached: 2 steps, validation
    after step 2, one sample at the end. About 6 s on an idle machine, over 10 s under load
    (76 s measured on the shared 2-core machine, building the tiny model into a fresh session
    cache included): the only way to see each component's device at every point of a real run
    is one real run, shared by the two tests that read it."""
    from modules.train.recipe import recipe
    from modules.train.setup import prepare
    from modules.train.trainer import train
    recorder = Recorder()
    original = recipe.text_encoder_cache

    def with_recorder(prepared, bundle, device, callbacks):
        recorder.install(bundle)
        return original(prepared, bundle, device, callbacks)
    from modules.data.shapes import write_shapes
    folder = tmp_path_factory.mktemp("placement")
    out, images = folder / "out", folder / "images"
    # images of its own: latents another test of this session cached would skip the encoding
    # whose placement is checked
    write_shapes(images, count=12, size=64, seed=11)
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={out}", "data.resolution=64",
        f'data.datasets=[{{"path": "{images}"}}]',
        "training.max_steps=2", "training.batch_size=2", "training.learning_rate=1e-3",
        "logging.tensorboard=false", *CACHED, 'sampling.prompts=["a red circle"]',
        "sampling.steps=2", "validation.every_steps=2", "validation.split_ratio=0.25"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepare, "pick_device", lambda setting: DEVICE)
        patch.setattr(recipe, "text_encoder_cache", with_recorder)
        patch.setattr(text_cache, "module_device", recorder.device_of)
        result = train(config)
    return recorder, result, json.loads((Path(out) / "run.json").read_text(encoding="utf-8"))


def test_each_component_is_where_the_plan_says_at_every_point(cached_run):
    recorder, result, _ = cached_run
    assert result.status == "finished"
    seen = recorder.seen
    # captions are encoded first (all of them: none is encoded after), the encoder alone on
    # the device
    assert all(s == {"unet": "cpu", "text_encoder": "device", "vae": "cpu"}
               for s in seen["text encoding"])
    # then the latents, the VAE alone on the device
    assert seen["vae encode"][0] == {"unet": "cpu", "text_encoder": "cpu", "vae": "device"}
    # every training step: the denoiser alone
    assert len(seen["training step"]) == 2
    assert all(s == {"unet": "device", "text_encoder": "cpu", "vae": "cpu"}
               for s in seen["training step"])
    # validation's fixed batches borrow the VAE once; sampling borrows it to decode; the text
    # encoder never comes back (the cached prompts are used)
    assert seen["vae encode"][-1] == {"unet": "device", "text_encoder": "cpu", "vae": "device"}
    assert seen["vae decode"] == [{"unet": "device", "text_encoder": "cpu", "vae": "device"}]
    # validation's forwards score the denoiser without the VAE
    assert {"unet": "device", "text_encoder": "cpu", "vae": "cpu"} in seen["denoiser, no grad"]
    # and after the run, the VAE is back on the CPU
    assert recorder.where == {"unet": "device", "text_encoder": "cpu", "vae": "cpu"}


def test_the_run_record_says_where_each_component_lived(cached_run):
    _, _, record = cached_run
    placement = record["placement"]
    assert {name: p["device"] for name, p in placement.items()} == {
        "unet": "cpu", "text_encoder": "cpu", "vae": "cpu"}  # the run's device is a CPU
    assert "data.cache_latents" in placement["vae"]["why"]
    assert placement["unet"]["why"] == "needed at every step"
    assert "on the device" in placement["vae"] and "on the device" not in placement["unet"]


def test_the_memory_plan_drops_what_is_off(tiny_config):
    from modules.train.memory.memory_plan import plan_memory
    from modules.models.tiny import ensure_builtin_model
    path = ensure_builtin_model("builtin:tiny-sd15", tiny_config().general.cache_dir)
    kept, off = plan_memory(tiny_config(), path), plan_memory(tiny_config(*CACHED), path)
    sizes = {what.split(" ")[0]: size for what, size in kept.lines if " weights (" in what}
    assert sizes["text_encoder"] > 0 and sizes["vae"] > 0
    assert kept.total - off.total == sizes["text_encoder"] + sizes["vae"]
    dropped = [what for what, size in off.lines if size == 0 and "on the CPU" in what]
    assert [what.split(" ")[0] for what in dropped] == ["text_encoder", "vae"]


@pytest.mark.parametrize("model, negative", [("builtin:tiny-sd15", "a blue square"),
                                             ("builtin:tiny-sdxl", "a blue square"),
                                             ("builtin:tiny-sdxl", "")])
def test_samples_from_cached_prompts_are_the_pipelines_own(model, negative, tempera_cache,
                                                           tmp_path):
    """SD's and SDXL's pipelines handed the cached prompts draw the image they draw from the
    texts (SDXL's empty negative prompt: zeros, as its force_zeros_for_empty_prompt). The
    first case of each model is over 10 s where it builds that tiny model for the session."""
    from modules.models.tiny import ensure_builtin_model
    from modules.train.outputs.saving import build_pipeline
    model_type = ModelType.SDXL if "sdxl" in model else ModelType.SD15
    folder = ensure_builtin_model(model, tempera_cache)
    bundle = family_of(model_type).load_folder(folder, PredictionType.AUTO, torch.float32)
    config = _config(f"model.type={model_type.value}", f"model.path={model}")
    pipe = build_pipeline(bundle, config)
    pipe.set_progress_bar_config(disable=True)
    cache = TextEncoderCache(bundle, torch.device("cpu"),
                             TextEmbeddingStore(tmp_path, encoder_identity(bundle)))
    prompt = SamplePrompt("a red circle", negative, 64, 64, 0, 2, 4.0)

    def image(**arguments):
        return pipe(**arguments, height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images
    zeros = bool(pipe.config.get("force_zeros_for_empty_prompt", False))
    cached = prompt_texts(bundle, prompt, cache, zeros)
    assert "prompt_embeds" in cached and "prompt" not in cached
    torch.testing.assert_close(image(**cached), image(**prompt_texts(bundle, prompt)))


def test_the_refusal_and_check_offer_the_caching_lever(tiny_config, monkeypatch):
    from modules.config.problems import ConfigError
    from modules.models.tiny import ensure_builtin_model
    from modules.train.memory import memory_check
    from modules.train.memory.memory_plan import gib, plan_memory
    config = tiny_config()
    path = ensure_builtin_model("builtin:tiny-sd15", config.general.cache_dir)
    plan = plan_memory(config, path)
    saved = plan.total - plan_memory(tiny_config(*CACHED), path).total
    lever = ("data.cache_latents=true --set data.center_crop=true "
             "--set data.cache_text_encoder_outputs=true")
    assert lever in memory_check.fix_candidates(config)
    report = "\n".join(memory_check.levers_report(config, path, plan))
    assert f"--set {lever} saves {gib(saved)}" in report and "each sampling pass" in report
    cached = tiny_config(*CACHED)
    assert "text encoders and VAE off the GPU (their outputs cached): on" in "\n".join(
        memory_check.levers_report(cached, path, plan_memory(cached, path)))
    monkeypatch.setattr(memory_check, "card_memory", lambda device: memory_check.CardMemory(
        "Test GPU 1", 2 ** 20, 2 ** 20))
    with pytest.raises(ConfigError) as caught:
        memory_check.check_memory(config, path, torch.device("cpu"))
    assert f"--set {lever} saves {gib(saved)}" in str(caught.value)


@pytest.mark.parametrize("storage", ["INT8", "FLOAT8"])
def test_an_8_bit_stored_text_encoder_has_an_identity(tempera_cache, storage):
    """The 8 GB and 16 GB presets cache captions of int8-stored encoders (FLOAT8 before): the
    text store's key reads a stored weight's values and scales (it cannot be flattened), and
    differs from the bf16 encoder's (its embeddings differ)."""
    pytest.importorskip("torchao")
    from modules.models.tiny import ensure_builtin_model
    from modules.models.weight_storage import store_weights
    folder = ensure_builtin_model("builtin:tiny-sd15", tempera_cache)
    bundle = family_of(ModelType.SD15).load_folder(folder, PredictionType.AUTO, torch.bfloat16)
    encoder = bundle.text_encoders["text_encoder"]
    encoder.requires_grad_(False)
    plain = encoder_identity(bundle)
    assert store_weights(encoder, storage) > 0
    assert encoder_identity(bundle) != plain
    assert encoder_identity(bundle) == encoder_identity(bundle)
