"""In-memory cache of frozen text encoder outputs, one entry per distinct caption.

Entries are copies, never views of the encoder's output: a compiled encoder under CUDA graphs
returns tensors in the graph's memory pool, which the next replay overwrites, so a cached view
would silently turn into another caption's conditioning. A view would also keep the whole
batch's output alive for one caption.
"""
from __future__ import annotations

import torch

from modules.models.bundle import ModelBundle
from modules.models.families import TextEmbeddings, family_of
from modules.models.chat_text import pad_to_batch


class TextEncoderCache:
    """Encodes each caption once; later batches reuse the stored hidden states (and pooled)."""

    def __init__(self, bundle: ModelBundle, device: torch.device) -> None:
        self.bundle, self.device = bundle, device
        # caption -> (hidden, pooled, length): a caption of its own length (chat encoders)
        # keeps its real tokens only, padded again to each batch's length when read
        self.entries: dict[str, tuple[torch.Tensor, torch.Tensor | None, int | None]] = {}
        self.encoded = 0  # captions actually run through the text encoder(s)

    @torch.no_grad()
    def encode(self, captions: list[str], varies: list[bool] | None = None) -> TextEmbeddings:
        """Hidden states (and pooled) for `captions`. A caption that `varies` (shuffled or
        dropped tags: another text next epoch) is encoded each time and not stored, so the
        cache holds only captions that come back, and never grows with every shuffle."""
        varies = varies or [False] * len(captions)
        missing = list(dict.fromkeys(c for c in captions if c not in self.entries))
        fresh: dict[str, tuple[torch.Tensor, torch.Tensor | None, int | None]] = {}
        if missing:
            encoded = family_of(self.bundle.model_type).encode_text(self.bundle, missing,
                                                                   self.device, None)
            for i, caption in enumerate(missing):
                length = None if encoded.lengths is None else int(encoded.lengths[i])
                hidden = encoded.hidden[i] if length is None else encoded.hidden[i, :length]
                pooled = None if encoded.pooled is None else encoded.pooled[i].clone()
                fresh[caption] = (hidden.clone(), pooled, length)
            self.encoded += len(missing)
        for caption, changes in zip(captions, varies):
            if caption in fresh and not changes:
                self.entries[caption] = fresh[caption]
        rows = [self.entries.get(c) or fresh[c] for c in captions]
        return stack_rows(rows)


def stack_rows(rows: list[tuple[torch.Tensor, torch.Tensor | None, int | None]]
               ) -> TextEmbeddings:
    """One batch's `TextEmbeddings` from per-caption rows (hidden, pooled, length)."""
    pooled = None if rows[0][1] is None else torch.stack([p for _, p, _ in rows])
    if rows[0][2] is None:
        return TextEmbeddings(torch.stack([h for h, _, _ in rows]), pooled)
    return pad_to_batch([h for h, _, _ in rows], pooled)
