"""Tiny, randomly initialised Stable Diffusion-shaped models, built locally from one spec table
(the SD families' records build theirs here; modules/models/tiny.py caches every family's).

They exist so the demo, the tests and the compile benchmarks run anywhere, offline, in seconds:
same component classes, folder layout and conditioning as the real SD 1.5 / SD 2 / SDXL, a few
hundred thousand parameters each. Weights are seeded, so a build is byte-for-byte repeatable.

The CLIP tokenizer is a BPE trained here on a small bundled English text
(`assets/tiny_corpus.txt`), with words split by the same `tokenizers` normalizer and
pre-tokenizer CLIPTokenizer uses, and saved as the usual vocab.json + merges.txt in CLIP's layout:
the 256 byte symbols, the same with the word-end marker ``</w>``, the learned merges, and
``<|startoftext|>`` / ``<|endoftext|>`` last (so the end token has the highest id, as in CLIP).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modules.model_types import ModelType
from modules.models.single_file import clip_key_with_text_model, rename_weight_keys
from modules.models.tiny_text import CORPUS_PATH, byte_symbols, train_bpe_merges

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
END_OF_WORD = "</w>"
MAX_TEXT_LENGTH = 77
TOKENIZER_FILES = ("vocab.json", "merges.txt")
# CLIP's pre-tokenizer split (the same pattern transformers' CLIPTokenizer uses): special
# tokens, English contractions, runs of letters, single digits, runs of other symbols.
CLIP_SPLIT_PATTERN = (r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|"""
                      r"""[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""")


@dataclass(frozen=True)
class TextEncoderSpec:
    """One text encoder and the tokenizer that feeds it, by their pipeline attribute names.

    `config` holds the CLIPTextConfig fields; the vocabulary size and special token ids are
    filled in from the trained tokenizer.
    """
    name: str
    tokenizer: str
    model_class: str  # "CLIPTextModel" or "CLIPTextModelWithProjection"
    config: dict[str, Any]


@dataclass(frozen=True)
class TinySpec:
    """Everything that decides a tiny model's weights and layout; its hash names the cache."""
    pipeline_class: str
    unet: dict[str, Any]
    vae: dict[str, Any]
    text_encoders: tuple[TextEncoderSpec, ...]
    scheduler: dict[str, Any]
    pipeline_kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer_vocab_size: int = 1000
    scheduler_class: str = "DDIMScheduler"


# --- the spec table -----------------------------------------------------------------------
_CLIP_TEXT: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    "max_position_embeddings": MAX_TEXT_LENGTH, "projection_dim": 32, "hidden_act": "quick_gelu"}
# SD 2 and SDXL's second encoder are OpenCLIP models, which use the exact GELU.
_OPEN_CLIP_TEXT: dict[str, Any] = {**_CLIP_TEXT, "hidden_act": "gelu"}

# 4 blocks -> 3 downsamplings -> 8x, like the real SD VAE (64 px images give 8x8 latents).
TINY_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 64,
        "block_out_channels": (8, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 4,
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4, "scaling_factor": 0.18215}

_UNET_SD15 = {"sample_size": 8, "in_channels": 4, "out_channels": 4,
              # (32, 64) would be the SD-like doubling but costs ~790k parameters; (32, 32) keeps
              # the 32-wide attention and stays near 360k.
              "block_out_channels": (32, 32), "layers_per_block": 1, "norm_num_groups": 8,
              "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
              "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
              "cross_attention_dim": 32, "attention_head_dim": 4}

# SD 1.x/2.x's scheduler: scaled-linear betas over 1000 steps; only the prediction type differs.
_SCHEDULER = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
              "beta_schedule": "scaled_linear", "clip_sample": False, "set_alpha_to_one": False,
              "steps_offset": 1, "prediction_type": "epsilon"}

_SD_PIPELINE_KWARGS = {"safety_checker": None, "feature_extractor": None,
                       "requires_safety_checker": False}

_SDXL_TIME_EMBED_DIM = 8
# SDXL's added conditioning: the pooled text embedding of encoder 2 (projection_dim) plus six
# size/crop numbers, each embedded to addition_time_embed_dim.
_SDXL_ADDED_COND_DIM = _OPEN_CLIP_TEXT["projection_dim"] + 6 * _SDXL_TIME_EMBED_DIM

