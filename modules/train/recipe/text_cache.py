"""In-memory cache of frozen text encoder outputs, one entry per distinct caption.

Entries are copies, never views of the encoder's output: a compiled encoder under CUDA graphs
returns tensors in the graph's memory pool, which the next replay overwrites, so a cached view
would silently turn into another caption's conditioning. A view would also keep the whole
batch's output alive for one caption.
"""
from __future__ import annotations

import torch

from modules.models.bundle import ModelBundle
from modules.models.families import family_of


class TextEncoderCache:
    """Encodes each caption once; later batches reuse the stored hidden states (and pooled)."""

    def __init__(self, bundle: ModelBundle, device: torch.device) -> None:
        self.bundle, self.device = bundle, device
        self.entries: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.encoded = 0  # captions actually run through the text encoder(s)

    @torch.no_grad()
    def encode(self, captions: list[str], varies: list[bool] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states (and pooled) for `captions`. A caption that `varies` (shuffled or
        dropped tags: another text next epoch) is encoded each time and not stored, so the
        cache holds only captions that come back, and never grows with every shuffle."""
        varies = varies or [False] * len(captions)
        missing = list(dict.fromkeys(c for c in captions if c not in self.entries))
        fresh: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        if missing:
            hidden, pooled = family_of(self.bundle.model_type).encode_text(self.bundle, missing, self.device, None)
            for i, caption in enumerate(missing):
                fresh[caption] = (hidden[i].clone(), None if pooled is None else pooled[i].clone())
            self.encoded += len(missing)
        for caption, changes in zip(captions, varies):
            if caption in fresh and not changes:
                self.entries[caption] = fresh[caption]
        rows = [self.entries.get(c) or fresh[c] for c in captions]
        hidden = torch.stack([h for h, _ in rows])
        pooled_rows = [p for _, p in rows if p is not None]
        if pooled_rows and len(pooled_rows) != len(rows):  # a family pools every caption or none
            raise ValueError("some captions have a pooled text embedding and some have none")
        pooled = torch.stack(pooled_rows) if pooled_rows else None
        return hidden, pooled
