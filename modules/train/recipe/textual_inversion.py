"""Textual inversion (training.method=TEXTUAL_INVERSION): new tokens added to every CLIP
tokenizer of the model, their embedding rows initialised from a word, and only those rows
trained (docs/textual_inversion.md).

The whole token-embedding matrix is the trained parameter (so the text encoder keeps its
class, its state-dict keys and its compiled graphs), and two explicit steps keep every other
row as it was, bit for bit, as diffusers' and kohya's textual inversion scripts do: the
gradient of the old rows is zeroed as it is accumulated (the gradient norm and its clipping
then see the new rows only), and the old rows are copied back after every optimizer step
(AdamW's decoupled weight decay moves a row whose gradient is zero).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modules.config.problems import ConfigError, Problem
from modules.config.schema import Config, TrainingMethod
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle

# The embedding file's key per text encoder in the A1111 / ComfyUI layout: SDXL's two
# encoders (ComfyUI's sdxl_clip reads clip_l and clip_g); one encoder's file holds emb_params,
# as A1111 writes it (ComfyUI reads a one-tensor file whatever its key).
SDXL_EMBEDDING_KEYS = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}
SINGLE_EMBEDDING_KEY = "emb_params"


def is_textual_inversion(config: Config) -> bool:
    return config.training.method == TrainingMethod.TEXTUAL_INVERSION


def token_names(config: Config) -> list[str]:
    """The tokens the trigger word stands for: itself, then <word>_1, <word>_2 ... (the names
    diffusers' `load_textual_inversion` gives a multi-vector embedding's extra vectors)."""
    word, count = config.textual_inversion.placeholder, config.textual_inversion.vectors
    return [word] + [f"{word}_{i}" for i in range(1, count)]


def prompt_with_trigger(config: Config, text: str) -> str:
    """A caption or sample prompt of a TEXTUAL_INVERSION run: one without the trigger word
    gets it in front ("<word>, text"); an empty caption stays empty (caption dropout's
    unconditional one). Other methods' texts are returned as they are."""
    if not is_textual_inversion(config) or not text:
        return text
    word = config.textual_inversion.placeholder
    return text if word in text else f"{word}, {text}"


def with_trigger(config: Config, text: str) -> str:
    """A caption as the text encoder reads it in a TEXTUAL_INVERSION run: with the trigger word
    (`prompt_with_trigger`), which becomes all its tokens. (Sample prompts keep the word alone:
    diffusers' pipelines expand it themselves, `maybe_convert_prompt`.)"""
    text = prompt_with_trigger(config, text)
    if not is_textual_inversion(config) or not text:
        return text
    return text.replace(config.textual_inversion.placeholder, " ".join(token_names(config)))


def _encoder_pairs(bundle: ModelBundle) -> list[tuple[str, nn.Module, object | None]]:
    """(text encoder name, encoder, its tokenizer or None) in the model type's order."""
    spec = MODEL_TYPES[bundle.model_type]
    return [(name, bundle.text_encoders[name], bundle.tokenizers.get(tok))
            for name, tok in zip(spec.text_encoders, spec.tokenizers)]


def tokenizers_by_encoder(bundle: ModelBundle) -> dict[str, object]:
    """Text encoder name -> the tokenizer that feeds it (those the bundle has)."""
    return {name: tok for name, _, tok in _encoder_pairs(bundle) if tok is not None}


def token_problems(config: Config, tokenizers: dict[str, object]) -> list[Problem]:
    """What in the textual_inversion section the tokenizers refuse: a trigger word they
    already read as one token (a word of their vocabulary), an initializer they read no token
    in. (CLIP's byte-level BPE reads any other text as some tokens: a word it splits starts
    the vectors from the mean of its pieces.)"""
    ti, problems = config.textual_inversion, []
    for name, tokenizer in tokenizers.items():
        pieces = tokenizer.tokenize(ti.placeholder)  # type: ignore[attr-defined]
        if len(pieces) == 1 and pieces[0] != tokenizer.unk_token:  # type: ignore[attr-defined]
            problems.append(Problem(
                "textual_inversion.placeholder", "a string the tokenizer does not know, e.g. "
                "<mychar>", repr(ti.placeholder),
                f"{name} already reads it as the token {pieces[0]!r}: training it would "
                "change what that word means in every prompt; use a made-up word"))
        if not _initializer_ids(tokenizer, ti.initializer):
            problems.append(Problem(
                "textual_inversion.initializer", "a word the tokenizer reads",
                repr(ti.initializer), f"{name} reads no token in it; use a plain word close "
                "to what the token should mean (person, dog, style)"))
    # one problem per field is enough when both tokenizers refuse the same value
    return list({p.path: p for p in problems}.values())


def _initializer_ids(tokenizer, word: str) -> list[int]:
    return tokenizer(word, add_special_tokens=False)["input_ids"]


def add_placeholder_tokens(bundle: ModelBundle, config: Config) -> None:
    """Add the trigger word's tokens to every tokenizer, grow each text encoder's token
    embedding by as many rows and set each new row to the initializer word's embedding (the
    mean of its tokens' rows when the tokenizer splits it). Raises ConfigError naming the
    field when a tokenizer refuses the word (`token_problems`). A bundle without tokenizers
    (the memory plan's weightless one) is left as it is: its embedding is counted whole."""
    pairs = _encoder_pairs(bundle)
    tokenizers = tokenizers_by_encoder(bundle)
    if not tokenizers:
        return
    problems = token_problems(config, tokenizers)
    if problems:
        raise ConfigError(problems)
    names = token_names(config)
    for name, encoder, tokenizer in pairs:
        init_ids = _initializer_ids(tokenizer, config.textual_inversion.initializer)
        tokenizer.add_tokens(names)  # type: ignore[union-attr]
        new_ids = tokenizer.convert_tokens_to_ids(names)  # type: ignore[union-attr]
        # the new rows are set below: no random draw for them (mean_resizing samples)
        encoder.resize_token_embeddings(len(tokenizer),  # type: ignore[operator, arg-type]
                                        mean_resizing=False)
        weight = encoder.get_input_embeddings().weight  # type: ignore[operator]
        with torch.no_grad():
            start = weight[init_ids].float().mean(dim=0)
            weight[new_ids] = start.to(weight.dtype)


