"""The text path a large encoder needs, on the tiny Z-Image: caption embeddings on disk keyed
by caption and encoder identity, read back instead of encoded; the encoder leaves the device
only when every caption is known up front (the memory plan then does not count it), and
captions that change per step are named; samples drawn from cached prompts are the pipeline's
own."""
from __future__ import annotations

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.prompts import SamplePrompt
from modules.model_types import ModelType
from modules.models.families import family_of
from modules.train.outputs.sampling import prompt_texts
from modules.train.recipe.text_cache import (TextEncoderCache, text_encoder_leaves_device,
                                             varying_datasets)
from modules.train.recipe.text_store import TextEmbeddingStore, encoder_identity

CAPTIONS = ["a red circle", "a blue square on a yellow field", ""]


@pytest.fixture(scope="module")
def bundle(zimage_folder):
    return family_of(ModelType.ZIMAGE).load_folder(zimage_folder, None, torch.float32)


def _config(*overrides: str) -> Config:
    return apply_overrides(Config(), ["model.type=ZIMAGE", "model.path=builtin:tiny-zimage",
                                      "data.cache_text_encoder_outputs=true", *overrides])


def test_embeddings_are_stored_on_disk_and_read_back_instead_of_encoded(bundle, tmp_path):
    store = TextEmbeddingStore(tmp_path, encoder_identity(bundle))
    first = TextEncoderCache(bundle, torch.device("cpu"), store)
    assert first.precache(CAPTIONS) == 3 and store.written == 3
    again = TextEncoderCache(bundle, torch.device("cpu"),
                             TextEmbeddingStore(tmp_path, encoder_identity(bundle)))
    assert again.precache(CAPTIONS) == 0 and again.encoded == 0  # all read from disk
    want, got = first.encode(CAPTIONS), again.encode(CAPTIONS)
    assert torch.equal(want.hidden, got.hidden) and torch.equal(want.lengths, got.lengths)
    direct = family_of(ModelType.ZIMAGE).encode_text(bundle, CAPTIONS, torch.device("cpu"))
    for i, n in enumerate(direct.lengths.tolist()):  # what the encoder gives, exactly
        assert torch.equal(got.hidden[i, :n], direct.hidden[i, :n])
    store.path(CAPTIONS[0]).write_bytes(b"damaged")  # a bad file is a miss, never a crash
    assert TextEncoderCache(bundle, torch.device("cpu"), store).precache(CAPTIONS) == 1


def test_the_encoder_identity_changes_with_the_weights_and_the_template(bundle):
    identity = encoder_identity(bundle)
    tokenizer = bundle.tokenizers["tokenizer"]
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template = template + " "
        assert encoder_identity(bundle) != identity
    finally:
        tokenizer.chat_template = template
    weight = next(bundle.text_encoders["text_encoder"].parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1e-3)
        try:
            assert encoder_identity(bundle) != identity
        finally:
            weight.copy_(saved)
    assert encoder_identity(bundle) == identity


def test_the_encoder_leaves_the_device_only_when_every_caption_is_known():
    assert text_encoder_leaves_device(_config())
    shuffled = _config('data.datasets=[{"path": "builtin:shapes", "shuffle_tags": true}]')
    assert not text_encoder_leaves_device(shuffled)
    assert varying_datasets(shuffled) == ["data.datasets[0] (builtin:shapes: shuffle_tags)"]
    assert not text_encoder_leaves_device(_config("data.cache_text_encoder_outputs=false"))
    # SD's pipelines take encoded prompts too: its encoder leaves as well (test_placement.py)
    assert text_encoder_leaves_device(_config("model.type=SD15", "model.path=builtin:tiny-sd15"))


def test_the_memory_plan_counts_the_encoder_only_while_it_stays(zimage_folder):
    from modules.train.memory.memory_plan import plan_memory
    leaving = plan_memory(_config(), zimage_folder)
    staying = plan_memory(_config('data.datasets=[{"path": "builtin:shapes", '
                                  '"tag_dropout": 0.1}]'), zimage_folder)
    encoder_bytes = staying.total - leaving.total
    line = next(size for what, size in staying.lines if what.startswith("text_encoder"))
    assert encoder_bytes == line > 0
    assert any("only while its outputs are cached" in what for what, _ in leaving.lines)


def test_samples_from_cached_prompts_are_the_pipelines_own(bundle, tmp_path, zimage_folder):
    from diffusers import ZImagePipeline
    pipe = ZImagePipeline.from_pretrained(zimage_folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    cache = TextEncoderCache(bundle, torch.device("cpu"),
                             TextEmbeddingStore(tmp_path, encoder_identity(bundle)))
    prompt = SamplePrompt("a red circle", "a blue square", 64, 64, 0, 2, 4.0)

    def image(**arguments):
        return pipe(**arguments, height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images
    cached = prompt_texts(bundle, prompt, cache)
    assert set(cached) == {"prompt_embeds", "negative_prompt_embeds"}
    torch.testing.assert_close(image(**cached), image(**prompt_texts(bundle, prompt)))