TINY_SPECS: dict[ModelType, TinySpec] = {
    ModelType.SD15: TinySpec(
        pipeline_class="StableDiffusionPipeline",
        unet=_UNET_SD15,
        vae=TINY_VAE,
        text_encoders=(TextEncoderSpec("text_encoder", "tokenizer", "CLIPTextModel", _CLIP_TEXT),),
        scheduler=_SCHEDULER,
        pipeline_kwargs=_SD_PIPELINE_KWARGS,
    ),
    ModelType.SD2: TinySpec(
        pipeline_class="StableDiffusionPipeline",
        unet={**_UNET_SD15, "use_linear_projection": True, "attention_head_dim": (2, 4)},
        vae=TINY_VAE,
        text_encoders=(TextEncoderSpec("text_encoder", "tokenizer", "CLIPTextModel",
                                       _OPEN_CLIP_TEXT),),
        scheduler={**_SCHEDULER, "prediction_type": "v_prediction"},
        pipeline_kwargs=_SD_PIPELINE_KWARGS,
    ),
    ModelType.SDXL: TinySpec(
        pipeline_class="StableDiffusionXLPipeline",
        unet={**_UNET_SD15, "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
              "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
              "use_linear_projection": True, "attention_head_dim": (2, 4),
              "cross_attention_dim": _CLIP_TEXT["hidden_size"] + _OPEN_CLIP_TEXT["hidden_size"],
              "addition_embed_type": "text_time", "addition_time_embed_dim": _SDXL_TIME_EMBED_DIM,
              "projection_class_embeddings_input_dim": _SDXL_ADDED_COND_DIM},
        vae={**TINY_VAE, "scaling_factor": 0.13025},
        text_encoders=(
            TextEncoderSpec("text_encoder", "tokenizer", "CLIPTextModel", _CLIP_TEXT),
            TextEncoderSpec("text_encoder_2", "tokenizer_2", "CLIPTextModelWithProjection",
                            _OPEN_CLIP_TEXT),
        ),
        scheduler={**_SCHEDULER, "timestep_spacing": "leading"},
        pipeline_kwargs={"force_zeros_for_empty_prompt": True, "add_watermarker": False},
    ),
}


# --- tokenizer ----------------------------------------------------------------------------
def clip_words(corpus: list[str]) -> Counter[str]:
    """How often each word occurs in `corpus`, split exactly as CLIP's tokenizer splits text.

    Uses the `tokenizers` normalizer and pre-tokenizer that transformers' CLIPTokenizer uses, so
    the words are lower-cased and written in the byte-level alphabet.
    """
    from tokenizers import Regex, normalizers, pre_tokenizers

    normalizer = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    words: Counter[str] = Counter()
    for line in corpus:
        words.update(piece for piece, _ in pre_tokenizer.pre_tokenize_str(
            normalizer.normalize_str(line)))
    return words


def train_clip_merges(corpus: list[str], max_merges: int,
                      min_frequency: int = 2) -> list[tuple[str, str]]:
    """BPE merges learned from `corpus`, with CLIP's word splitting and ``</w>`` word ends.

    A plain BPE loop (`tiny_text.train_bpe_merges`) rather than `tokenizers.trainers.BpeTrainer`:
    that trainer breaks ties between equally frequent pairs differently from one process to
    the next (measured with tokenizers 0.23), which would give a different vocabulary on every
    build. Here ties go to the alphabetically first pair. The corpus is small, so this takes
    well under a second.
    """
    # Each word as a tuple of symbols; the last one carries the word-end marker.
    words = Counter({tuple(w[:-1]) + (w[-1] + END_OF_WORD,): n
                     for w, n in clip_words(corpus).items()})
    return train_bpe_merges(words, max_merges, min_frequency)


def clip_vocab(merges: list[tuple[str, str]]) -> dict[str, int]:
    """CLIP's vocabulary layout: bytes, bytes + ``</w>``, merge results, then the two specials."""
    symbols = byte_symbols()
    tokens = symbols + [s + END_OF_WORD for s in symbols] + [a + b for a, b in merges]
    tokens += [BOS_TOKEN, EOS_TOKEN]
    if len(set(tokens)) != len(tokens):
        raise ValueError("tokenizer vocabulary has duplicate tokens; the merges are inconsistent")
    return {token: i for i, token in enumerate(tokens)}


