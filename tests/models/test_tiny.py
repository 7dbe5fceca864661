"""The tiny built-in models: tokenizer, determinism, loading, inference, SDXL inputs, cache."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import diffusers
import pytest
import torch
from safetensors.torch import load_file
from transformers import (AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection,
                          CLIPTokenizer)

from modules.config.schema import ModelType
from modules.data.shapes import BACKGROUND_COLORS, FOREGROUND_COLORS, SHAPES
from modules.models import tiny, tiny_sd
from modules.models.families import family_of

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[ModelType, Path]:
    """Each model type built once for the whole module (about a second in all)."""
    root = tmp_path_factory.mktemp("tiny")
    return {mt: tiny_sd.build_tiny_pipeline(mt, root / mt.value) for mt in tiny_sd.TINY_SPECS}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.rglob("*.safetensors"))
    assert files, f"no safetensors under {folder}"
    return {f"{f.relative_to(folder)}:{k}": v for f in files for k, v in load_file(f).items()}


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file()}


def test_tokenizer_round_trip_and_special_tokens(built):
    tok = AutoTokenizer.from_pretrained(built[ModelType.SD15] / "tokenizer")
    assert type(tok).__name__.startswith("CLIPTokenizer")
    assert (built[ModelType.SD15] / "tokenizer" / "vocab.json").is_file()
    assert (built[ModelType.SD15] / "tokenizer" / "merges.txt").is_file()
    ids = tok(CAPTION).input_ids
    assert ids[0] == tok.bos_token_id == tok.convert_tokens_to_ids(tiny_sd.BOS_TOKEN)
    assert ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids(tiny_sd.EOS_TOKEN)
    assert tok.unk_token_id not in ids[1:-1]
    assert tok.decode(ids, skip_special_tokens=True) == CAPTION
    # CLIP convention: the end token has the highest id (CLIPTextModel pools there).
    assert tok.eos_token_id == len(tok) - 1
    assert len(tok) <= tiny_sd.TINY_SPECS[ModelType.SD15].tokenizer_vocab_size
    padded = tok([CAPTION, "a square"], padding="max_length", max_length=tok.model_max_length,
                 truncation=True, return_tensors="pt").input_ids
    assert tok.model_max_length == 77 and padded.shape == (2, 77)
    assert (padded[1, 4:] == tok.pad_token_id).all()


def test_classic_vocab_and_merges_files_load_the_same_tokenizer(built, tmp_path):
    saved = built[ModelType.SD15] / "tokenizer"
    for name in tiny_sd.TOKENIZER_FILES:
        (tmp_path / name).write_bytes((saved / name).read_bytes())
    classic = CLIPTokenizer.from_pretrained(tmp_path, model_max_length=77)
    full = AutoTokenizer.from_pretrained(saved)
    text = "An oil painting of a Purple cat, 3 dogs & a zebra!"
    assert classic(text).input_ids == full(text).input_ids
    assert len(classic) == len(full)


def test_every_shapes_caption_word_is_one_token(built):
    tok = AutoTokenizer.from_pretrained(built[ModelType.SD15] / "tokenizer")
    for word in (*SHAPES, *FOREGROUND_COLORS, *BACKGROUND_COLORS, "a", "on", "background"):
        assert tok.tokenize(word) == [word + tiny_sd.END_OF_WORD], word


def test_build_is_deterministic(tmp_path, built):
    again = tiny_sd.build_tiny_pipeline(ModelType.SD15, tmp_path / "again")
    first, second = _tensors(built[ModelType.SD15]), _tensors(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # Every file, configs and tokenizer included, is byte-identical too.
    assert _file_bytes(again) == _file_bytes(built[ModelType.SD15])
    config = (again / "tokenizer" / "tokenizer_config.json").read_text()
    assert "local_files_only" not in config and "is_local" not in config
    other = _tensors(tiny_sd.build_tiny_pipeline(ModelType.SD15, tmp_path / "seed1", seed=1))
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_tokenizer_merges_are_the_same_in_another_process():
    """tokenizers' own BPE trainer broke ties differently per process; ours must not."""
    code = ("from modules.models.tiny_sd import CORPUS_PATH, train_clip_merges; "
            "print(repr(train_clip_merges(CORPUS_PATH.read_text('utf-8').splitlines(), 10_000)))")
    root = Path(tiny_sd.__file__).resolve().parents[2]
    other = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)
    here = tiny_sd.train_clip_merges(tiny_sd.CORPUS_PATH.read_text("utf-8").splitlines(), 10_000)
    assert len(here) > 300
    assert other.stdout.strip() == repr(here)


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_sd.build_tiny_pipeline(ModelType.SD2, tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("model_type", list(tiny_sd.TINY_SPECS))
def test_pipeline_loads_and_generates(built, model_type):
    spec = tiny_sd.TINY_SPECS[model_type]
    pipe_class = getattr(diffusers, spec.pipeline_class)
    pipe = pipe_class.from_pretrained(built[model_type], local_files_only=True)
    assert type(pipe) is pipe_class
    assert pipe.scheduler.config.prediction_type == spec.scheduler["prediction_type"]
    assert pipe.vae_scale_factor == 8
    unet_params = sum(p.numel() for p in pipe.unet.parameters())
    assert unet_params < 600_000, unet_params
    pipe.set_progress_bar_config(disable=True)
    image = pipe(CAPTION, num_inference_steps=2, height=64, width=64,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)


def test_sd_variants_match_their_families(built):
    sd15 = diffusers.UNet2DConditionModel.from_pretrained(built[ModelType.SD15], subfolder="unet")
    sd2 = diffusers.UNet2DConditionModel.from_pretrained(built[ModelType.SD2], subfolder="unet")
    assert not sd15.config.use_linear_projection
    assert sd2.config.use_linear_projection
    assert isinstance(sd2.config.attention_head_dim, (list, tuple))
    sched = diffusers.DDPMScheduler.from_pretrained(built[ModelType.SD2], subfolder="scheduler")
    assert sched.config.prediction_type == "v_prediction"


def test_sdxl_two_encoders_and_added_conditioning(built):
    folder = built[ModelType.SDXL]
    te1 = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
    te2 = CLIPTextModelWithProjection.from_pretrained(folder, subfolder="text_encoder_2")
    tok1 = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
    tok2 = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer_2")
    unet = diffusers.UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    assert unet.config.addition_embed_type == "text_time"

    def ids(tok):
        return tok([CAPTION], padding="max_length", max_length=77, return_tensors="pt").input_ids

    with torch.no_grad():
        out1 = te1(ids(tok1), output_hidden_states=True)
        out2 = te2(ids(tok2), output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        assert hidden.shape[-1] == unet.config.cross_attention_dim
        pooled = out2.text_embeds
        time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]])
        assert (pooled.shape[-1] + time_ids.shape[-1] * unet.config.addition_time_embed_dim
                == unet.config.projection_class_embeddings_input_dim)
        latents = torch.randn(1, 4, 8, 8)
        pred = unet(latents, 10, encoder_hidden_states=hidden,
                    added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample
    assert pred.shape == latents.shape


def test_check_spec_rejects_inconsistent_sdxl_dims():
    spec = tiny_sd.TINY_SPECS[ModelType.SDXL]
    bad = dataclasses.replace(spec, unet={**spec.unet, "projection_class_embeddings_input_dim": 81})
    with pytest.raises(ValueError, match="projection_class_embeddings_input_dim"):
        tiny_sd.check_spec(bad)
    bad = dataclasses.replace(spec, unet={**spec.unet, "cross_attention_dim": 32})
    with pytest.raises(ValueError, match="cross_attention_dim"):
        tiny_sd.check_spec(bad)


def test_ensure_builds_once_then_reuses(tmp_path, monkeypatch):
    folder = tiny.ensure_builtin_model("builtin:tiny-sd15", tmp_path)
    assert folder.parent == tmp_path / "models" and folder.name.startswith("tiny-sd15-")
    assert (folder / "model_index.json").is_file()
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(tiny_sd, "build_tiny_pipeline", no_rebuild)
    assert tiny.ensure_builtin_model("builtin:tiny-sd15", tmp_path) == folder
    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]


