"""Cached captions stay on disk (train/recipe/text_cache.py, issue 56 item 2, issue 58 item 4):
a run reads each batch's rows from their files and keeps only the most recent in memory, up to
`RESIDENT_ROW_BYTES`, so 2,000 Klein 9B captions (12 MiB each) never fill the RAM, and the RAM
plan counts that bound, not every caption.

The runs are tiny Klein runs (64 px, 2 steps, caption dropout, one sample from the cached
prompts): one with today's behaviour (the tiny rows all fit the bound: every row held), one
whose bound is two rows, which reads every other row from disk."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.loader import load_config
from modules.model_types import ModelType
from modules.models.bundle import ModelBundle
from modules.train.memory.memory_plan import GIB
from modules.train.memory.ram_plan import plan_ram
from modules.train.recipe import text_cache
from modules.train.recipe.text_cache import RESIDENT_ROW_BYTES, TextEncoderCache
from modules.train.recipe.text_store import TextEmbeddingStore
from modules.train.trainer import train
from tests.train.test_resume import run_json

REPO = Path(__file__).resolve().parents[2]
KLEIN_9B_ROW = (512, 3 * 4096)  # 512 tokens, layers 9, 18 and 27 of Qwen3-8B stacked


def _config(cache: Path, out: Path, prefix: str) -> Config:
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", "data.resolution=64",
        f'data.datasets=[{{"path": "builtin:shapes", "caption_prefix": "{prefix}"}}]',
        "model.type=KLEIN", "model.path=builtin:tiny-klein", "training.max_steps=2",
        "training.batch_size=2", "training.learning_rate=1e-2", "training.lora_rank=4",
        "logging.tensorboard=false", "data.cache_latents=true", "data.caption_dropout=0.5",
        "data.cache_text_encoder_outputs=true", 'sampling.prompts=["a red circle"]',
        "sampling.negative_prompt=blurry", "sampling.sampler=EULER", "sampling.steps=2",
        "sampling.guidance_scale=4"])


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory):
    """("held", "bounded") -> output folder. The first run encodes this session's captions
    (their prefix is new) and holds them all; the second reads them from disk with room for
    two rows in memory. Over 10 s (two tiny Klein runs, 13 s together): what a run reads from
    disk, and that it trains the same, only a run shows."""
    root = tmp_path_factory.mktemp("text-rows")
    prefix = f"tr{root.name}"
    held = train(_config(tempera_cache, root / "held", prefix))
    record = held.record["text_cache"]
    row = record["resident_bytes_peak"] // record["resident_rows_peak"]  # Klein: one length
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(text_cache, "RESIDENT_ROW_BYTES", 2 * row)
        bounded = train(_config(tempera_cache, root / "bounded", prefix))
    assert held.status == bounded.status == "finished"
    return {"held": root / "held", "bounded": root / "bounded", "row": row}


def test_rows_read_from_disk_train_exactly_like_rows_held_in_memory(runs):
    held, bounded = run_json(runs["held"]), run_json(runs["bounded"])
    assert len(held["losses"]) == 2 and held["losses"] == bounded["losses"]
    samples = [sorted((runs[name] / "samples").glob("*.png")) for name in ("held", "bounded")]
    assert len(samples[0]) == len(samples[1]) == 1
    assert samples[0][0].read_bytes() == samples[1][0].read_bytes()  # from cached prompts


def test_a_run_holds_no_more_rows_than_the_bound(runs):
    held, bounded = run_json(runs["held"])["text_cache"], run_json(runs["bounded"])["text_cache"]
    row = runs["row"]
    # every caption, "" (caption dropout) and both sample prompts were cached by the first run
    # (the prompts perhaps by another test's run: then read from disk) and all held
    assert held["encoded"] > 4
    assert held["resident_rows_peak"] == held["encoded"] + held["read_from_disk"]
    assert bounded["encoded"] == 0 and bounded["resident_bound_bytes"] == 2 * row
    assert bounded["resident_rows_peak"] == 2 and bounded["resident_bytes_peak"] <= 2 * row
    # the batches and the sample read more rows than the bound holds, from disk
    assert bounded["read_from_disk"] > bounded["resident_rows_peak"]


def test_klein_9b_rows_at_real_size_stay_within_the_bound(tmp_path):
    """Real-size rows (512 x 12,288 bf16, 12 MiB each), more than the bound holds, read in
    batches of two by a cache whose encoder was released: each is its own caption's, and no
    more than the bound is ever held."""
    store = TextEmbeddingStore(tmp_path, "klein9b")
    per_row = KLEIN_9B_ROW[0] * KLEIN_9B_ROW[1] * 2
    fits = RESIDENT_ROW_BYTES // per_row
    captions = [f"caption {i}" for i in range(fits + 3)]
    for i, caption in enumerate(captions):
        store.save(caption, (torch.full(KLEIN_9B_ROW, float(i), dtype=torch.bfloat16), None,
                             None))
    released = ModelBundle(ModelType.KLEIN, Path("."), None, None, {}, {}, None)
    cache = TextEncoderCache(released, torch.device("cpu"), store)
    assert cache.missing(captions) == [] and cache.missing(["unseen"]) == ["unseen"]
    for start in range(0, len(captions), 2):
        hidden = cache.encode(captions[start:start + 2]).hidden
        assert [int(h[0, 0]) for h in hidden] == list(range(start, start + len(hidden)))
        assert cache.resident <= RESIDENT_ROW_BYTES
    assert cache.peak_rows == fits < len(captions) and cache.peak_bytes <= RESIDENT_ROW_BYTES
    assert store.read == len(captions) and cache.encoded == 0
    with pytest.raises(ValueError, match="'unseen'.*data.cache_text_encoder_outputs"):
        cache.encode(["unseen"])


def test_the_ram_plan_counts_the_bound_not_every_caption():
    """The 9B LoRA preset for 16 GB at real size (weightless): each phase the cache lives
    through holds at most `RESIDENT_ROW_BYTES` of caption rows, where holding 2,000 captions
    would have added 23 GiB to the run's peak."""
    config = apply_overrides(load_config(REPO / "training_presets/klein/lora_9b_16gb.json"),
                             ['data.datasets=[{"path": "builtin:shapes"}]'])
    folder = REPO / "modules/models/configs/klein9b"
    plan = plan_ram(config, folder, torch.device("cuda"))
    for phase in plan.phases:  # the text encoder loads first: it caches before the rest loads
        [rows] = [size for what, size in phase.lines if what.startswith("caption rows")]
        assert rows == RESIDENT_ROW_BYTES
    every_caption = 2000 * KLEIN_9B_ROW[0] * KLEIN_9B_ROW[1] * 2
    assert every_caption > 23 * GIB and plan.peak.total < 17.5 * GIB + RESIDENT_ROW_BYTES
    off = plan_ram(apply_overrides(config, ["data.cache_text_encoder_outputs=false"]),
                   folder, torch.device("cuda"))
    assert not any(what.startswith("caption rows") for p in off.phases for what, _ in p.lines)