def build_clip_tokenizer(dest: Path, vocab_size: int, corpus_path: Path = CORPUS_PATH) -> Any:
    """Train a small CLIP tokenizer and save it into `dest` (vocab.json, merges.txt, config).

    Returns the loaded `CLIPTokenizer`; `vocab_size` is an upper bound (the corpus may support
    fewer merges).
    """
    from transformers import CLIPTokenizer

    base = 2 * 256 + 2
    if vocab_size <= base:
        raise ValueError(f"tokenizer_vocab_size must exceed {base} (bytes + specials), "
                         f"got {vocab_size}")
    corpus = corpus_path.read_text(encoding="utf-8").splitlines()
    merges = train_clip_merges(corpus, vocab_size - base)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "vocab.json").write_text(json.dumps(clip_vocab(merges), ensure_ascii=False, indent=1),
                                     encoding="utf-8")
    (dest / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    tokenizer = CLIPTokenizer.from_pretrained(dest, model_max_length=MAX_TEXT_LENGTH)
    _forget_load_context(tokenizer)
    # Writes tokenizer_config.json (class, max length, specials) so AutoTokenizer loads it too.
    tokenizer.save_pretrained(dest)
    return tokenizer


# Keys transformers 5 records about how a tokenizer was loaded and writes back on save; with
# them, tokenizer_config.json would differ with HF_HUB_OFFLINE, breaking byte-identical builds.
_LOAD_CONTEXT_KEYS = ("is_local", "local_files_only")


def _forget_load_context(tokenizer: Any) -> None:
    """Drop the load-time keys from `tokenizer` so saving it depends only on its contents."""
    for key in _LOAD_CONTEXT_KEYS:
        tokenizer.init_kwargs.pop(key, None)


# --- components and pipeline ----------------------------------------------------------------
def check_spec(spec: TinySpec) -> None:
    """Raise ValueError when the UNet's conditioning sizes disagree with the text encoders."""
    hidden = sum(te.config["hidden_size"] for te in spec.text_encoders)
    if spec.unet["cross_attention_dim"] != hidden:
        raise ValueError(f"unet.cross_attention_dim is {spec.unet['cross_attention_dim']} but the "
                         f"text encoders' hidden sizes add up to {hidden}")
    if spec.unet.get("addition_embed_type") == "text_time":
        expected = (spec.text_encoders[-1].config["projection_dim"]
                    + 6 * spec.unet["addition_time_embed_dim"])
        given = spec.unet["projection_class_embeddings_input_dim"]
        if given != expected:
            raise ValueError(f"unet.projection_class_embeddings_input_dim is {given}; SDXL's "
                             f"pooled text embedding + 6 time ids need {expected}")


def _seeded(seed: int, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Build a module from its own seed without touching the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _text_encoder(te: TextEncoderSpec, tokenizer: Any, seed: int) -> torch.nn.Module:
    import transformers

    config = transformers.CLIPTextConfig(
        **te.config, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model_class = getattr(transformers, te.model_class)
    return _seeded(seed, lambda: model_class(config))


def build_tiny_components(spec: TinySpec, work_dir: Path, seed: int = 0) -> dict[str, Any]:
    """Every pipeline component for `spec`, randomly initialised from `seed`.

    Each module gets its own derived seed, so changing one component leaves the others' weights
    alone. Tokenizers are trained into `work_dir` (they are loaded from files).
    """
    import diffusers

    check_spec(spec)
    components: dict[str, Any] = {
        "unet": _seeded(seed, lambda: diffusers.UNet2DConditionModel(**spec.unet)),
        "vae": _seeded(seed + 1, lambda: diffusers.AutoencoderKL(**spec.vae)),
        "scheduler": getattr(diffusers, spec.scheduler_class)(**spec.scheduler),
    }
    for i, te in enumerate(spec.text_encoders):
        tokenizer = build_clip_tokenizer(work_dir / te.tokenizer, spec.tokenizer_vocab_size)
        components[te.tokenizer] = tokenizer
        components[te.name] = _text_encoder(te, tokenizer, seed + 2 + i)
    return components


def build_tiny_pipeline(model_type: ModelType, dest: Path, seed: int = 0) -> Path:
    """Build the tiny model of `model_type` and save it as a diffusers pipeline folder in `dest`."""
    spec = TINY_SPECS[model_type]
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="tempera-tokenizer-") as work_dir:
        components = build_tiny_components(spec, Path(work_dir), seed)
        save_tiny_pipeline(spec, components, Path(work_dir), dest)
    return dest


def save_tiny_pipeline(spec: TinySpec, components: dict[str, Any], work_dir: Path,
                       dest: Path) -> None:
    """Save tiny components (from `build_tiny_components(spec, work_dir)`) as a diffusers
    folder that every stack reads: text encoder weights under their `text_model.` names, and
    CLIP's classic vocab.json + merges.txt beside tokenizer.json (transformers 5 writes only
    the latter)."""
    import diffusers

    pipeline = getattr(diffusers, spec.pipeline_class)(**components, **spec.pipeline_kwargs)
    pipeline.save_pretrained(dest, safe_serialization=True)
    for te in spec.text_encoders:
        rename_weight_keys(dest / te.name, clip_key_with_text_model)
        for name in TOKENIZER_FILES:
            shutil.copyfile(work_dir / te.tokenizer / name, dest / te.tokenizer / name)


# --- at the real size (the benchmark's) ----------------------------------------------------
_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
           "num_hidden_layers": 12, "max_position_embeddings": 77, "projection_dim": 768,
           "hidden_act": "quick_gelu"}
_OPEN_CLIP_BIG_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20,
                    "num_hidden_layers": 32, "max_position_embeddings": 77,
                    "projection_dim": 1280, "hidden_act": "gelu"}