def new_row_ids(bundle: ModelBundle, config: Config, encoder: str) -> list[int]:
    """The embedding rows of the trigger word's tokens in `encoder`."""
    spec = MODEL_TYPES[bundle.model_type]
    tokenizer = bundle.tokenizers[spec.tokenizers[spec.text_encoders.index(encoder)]]
    ids = tokenizer.convert_tokens_to_ids(token_names(config))  # a list for a list
    assert isinstance(ids, list)
    return ids


def embedding_parameter(encoder: nn.Module) -> nn.Parameter:
    return encoder.get_input_embeddings().weight  # type: ignore[operator]


def old_rows_mask(weight: torch.Tensor, new_ids: list[int]) -> torch.Tensor:
    """(rows, 1) of 1 for the rows that must not change, 0 for the trained ones."""
    keep = torch.ones(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
    keep[new_ids] = 0
    return keep


def train_new_rows_only(encoder: nn.Module, new_ids: list[int],
                        frozen_dtype: torch.dtype) -> nn.Parameter:
    """Make the encoder's token embedding the one trained parameter, with the gradient of the
    rows other than `new_ids` zeroed each time a backward accumulates it (a named hook,
    registered here once per run). The embedding is trained at `model.train_dtype` while the
    rest of the encoder stays at `frozen_dtype`: its output is cast to that dtype
    (`cast_embedding_output`)."""
    weight = embedding_parameter(encoder)
    weight.requires_grad_(True)
    cast_embedding_output(encoder, frozen_dtype)
    new = torch.tensor(new_ids, dtype=torch.long)

    def zero_old_rows(param: torch.Tensor) -> None:
        assert param.grad is not None  # a post-accumulate hook runs with the gradient set
        grad_new = param.grad[new.to(param.grad.device)].clone()
        param.grad.zero_()
        param.grad[new.to(param.grad.device)] = grad_new

    weight.register_post_accumulate_grad_hook(zero_old_rows)
    return weight


def cast_embedding_output(encoder: nn.Module, dtype: torch.dtype) -> None:
    """Hand the frozen layers the token embedding's output in their own dtype: a float32
    embedding trained under bfloat16 frozen weights would otherwise feed float32 into a
    bfloat16 layer norm (an error on the CPU, silent upcasts on CUDA). A forward hook on the
    embedding module (traced into a FULL-compiled encoder's graph); the cast is the identity
    in backward, so the float32 rows get the gradient."""
    def cast(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    encoder.get_input_embeddings().register_forward_hook(cast)  # type: ignore[operator]


@dataclass
class FrozenRows:
    """Each trained embedding, the rows it trains and a copy of the rest as they were."""
    weights: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]]  # weight, new ids, copy

    def restore(self) -> None:
        with torch.no_grad():
            for weight, new_ids, copy in self.weights:
                trained = weight[new_ids].clone()
                weight.copy_(copy)
                weight[new_ids] = trained


def keep_old_rows(optimizer: torch.optim.Optimizer, bundle: ModelBundle,
                  config: Config) -> Callable[[], None] | None:
    """Copy the old embedding rows back after every optimizer step (a step post-hook on the
    run's optimizer, registered explicitly by the recipe); returns the hook's remover, None
    when the run is not TEXTUAL_INVERSION."""
    if not is_textual_inversion(config):
        return None
    rows = FrozenRows([])
    for name in MODEL_TYPES[bundle.model_type].text_encoders:
        weight = embedding_parameter(bundle.text_encoders[name])
        ids = torch.tensor(new_row_ids(bundle, config, name), device=weight.device)
        rows.weights.append((weight, ids, weight.detach().clone()))
    handle = optimizer.register_step_post_hook(lambda *_: rows.restore())
    return handle.remove


def learned_vectors(bundle: ModelBundle, config: Config) -> dict[str, torch.Tensor]:
    """Text encoder name -> the trained vectors (vectors x width), float32 on the CPU."""
    out = {}
    for name in MODEL_TYPES[bundle.model_type].text_encoders:
        weight = embedding_parameter(bundle.text_encoders[name])
        ids = new_row_ids(bundle, config, name)
        out[name] = weight.detach()[ids].float().cpu().contiguous()
    return out


def textual_inversion_record(bundle: ModelBundle, config: Config) -> dict:
    """run.json's `textual_inversion`: what the run trains (the trigger word, its tokens, and
    in each text encoder their embedding rows and width; every other weight frozen)."""
    ti = config.textual_inversion
    encoders = {}
    for name in MODEL_TYPES[bundle.model_type].text_encoders:
        weight = embedding_parameter(bundle.text_encoders[name])
        encoders[name] = {"rows": new_row_ids(bundle, config, name),
                          "width": int(weight.shape[1]), "vocabulary": int(weight.shape[0])}
    return {"trigger_word": ti.placeholder, "vectors": ti.vectors, "tokens": token_names(config),
            "initializer": ti.initializer, "encoders": encoders,
            "trained": "the new tokens' embedding rows only; every other weight frozen",
            "captions": "a caption without the trigger word gets it in front"}
