"""Textual inversion through the real trainer (docs/textual_inversion.md): only the new rows
train, the files load in diffusers (and ComfyUI, with --comfyui) as trained, the captions and
sample prompts carry the trigger word, A1111's own loader (with --a1111) reads the kohya
file as trained, the tokenizer's refusals, compile without recompiles.

One SD 1.5 run (3 steps), one SD 2 run and one SDXL run (2 steps each) are shared by the tests
that read them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.config import Config, apply_overrides
from modules.config.problems import ConfigError
from modules.events import RecordingCallbacks, TrainerCommands
from modules.model_types import MODEL_TYPES, ModelType
from modules.models.tiny import ensure_builtin_model
from modules.train.recipe.distributed import Distributed
from modules.train.recipe.recipe import TrainingRecipe
from modules.train.recipe.textual_inversion import token_names, with_trigger
from modules.train.setup.prepare import prepare_run
from modules.train.trainer import train

WORD = "<mychar>"
# The tiny tokenizer splits "person" into four pieces: the vectors start from their mean.
INITIALIZER = "person"


def ti_config(cache: Path, out: Path, model: ModelType, *extra: str) -> Config:
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", "data.resolution=64",
        "training.batch_size=2", "training.learning_rate=5e-2", "logging.tensorboard=false",
        f"model.type={model.value}", f"model.path={MODEL_TYPES[model].builtin}",
        "training.method=TEXTUAL_INVERSION", f"textual_inversion.placeholder={WORD}",
        f"textual_inversion.initializer={INITIALIZER}", "output.formats=diffusers,kohya",
        "sampling.prompts=[]", *extra])


def _base(model: ModelType, cache: Path) -> Path:
    return ensure_builtin_model(MODEL_TYPES[model].builtin, cache)


def _run_recipe(config: Config) -> dict:
    """Train through the recipe, keeping what the tests read: the bundle after training, the
    new rows as they started, the result and the run's sample prompts."""
    callbacks = RecordingCallbacks()
    recipe = TrainingRecipe(prepare_run(config, callbacks), callbacks, Distributed(),
                            TrainerCommands())
    run = recipe.setup()
    try:
        started = {name: enc.get_input_embeddings().weight.detach().clone()
                   for name, enc in run.bundle.text_encoders.items()}
        result = recipe.train()
    finally:
        recipe.close()
    return {"bundle": run.bundle, "started": started, "result": result,
            "prompts": [p.text for p in run.prompts]}


@pytest.fixture(scope="module")
def sd15(tempera_cache, tmp_path_factory):
    """Why over 10 s: one 3-step training run with a sample at its end, shared by the SD 1.5
    tests below."""
    out = tmp_path_factory.mktemp("ti-sd15")
    config = ti_config(tempera_cache, out / "out", ModelType.SD15, "training.max_steps=3",
                       "textual_inversion.vectors=2", 'sampling.prompts=["a red circle"]',
                       "sampling.steps=2")
    return {**_run_recipe(config), "base": _base(ModelType.SD15, tempera_cache),
            "config": config}


@pytest.fixture(scope="module")
def sd2(tempera_cache, tmp_path_factory):
    """SD 2.x's OpenCLIP-style text encoder (the tiny SD2's): a 2-step run without a sample,
    shared by the SD 2 tests (about 9 s with its base load on 2 CPU cores under other load)."""
    out = tmp_path_factory.mktemp("ti-sd2")
    config = ti_config(tempera_cache, out / "out", ModelType.SD2, "training.max_steps=2",
                       "textual_inversion.vectors=2")
    return {**_run_recipe(config), "base": _base(ModelType.SD2, tempera_cache),
            "config": config}


