"""Cache of frozen text encoder outputs, one row per distinct caption, in a `TextEmbeddingStore`
on disk (text_store.py), where a run can encode every caption before training and let the text
encoder leave the GPU (`precache`). Rows are read back from disk for each batch; only the most
recent stay in memory, up to `RESIDENT_ROW_BYTES` (issue 56 item 2, issue 58 item 4: 2,000
Klein 9B captions are 25 GB).

Entries are copies, never views of the encoder's output: a compiled encoder under CUDA graphs
returns tensors in the graph's memory pool, which the next replay overwrites, so a cached view
would silently turn into another caption's conditioning. A view would also keep the whole
batch's output alive for one caption.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from modules.config.schema import Config
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle
from modules.models.families import TextEmbeddings, family_of
from modules.models.chat_text import pad_to_batch
from modules.train.recipe.text_store import Row, TextEmbeddingStore
from modules.train.recipe.trainable import trained_components


def varying_datasets(config: Config) -> list[str]:
    """The datasets whose captions change from epoch to epoch (shuffled or dropped tags), named
    with what makes them change: their outputs cannot be cached."""
    named = []
    for i, ds in enumerate(config.data.datasets):
        why = [w for w, on in (("shuffle_tags", ds.shuffle_tags),
                               (f"tag_dropout {ds.tag_dropout:g}", ds.tag_dropout > 0)) if on]
        if why:
            named.append(f"data.datasets[{i}] ({ds.path}: {', '.join(why)})")
    return named


def text_encoder_leaves_device(config: Config) -> bool:
    """Whether the run caches every caption before training and moves the text encoder off
    the GPU: text encoder outputs cached (data.cache_text_encoder_outputs) and nothing that
    keeps the encoder on it (`text_encoder_stays`). The memory plan counts the encoder only
    while it stays."""
    return config.data.cache_text_encoder_outputs and not text_encoder_stays(config)


def text_encoder_stays(config: Config) -> str:
    """Why the text encoder stays on the device even with its outputs cached, or "" when
    nothing keeps it there: a trained text encoder, a caption that changes per step, or a
    family whose samples cannot be drawn from cached prompts
    (`ModelFamily.pipeline_text_arguments`)."""
    spec = MODEL_TYPES[config.model.type]
    trained = [n for n in trained_components(config) if n in spec.text_encoders]
    if trained:
        return f"it is trained ({', '.join(f'components.{n}.train' for n in trained)})"
    varying = varying_datasets(config)
    if varying:
        return (f"{'; '.join(varying)} change their captions every epoch, so their outputs "
                "cannot be cached")
    if family_of(config.model.type).pipeline_text_arguments is None:
        return (f"{config.model.type.value}'s sampling pipeline takes no cached prompts, so "
                "samples need the encoder")
    return ""


def text_encoder_first(config: Config) -> str:
    """Why the run loads its text encoder together with the rest of the model, or "" when it
    loads it first, alone: every caption and sample prompt encoded and cached, the encoder
    released, and only then the VAE and the denoiser loaded (train/setup/text_first.py), so the
    two are never in RAM together. That needs the outputs cached and the encoder off the device
    (`text_encoder_leaves_device`), a family that loads its encoder apart
    (`ModelFamily.text_first`) from a diffusers folder or ComfyUI's split files (its
    `split_config_folder`), a run that never writes the encoder
    (a fine-tune saved as a diffusers folder writes every component) and one process."""
    from modules.config.outputs import SaveFormat
    from modules.config.schema import TrainingMethod
    from modules.models.single_file import is_single_file
    from modules.train.recipe.distributed import launched_distributed
    if not config.data.cache_text_encoder_outputs:
        return "its outputs are not cached (data.cache_text_encoder_outputs is off)"
    stays = text_encoder_stays(config)
    if stays:
        return f"it stays on the device: {stays}"
    text_first = family_of(config.model.type).text_first
    if text_first is None:
        return f"{MODEL_TYPES[config.model.type].label} models load it with the rest"
    if is_single_file(Path(config.model.path)) and text_first.split_config_folder is None:
        return "the model's single files are read together"
    if (config.training.method == TrainingMethod.FINE_TUNE
            and SaveFormat.DIFFUSERS in config.output.formats):
        return "a fine-tune saved as a diffusers folder (output.formats) writes it too"
    if launched_distributed():
        return "several processes each load the model"
    return ""


def module_device(module: nn.Module) -> torch.device:
    """Where a module's weights are (its first parameter's device)."""
    return next(module.parameters()).device


def is_on(module: nn.Module, device: torch.device) -> bool:
    """Whether the module's weights are on `device` ("cuda" is the current CUDA device, as
    torch reads it)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return module_device(module) == device


