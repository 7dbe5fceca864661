"""Captions through a chat-template language model (Qwen3), the way the text-to-image
pipelines that condition on one compute them: each caption wrapped as a user turn by the
tokenizer's chat template, the assistant's turn opened, tokenized, and read at one hidden layer
(diffusers' ZImagePipeline: the second-to-last). Each caption keeps its own length: the
denoiser sees its real tokens only.

Family-neutral: Z-Image uses it, and so can any family whose text encoder is such a model
(Flux.2 Klein shares Z-Image's Qwen3-4B). The family names its layer and lengths.

Token lengths are padded to a multiple (`pad_multiple`) rather than to the reference's fixed
512: the encoder is causal and pads on the right, so the real tokens' hidden states are the same
whatever padding follows them, the encoder does far less work on short captions, and a compiled
encoder sees a handful of lengths instead of one per caption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the families import this module while their table is built
    from modules.models.families.base import TextEmbeddings


@dataclass(frozen=True)
class ChatEncoding:
    """How a family reads its chat-template encoder: the hidden layer (negative: from the
    end), the longest caption in tokens (longer ones are cut, as the reference cuts them), the
    multiple token lengths are padded to, and the template's thinking switch."""
    hidden_layer: int = -2
    max_length: int = 512
    pad_multiple: int = 32
    enable_thinking: bool = True


def chat_prompts(tokenizer, captions: list[str], encoding: ChatEncoding) -> list[str]:
    """Each caption as the chat template writes one user message with the reply opened."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": caption}],
                                          tokenize=False, add_generation_prompt=True,
                                          enable_thinking=encoding.enable_thinking)
            for caption in captions]


def padded_length(longest: int, encoding: ChatEncoding) -> int:
    """The token length a batch is padded to: its longest caption rounded up to the multiple,
    at most `max_length`."""
    multiple = encoding.pad_multiple
    return min(encoding.max_length, max(multiple, -(-longest // multiple) * multiple))


def tokenize_chat(tokenizer, captions: list[str], encoding: ChatEncoding
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of the captions' chat prompts, right-padded to the
    batch's `padded_length`; a caption longer than `max_length` tokens is cut there."""
    prompts = chat_prompts(tokenizer, captions, encoding)
    lengths = [len(ids) for ids in tokenizer(prompts, truncation=True,
                                              max_length=encoding.max_length).input_ids]
    tokens = tokenizer(prompts, padding="max_length",
                       max_length=padded_length(max(lengths), encoding), truncation=True,
                       return_tensors="pt")
    return tokens.input_ids, tokens.attention_mask


def encode_chat(tokenizer, encoder: nn.Module, captions: list[str], device: torch.device,
                encoding: ChatEncoding) -> TextEmbeddings:
    """The captions' hidden states at `encoding.hidden_layer`, (B, L, D) with L the batch's
    padded length, zero past each caption's real tokens, and each caption's length."""
    ids, mask = tokenize_chat(tokenizer, captions, encoding)
    ids, mask = ids.to(device), mask.to(device)
    hidden = encoder(input_ids=ids, attention_mask=mask,
                     output_hidden_states=True).hidden_states[encoding.hidden_layer]
    keep = mask.bool().unsqueeze(-1)
    from modules.models.families.base import TextEmbeddings
    return TextEmbeddings(torch.where(keep, hidden, torch.zeros((), dtype=hidden.dtype,
                                                                device=hidden.device)),
                          None, mask.sum(dim=1))


def caption_list(embeddings: TextEmbeddings) -> list[torch.Tensor]:
    """Each caption's real tokens, (length, D): the per-caption form the denoisers that take
    captions of their own lengths (Z-Image's `cap_feats`) are called with."""
    if embeddings.lengths is None:
        return list(embeddings.hidden.unbind(0))
    return [hidden[:int(n)] for hidden, n in zip(embeddings.hidden, embeddings.lengths.tolist())]


def pad_to_batch(rows: list[torch.Tensor], pooled: torch.Tensor | None = None) -> TextEmbeddings:
    """Captions of their own lengths ((length, D) each) as one `TextEmbeddings`: zero-padded
    to the longest, with the lengths. What the denoiser sees is `caption_list` of it, so the
    batch's padded length never reaches it."""
    lengths = torch.tensor([len(row) for row in rows], device=rows[0].device)
    hidden = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    from modules.models.families.base import TextEmbeddings
    return TextEmbeddings(hidden, pooled, lengths)