@pytest.fixture(scope="module")
def sdxl(tempera_cache, tmp_path_factory):
    """bfloat16 frozen weights: the float32 embedding feeds bfloat16 layers. (About 5 s: a
    2-step SDXL run, shared by the SDXL tests.)"""
    out = tmp_path_factory.mktemp("ti-sdxl")
    config = ti_config(tempera_cache, out / "out", ModelType.SDXL, "training.max_steps=2",
                       "textual_inversion.vectors=3", "model.weight_dtype=BFLOAT16")
    return {**_run_recipe(config), "base": _base(ModelType.SDXL, tempera_cache),
            "config": config}


def _new_ids(bundle, encoder: str, config: Config) -> list[int]:
    spec = MODEL_TYPES[bundle.model_type]
    tokenizer = bundle.tokenizers[spec.tokenizers[spec.text_encoders.index(encoder)]]
    return tokenizer.convert_tokens_to_ids(token_names(config))


def _base_modules(model: ModelType, folder: Path) -> dict[str, torch.nn.Module]:
    import diffusers
    pipe = getattr(diffusers, MODEL_TYPES[model].pipeline_class).from_pretrained(
        folder, local_files_only=True, **({"safety_checker": None}
                                          if model != ModelType.SDXL else {}))
    return {name: getattr(pipe, name) for name in MODEL_TYPES[model].components}


@pytest.mark.parametrize("which", ["sd15", "sd2", "sdxl"])
def test_only_the_new_rows_train_and_every_other_weight_stays_bit_for_bit(which, request):
    run = request.getfixturevalue(which)
    bundle, config = run["bundle"], run["config"]
    base = _base_modules(bundle.model_type, run["base"])
    for name, module in bundle.components().items():
        trained = dict(module.named_parameters())
        frozen_dtype = next(p.dtype for k, p in trained.items() if "token_embedding" not in k)
        for key, value in base[name].named_parameters():
            value = value.to(frozen_dtype).to(trained[key].dtype)  # as the run loaded it
            if key.endswith("token_embedding.weight"):
                new = _new_ids(bundle, name, config)
                old = trained[key][: value.shape[0]]
                assert trained[key].shape[0] == value.shape[0] + config.textual_inversion.vectors
                assert torch.equal(old, value), f"{name}: an old embedding row changed"
                assert min(new) == value.shape[0], "the new tokens are not the new rows"
                assert not torch.equal(trained[key][new], run["started"][name][new]), \
                    f"{name}: the new rows did not train"
            else:
                assert torch.equal(trained[key], value), f"{name}.{key} changed"