# The most recent rows a cache with an on-disk store keeps in memory (the repeated captions:
# the empty caption of caption dropout, the sample prompts); every other row is read from its
# file for each batch. A Klein 9B row is 512 x 12,288 bf16 values (12 MiB): 5 of them fit.
RESIDENT_ROW_BYTES = 64 * 2 ** 20


def row_bytes(row: Row) -> int:
    """The bytes of one cached row's tensors."""
    hidden, pooled, _ = row
    return sum(t.numel() * t.element_size() for t in (hidden, pooled) if t is not None)


class TextEncoderCache:
    """Encodes each caption once; later batches reuse the stored hidden states (and pooled).
    With a `store`, rows are written to disk and read back for each batch, on the CPU (a
    batch's go to the device when read): only the most recent `resident_bytes` of rows stay
    in memory (`RESIDENT_ROW_BYTES`), so a dataset of thousands of captions of a large encoder
    (a Klein 9B caption is 12 MiB) never fills the RAM. Without a store (tests only: every run
    that caches captions has one) every row stays in memory, on the run's device."""

    def __init__(self, bundle: ModelBundle, device: torch.device,
                 store: TextEmbeddingStore | None = None,
                 resident_bytes: int | None = None) -> None:
        self.bundle, self.device, self.store = bundle, device, store
        # caption -> (hidden, pooled, length), least recently used first: a caption of its own
        # length (chat encoders) keeps its real tokens only, padded again to each batch's
        # length when read
        self.entries: OrderedDict[str, Row] = OrderedDict()
        self.keep_on = torch.device("cpu") if store is not None else device
        self.bound = (None if store is None else
                      RESIDENT_ROW_BYTES if resident_bytes is None else resident_bytes)
        self.resident = 0  # bytes of the rows in `entries`
        self.peak_rows = self.peak_bytes = 0  # the most rows (and bytes) ever in `entries`
        self.encoded = 0  # captions actually run through the text encoder(s)

    def encoder_device(self) -> torch.device:
        """Where the text encoders are now: the run's device, or the CPU once `precache` has
        moved them off it (a caption no one foresaw is then encoded there)."""
        return module_device(next(iter(self.bundle.text_encoders.values())))

    def encoders_left(self) -> bool:
        """Whether the text encoders are off the run's device (samples then take the cached
        prompts): on the CPU, or released after every caption was cached
        (`text_encoder_first`)."""
        encoders = list(self.bundle.text_encoders.values())
        return not encoders or not is_on(encoders[0], self.device)

    def _encode_rows(self, captions: list[str]) -> dict[str, Row]:
        """Run `captions` through the text encoder(s), wherever they are."""
        if not self.bundle.text_encoders:
            raise ValueError(
                f"{len(captions)} caption(s) were not cached before the text encoder was "
                f"released (e.g. {captions[0]!r}): every caption and prompt is encoded "
                "before the model loads; turn data.cache_text_encoder_outputs off to encode "
                "captions during the run")
        encoded = family_of(self.bundle.model_type).encode_text(self.bundle, captions,
                                                               self.encoder_device(), None)
        rows: dict[str, Row] = {}
        for i, caption in enumerate(captions):
            length = None if encoded.lengths is None else int(encoded.lengths[i])
            hidden = encoded.hidden[i] if length is None else encoded.hidden[i, :length]
            pooled = None if encoded.pooled is None else encoded.pooled[i].to(self.keep_on,
                                                                            copy=True)
            rows[caption] = (hidden.to(self.keep_on, copy=True), pooled, length)
        self.encoded += len(captions)
        return rows

    def _keep(self, caption: str, row: Row) -> None:
        """Hold `row` in memory as the most recent; with a store, drop the least recent rows
        until the held rows are within the bound (they are on disk)."""
        if caption not in self.entries:
            self.resident += row_bytes(row)
        self.entries[caption] = row
        self.entries.move_to_end(caption)
        while self.bound is not None and self.entries and self.resident > self.bound:
            _, dropped = self.entries.popitem(last=False)
            self.resident -= row_bytes(dropped)
        self.peak_rows = max(self.peak_rows, len(self.entries))
        self.peak_bytes = max(self.peak_bytes, self.resident)

    def _row(self, caption: str) -> Row | None:
        """The cached row of `caption`: in memory, else read from the store (and then held as
        the most recent), else None."""
        row = self.entries.get(caption)
        if row is not None:
            self.entries.move_to_end(caption)
            return row
        row = self.store.load(caption) if self.store is not None else None
        if row is not None:
            self._keep(caption, row)
        return row

    def missing(self, captions: list[str]) -> list[str]:
        """The captions of `captions` neither in memory nor in the store (once each, in order),
        asked of each file's header: no row is read."""
        return [caption for caption in dict.fromkeys(captions)
                if caption not in self.entries
                and not (self.store is not None and self.store.holds(caption))]

    @torch.no_grad()
    def precache(self, captions: list[str], batch_size: int = 8) -> int:
        """Encode every caption of `captions` the store does not hold yet, in batches; returns
        how many were encoded (the others are on disk already)."""
        missing = self.missing(captions)
        for start in range(0, len(missing), batch_size):
            for caption, row in self._encode_rows(missing[start:start + batch_size]).items():
                if self.store is not None:
                    self.store.save(caption, row)
                self._keep(caption, row)
        return len(missing)

    @torch.no_grad()
    def encode(self, captions: list[str], varies: list[bool] | None = None) -> TextEmbeddings:
        """Hidden states (and pooled) for `captions`. A caption that `varies` (shuffled or
        dropped tags: another text next epoch) is encoded each time and not stored, so the
        cache holds only captions that come back, and never grows with every shuffle."""
        varies = varies or [False] * len(captions)
        rows: dict[str, Row] = {}
        for caption in dict.fromkeys(captions):
            row = self._row(caption)
            if row is not None:
                rows[caption] = row
        missing = [caption for caption in dict.fromkeys(captions) if caption not in rows]
        fresh = self._encode_rows(missing) if missing else {}
        for caption, changes in zip(captions, varies):
            if caption in fresh and not changes and caption not in self.entries:
                if self.store is not None:
                    self.store.save(caption, fresh[caption])
                self._keep(caption, fresh[caption])
        rows.update(fresh)
        embeddings = stack_rows([rows[c] for c in captions])
        if self.keep_on == self.device:
            return embeddings
        pooled = embeddings.pooled
        return embeddings._replace(
            hidden=embeddings.hidden.to(self.device, non_blocking=True),
            pooled=None if pooled is None else pooled.to(self.device, non_blocking=True),
            lengths=embeddings.lengths)  # on the CPU: caption_list reads them there

    def record(self) -> dict:
        """run.json's `text_cache`: the rows encoded, read from and written to disk, and the
        most rows held in memory at once against their bound (None: no store, all held)."""
        return {"encoded": self.encoded,
                "read_from_disk": self.store.read if self.store is not None else 0,
                "written_to_disk": self.store.written if self.store is not None else 0,
                "resident_bound_bytes": self.bound, "resident_rows_peak": self.peak_rows,
                "resident_bytes_peak": self.peak_bytes}


def stack_rows(rows: list[Row]) -> TextEmbeddings:
    """One batch's `TextEmbeddings` from per-caption rows (hidden, pooled, length)."""
    pooled_rows = [p for _, p, _ in rows if p is not None]
    if pooled_rows and len(pooled_rows) != len(rows):  # a family pools every caption or none
        raise ValueError("some captions have a pooled text embedding and some have none")
    pooled = torch.stack(pooled_rows) if pooled_rows else None
    if rows[0][2] is None:
        return TextEmbeddings(torch.stack([h for h, _, _ in rows]), pooled)
    return pad_to_batch([h for h, _, _ in rows], pooled)