def test_fingerprint_follows_the_spec(tmp_path, monkeypatch):
    spec = tiny_sd.TINY_SPECS[ModelType.SD15]
    changed = dataclasses.replace(spec, unet={**spec.unet, "layers_per_block": 2})
    assert tiny.spec_fingerprint(spec) == tiny.spec_fingerprint(dataclasses.replace(spec))
    assert tiny.spec_fingerprint(changed) != tiny.spec_fingerprint(spec)
    before = tiny.builtin_model_dir("builtin:tiny-sd15", tmp_path)
    monkeypatch.setitem(tiny_sd.TINY_SPECS, ModelType.SD15, changed)
    assert tiny.builtin_model_dir("builtin:tiny-sd15", tmp_path) != before
    version_a = tiny.spec_fingerprint(spec)
    monkeypatch.setattr(tiny, "BUILDER_VERSION", tiny.BUILDER_VERSION + 1)
    assert tiny.spec_fingerprint(spec) != version_a


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_interrupted_build_leaves_no_finished_folder(tmp_path, monkeypatch, error):
    real_build = tiny_sd.build_tiny_pipeline

    def build_then_fail(model_type, dest, seed=0):
        real_build(model_type, dest, seed)  # every file written...
        raise error  # ...but interrupted before the folder is published

    monkeypatch.setattr(tiny_sd, "build_tiny_pipeline", build_then_fail)
    with pytest.raises(type(error)):
        tiny.ensure_builtin_model("builtin:tiny-sd2", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []  # no target, no leftover temp folder
    monkeypatch.setattr(tiny_sd, "build_tiny_pipeline", real_build)
    folder = tiny.ensure_builtin_model("builtin:tiny-sd2", tmp_path)
    assert (folder / "model_index.json").is_file()


def test_unknown_builtin_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as info:
        tiny.ensure_builtin_model("builtin:tiny-sd3", tmp_path)
    message = str(info.value)
    assert "builtin:tiny-sd3" in message
    assert all(name in message for name in tiny.BUILTIN_MODELS)
    assert not (tmp_path / "models").exists()


def test_every_family_record_says_what_its_builtin_model_is(tmp_path):
    """The cache asks each family's record for its tiny model's spec (no table of its own):
    every model type has a built-in model, each with its own fingerprint."""
    assert set(tiny.BUILTIN_MODELS.values()) == set(ModelType)
    for name, model_type in tiny.BUILTIN_MODELS.items():
        assert tiny.tiny_spec(name) == family_of(model_type).tiny_spec()
    folders = {tiny.builtin_model_dir(name, tmp_path).name for name in tiny.BUILTIN_MODELS}
    assert len(folders) == len(tiny.BUILTIN_MODELS)


@pytest.mark.parametrize("source", ["builtin", "bench"])
def test_text_encoder_weights_are_saved_under_their_text_model_names(built, tmp_path, source):
    """Every folder Tempera writes names CLIP weights `text_model.…`, the form older transformers
    and other tools read (transformers 5.6+ saves them flattened), and still loads."""
    from modules.bench.models import ensure_bench_model
    folder = (built[ModelType.SDXL] if source == "builtin"
              else Path(ensure_bench_model("small", tmp_path)))
    encoders = [name for name in ("text_encoder", "text_encoder_2") if (folder / name).is_dir()]
    assert encoders
    for name in encoders:
        keys = [k.split(":", 1)[1] for k in _tensors(folder / name)]
        assert keys and all(k.startswith(("text_model.", "text_projection.")) for k in keys), keys[:3]
    _, info = CLIPTextModel.from_pretrained(folder / "text_encoder", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