def test_new_rows_start_from_the_mean_of_the_initializer_word_pieces(sd15):
    bundle, config = sd15["bundle"], sd15["config"]
    tokenizer = bundle.tokenizers["tokenizer"]
    pieces = tokenizer(INITIALIZER, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1  # the case the decision is about
    base = _base_modules(ModelType.SD15, sd15["base"])["text_encoder"]
    mean = base.get_input_embeddings().weight[pieces].mean(dim=0)
    started = sd15["started"]["text_encoder"][_new_ids(bundle, "text_encoder", config)]
    assert torch.allclose(started, mean.expand_as(started))


def test_captions_and_sample_prompts_carry_the_trigger_word(sd15):
    config = sd15["config"]
    assert with_trigger(config, "a red circle") == f"{WORD} {WORD}_1, a red circle"
    assert with_trigger(config, f"photo of {WORD} smiling") == f"photo of {WORD} {WORD}_1 smiling"
    assert with_trigger(config, "") == ""  # caption dropout's unconditional caption
    assert sd15["prompts"] == [f"{WORD}, a red circle"]
    output = sd15["result"].output_dir
    assert list((output / "samples").glob("*.png")), "the end-of-run sample was not drawn"
    record = json.loads((output / "run.json").read_text())
    assert record["textual_inversion"]["tokens"] == [WORD, f"{WORD}_1"]
    assert record["textual_inversion"]["encoders"]["text_encoder"]["rows"] == \
        _new_ids(sd15["bundle"], "text_encoder", config)


def _trained_vectors(run, encoder: str) -> torch.Tensor:
    weight = run["bundle"].text_encoders[encoder].get_input_embeddings().weight
    return weight.detach()[_new_ids(run["bundle"], encoder, run["config"])].float()


@pytest.mark.parametrize("which", ["sd15", "sd2"])
def test_diffusers_load_textual_inversion_reads_both_files_as_trained(which, request):
    """SD 1.5's CLIP and SD 2's OpenCLIP-style encoder: both files, loaded by diffusers, give
    the trained rows and the prompt embeddings of the trained encoder."""
    from diffusers import StableDiffusionPipeline
    run = request.getfixturevalue(which)
    final = run["result"].output_dir / "final"
    assert {p.name for p in final.iterdir()} == {"learned_embeds.safetensors",
                                                 "mychar.safetensors", "tempera_step.json"}
    trained = _trained_vectors(run, "text_encoder")
    assert torch.equal(load_file(str(final / "mychar.safetensors"))["emb_params"], trained)
    prompt = f"{WORD} a red circle"
    # the trained encoder's own embeddings of the prompt, as training reads it
    bundle = run["bundle"]
    tokenizer = bundle.tokenizers["tokenizer"]
    tokens = tokenizer(with_trigger(run["config"], prompt), padding="max_length",
                       max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = bundle.text_encoders["text_encoder"](tokens)[0]
    for file, token in (("learned_embeds.safetensors", None), ("mychar.safetensors", WORD)):
        pipe = StableDiffusionPipeline.from_pretrained(run["base"], safety_checker=None,
                                                       local_files_only=True)
        pipe.load_textual_inversion(str(final / file), token=token)
        ids = pipe.tokenizer.convert_tokens_to_ids([WORD, f"{WORD}_1"])
        rows = pipe.text_encoder.get_input_embeddings().weight[ids]
        assert torch.equal(rows.float(), trained), file
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(prompt, "cpu", 1, False)
        assert torch.allclose(embeds, expected, atol=1e-5), file


def test_embedding_files_carry_the_trigger_word_and_the_run_in_metadata(sd15):
    final = sd15["result"].output_dir / "final"
    for name in ("learned_embeds.safetensors", "mychar.safetensors"):
        with safe_open(str(final / name), "pt") as f:
            meta = f.metadata()
        assert meta["tempera.trigger_word"] == WORD and meta["modelspec.trigger_phrase"] == WORD
        assert meta["tempera.vectors_per_token"] == "2" and meta["tempera.steps"] == "3"
        assert meta["tempera.base_model"].startswith("tiny-sd15")  # the name, never a path
        assert meta["modelspec.architecture"] == "stable-diffusion-v1/textual-inversion"
    assert set(load_file(str(final / "mychar.safetensors"))) == {"emb_params"}


def test_sdxl_files_hold_both_encoders_and_load_in_diffusers(sdxl):
    from diffusers import StableDiffusionXLPipeline
    final = sdxl["result"].output_dir / "final"
    a1111 = load_file(str(final / "mychar.safetensors"))
    assert set(a1111) == {"clip_l", "clip_g"}
    assert torch.equal(a1111["clip_l"], _trained_vectors(sdxl, "text_encoder"))
    assert torch.equal(a1111["clip_g"], _trained_vectors(sdxl, "text_encoder_2"))
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl["base"], local_files_only=True)
    pipe.load_textual_inversion(str(final), weight_name="learned_embeds.safetensors")
    pipe.load_textual_inversion(str(final), weight_name="learned_embeds_2.safetensors",
                                text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2)
    for encoder, tokenizer, name in ((pipe.text_encoder, pipe.tokenizer, "text_encoder"),
                                     (pipe.text_encoder_2, pipe.tokenizer_2, "text_encoder_2")):
        ids = tokenizer.convert_tokens_to_ids(token_names(sdxl["config"]))
        assert torch.equal(encoder.get_input_embeddings().weight[ids].float(),
                           _trained_vectors(sdxl, name))


def test_comfyui_load_embed_reads_the_a1111_files(comfyui, sd15, sd2, sdxl):
    import comfy.sd1_clip  # ComfyUI's embedding loader (tests/models/comfyui_harness.py)
    for run, keys in ((sd15, {"text_encoder": ("clip_l", 768)}),
                      (sd2, {"text_encoder": ("clip_h", 1024)}),
                      (sdxl, {"text_encoder": ("clip_l", 768),
                              "text_encoder_2": ("clip_g", 1280)})):
        folder = str(run["result"].output_dir / "final")
        for encoder, (key, _) in keys.items():
            width = run["bundle"].text_encoders[encoder].get_input_embeddings().weight.shape[1]
            loaded = comfy.sd1_clip.load_embed("mychar", folder, width, key)
            assert loaded is not None and torch.equal(loaded, _trained_vectors(run, encoder))


class _WebuiConditioner:
    """The two methods of the webui's loaded text conditioner (`shared.sd_model.
    cond_stage_model`) that A1111's embedding loading calls, on the run's own tokenizer and
    text encoders: `tokenize`, as A1111's CLIP wrapper does it (the first tokenizer, no start
    or end token), and `encode_embedding_init_text`, the token-embedding rows of a text (SDXL's
    conditioner puts its two encoders' side by side: CLIP-L's, then CLIP-G's)."""

    def __init__(self, bundle) -> None:
        spec = MODEL_TYPES[bundle.model_type]
        self.tokenizer = bundle.tokenizers[spec.tokenizers[0]]
        self.encoders = [bundle.text_encoders[name] for name in spec.text_encoders]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, truncation=False, add_special_tokens=False)["input_ids"]

    def encode_embedding_init_text(self, text: str, vectors: int) -> torch.Tensor:
        ids = self.tokenizer(text, max_length=vectors, return_tensors="pt",
                             add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return torch.cat([enc.get_input_embeddings()(ids).squeeze(0) for enc in self.encoders],
                             dim=1)


@pytest.mark.parametrize("which", ["sd15", "sd2", "sdxl"])
def test_a1111_loads_the_kohya_file_from_its_embeddings_folder_as_trained(
        a1111_textual_inversion, which, request, tmp_path):
    """A1111's own EmbeddingDatabase (pytest --a1111=PATH; tests/models/a1111_harness.py)
    loads the file from an embeddings folder, registers it under the file's name (its width
    is the loaded model's, so it is not skipped), with the run's vectors per token, the
    encoders' width (SDXL: CLIP-L's plus CLIP-G's, as A1111 counts it) and the trained rows;
    and a prompt that writes the name finds it."""
    from transformers import CLIPTextConfig
    run = request.getfixturevalue(which)
    bundle, vectors = run["bundle"], run["config"].textual_inversion.vectors
    conditioner = _WebuiConditioner(bundle)
    a1111_textual_inversion.shared.sd_model = SimpleNamespace(cond_stage_model=conditioner)
    folder = tmp_path / "embeddings"
    folder.mkdir()
    shutil.copy2(run["result"].output_dir / "final" / "mychar.safetensors", folder)
    database = a1111_textual_inversion.textual_inversion.EmbeddingDatabase()
    database.add_embedding_dir(str(folder))
    database.load_textual_inversion_embeddings(force_reload=True)
    assert database.skipped_embeddings == {} and list(database.word_embeddings) == ["mychar"]
    embedding = database.word_embeddings["mychar"]
    encoders = MODEL_TYPES[bundle.model_type].text_encoders
    # the widths from the base model's saved text encoder configs, not from the file
    widths = {name: CLIPTextConfig.from_pretrained(run["base"] / name).hidden_size
              for name in encoders}
    assert embedding.vectors == vectors and embedding.shape == sum(widths.values())
    if which != "sdxl":
        assert torch.equal(embedding.vec, _trained_vectors(run, "text_encoder"))
    else:
        assert set(embedding.vec) == {"clip_l", "clip_g"}
        for key, name in (("clip_l", "text_encoder"), ("clip_g", "text_encoder_2")):
            assert embedding.vec[key].shape == (vectors, widths[name])
            assert torch.equal(embedding.vec[key], _trained_vectors(run, name))
    [tokens] = conditioner.tokenize(["a photo of mychar"])
    [before] = conditioner.tokenize(["a photo of"])
    [name_ids] = conditioner.tokenize(["mychar"])
    assert database.find_embedding_at_position(tokens, len(before)) == (embedding,
                                                                        len(name_ids))


def test_a_known_word_as_trigger_is_refused_before_anything_is_written(tempera_cache, tmp_path):
    config = ti_config(tempera_cache, tmp_path / "out", ModelType.SD15, "training.max_steps=1",
                       "textual_inversion.placeholder=dog")
    with pytest.raises(ConfigError) as caught:
        prepare_run(config, RecordingCallbacks())
    assert [p.path for p in caught.value.problems] == ["textual_inversion.placeholder"]
    assert "already reads it as the token 'dog</w>'" in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def fresh_dynamo():
    """No compiled frames from earlier tests: this test counts recompiles."""
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("scope", ["REGIONAL", "FULL"])
def test_the_text_encoder_compiles_with_aot_eager_and_never_recompiles(
        scope, tempera_cache, tmp_path, fresh_dynamo):
    """Why about 10 s: a 3-step run whose text encoder AOT_EAGER traces (forward and
    backward); the counters are read from run.json's compile report."""
    result = train(ti_config(tempera_cache, tmp_path / "out", ModelType.SD15,
                             "training.max_steps=3", "textual_inversion.vectors=2",
                             "compile.backend=AOT_EAGER", f"compile.scope={scope}",
                             "compile.text_encoder=true", "compile.denoiser=false"))
    report = json.loads((result.output_dir / "run.json").read_text())["compile"]
    encoder = report["text_encoder"]
    assert encoder["effective"] == "AOT_EAGER" and encoder["compiled_code_ran"]
    # REGIONAL: the CLIP layers (one shape: one graph, never recompiled), the embedding
    # lookup eager before them; FULL: the whole encoder, the trained lookup and its cast in
    # the graph. The denoiser's compile is tested elsewhere; here it runs eager.
    assert encoder["recompiles"] == 0 and encoder["late_recompiles"] == 0
    assert report["unet"]["effective"] == "NONE"


def test_an_initializer_the_tokenizer_reads_no_token_in_is_refused_naming_the_field(
        tempera_cache, tmp_path):
    """Reached only past validate (which refuses a blank initializer first): the tokenizer's
    own check, on the real tiny tokenizer."""
    from transformers import CLIPTokenizer

    from modules.train.recipe.textual_inversion import token_problems
    tokenizer = CLIPTokenizer.from_pretrained(_base(ModelType.SD15, tempera_cache) / "tokenizer")
    config = ti_config(tempera_cache, tmp_path, ModelType.SD15)
    assert token_problems(config, {"text_encoder": tokenizer}) == []
    config.textual_inversion.initializer = "  "
    [problem] = token_problems(config, {"text_encoder": tokenizer})
    assert problem.path == "textual_inversion.initializer" and "reads no token" in str(problem)


def test_the_memory_plan_counts_the_embedding_its_optimizer_state_and_the_kept_rows(
        tempera_cache, tmp_path):
    from transformers import CLIPTextConfig

    from modules.train.memory.memory_plan import plan_memory
    folder = _base(ModelType.SD15, tempera_cache)
    text = CLIPTextConfig.from_pretrained(folder / "text_encoder")
    embedding = text.vocab_size * text.hidden_size * 4  # float32; the weightless plan adds no rows
    lines = dict(plan_memory(ti_config(tempera_cache, tmp_path, ModelType.SD15), folder).lines)
    assert lines["copy of the token embeddings' old rows"] == embedding
    assert lines["gradients of the trained weights"] == embedding
    assert lines["optimizer state (AdamW: 2 copies of each weight)"] == 2 * embedding