_SD_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2,
           "block_out_channels": [128, 256, 512, 512], "norm_num_groups": 32,
           "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "sample_size": 512,
           "scaling_factor": 0.18215}

# Used only when modules/models/configs/ is absent: the real UNet/VAE/CLIP architectures
# (the same public diffusers values), by configs folder.
REAL_SIZE_FALLBACK: dict[str, dict[str, dict[str, Any]]] = {
    "sd15": {
        "unet": {"sample_size": 64, "in_channels": 4, "out_channels": 4,
                 "block_out_channels": [320, 640, 1280, 1280], "layers_per_block": 2,
                 "cross_attention_dim": 768, "attention_head_dim": 8,
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3},
        "vae": _SD_VAE,
        "text_encoder": _CLIP_L,
    },
    "sdxl": {
        "unet": {"sample_size": 128, "in_channels": 4, "out_channels": 4,
                 "block_out_channels": [320, 640, 1280], "layers_per_block": 2,
                 "transformer_layers_per_block": [1, 2, 10], "cross_attention_dim": 2048,
                 "attention_head_dim": [5, 10, 20], "use_linear_projection": True,
                 "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
                 "projection_class_embeddings_input_dim": 2816,
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D",
                                      "CrossAttnDownBlock2D"],
                 "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]},
        "vae": {**_SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025},
        "text_encoder": _CLIP_L,
        "text_encoder_2": _OPEN_CLIP_BIG_G,
    },
}



def real_component_config(folder: str, component: str) -> tuple[dict[str, Any], str]:
    """(config, source) of a real SD architecture: the shipped config, else the table above."""
    from modules.models.shipped_configs import real_component_config as shipped
    return shipped(folder, component, REAL_SIZE_FALLBACK, "modules/models/tiny_sd.py table")


def real_size_spec(model_type: ModelType, folder: str) -> TinySpec:
    """The real architecture of `model_type` (its configs in `folder`), in the tiny layout."""
    base = TINY_SPECS[model_type]
    text_encoders = tuple(
        TextEncoderSpec(te.name, te.tokenizer, te.model_class,
                        real_component_config(folder, te.name)[0])
        for te in base.text_encoders)
    return TinySpec(pipeline_class=base.pipeline_class,
                    unet=real_component_config(folder, "unet")[0],
                    vae=real_component_config(folder, "vae")[0],
                    text_encoders=text_encoders, scheduler=base.scheduler,
                    pipeline_kwargs=base.pipeline_kwargs)


def build_from_spec(spec: TinySpec, dest: Path, half: bool = True) -> Path:
    """A random-weight folder of `spec` (seed 0); `half`: saved in float16, as SD's are
    released (it halves a real-size folder; runs load it in their weight dtype)."""
    with tempfile.TemporaryDirectory(prefix="tempera-bench-tokenizer-") as work_dir:
        components = build_tiny_components(spec, Path(work_dir))
        if half:
            for value in components.values():
                if isinstance(value, torch.nn.Module):
                    value.to(torch.float16)
        save_tiny_pipeline(spec, components, Path(work_dir), dest)
    return dest


def unet_parameters(spec: TinySpec) -> int:
    """Parameters of the spec's UNet (built on the meta device: no memory, no time)."""
    import diffusers
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**spec.unet)
    return sum(p.numel() for p in unet.parameters())
