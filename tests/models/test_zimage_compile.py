"""Z-Image compiled, on the tiny model: REGIONAL over the blocks diffusers declares repeated
(ZImageTransformerBlock: main and refiner blocks), FULL as the alternative, each with no
recompile after the first pass over three aspect-ratio buckets and captions of many lengths,
samples drawn on the way; a stopped and resumed run equal to an unbroken one; and one run
through the real inductor."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.train.test_resume import assert_resumes_bit_for_bit, run_json

# three buckets at resolution 192 (128x256, 192x192, 256x128), two images each; captions from
# one word to past 64 tokens, so the batches' caption lengths differ step to step
SIZES = [(120, 60), (120, 60), (64, 64), (64, 64), (60, 120), (60, 120)]
CAPTIONS = ["a cat", "a very long caption about a noisy picture, with many words that go on "
            "past thirty-two tokens and then past sixty-four of them, for sure, yes indeed "
            "it does, on and on and on", "dog", "a noisy picture number three",
            "a picture of noise, bright and busy, red and blue dots over a grey field", "x"]


# FULL trains one image per bucket at batch size 1 (see its test): the long caption, the
# shortest and a middle one, so its steps still differ in caption length
SINGLES = (1, 2, 4)


@pytest.fixture
def buckets_config(tiny_config, tmp_path):
    pairs, singles = tmp_path / "pairs", tmp_path / "singles"
    pairs.mkdir()
    singles.mkdir()
    for i, (size, caption) in enumerate(zip(SIZES, CAPTIONS)):
        for folder in (pairs, singles) if i in SINGLES else (pairs,):
            Image.effect_noise(size, 30 + i).convert("RGB").save(folder / f"img{i:02d}.png")
            (folder / f"img{i:02d}.txt").write_text(caption, encoding="utf-8")

    def make(*overrides: str, folder=pairs):
        return tiny_config(
            "model.type=ZIMAGE", "model.path=builtin:tiny-zimage", f"data.datasets[0].path="
            f"{folder}", "data.resolution=192", "data.aspect_buckets=true",
            "training.max_steps=0", "training.epochs=2", "compile.backend=AOT_EAGER",
            'sampling.prompts=["a red circle --n a blue square --w 128 --h 256"]',
            "sampling.sampler=EULER", "sampling.steps=2", "sampling.every_steps=3", *overrides)
    make.singles = singles
    return make


@pytest.mark.parametrize("scope", ["REGIONAL", "FULL"])
def test_no_recompile_after_the_first_pass_over_buckets_and_caption_lengths(
        buckets_config, fresh_dynamo, scope):
    """Two epochs over 3 buckets, 6 steps, a sample in each pass (over 10 s: the least that
    shows a second pass, compiled: about 30 s each). FULL runs at batch size 1: at 2 and more,
    dynamo guards on which caption of a batch is the longest (the transformer pads them to the
    longest), one graph per order (docs/zimage.md); REGIONAL's blocks never see the captions
    apart, and train two images per bucket at batch size 2."""
    callbacks = RecordingCallbacks()
    if scope == "FULL":
        config = buckets_config("compile.scope=FULL", "training.batch_size=1",
                                folder=buckets_config.singles)
    else:
        config = buckets_config("compile.scope=REGIONAL", "training.batch_size=2")
    result = train(config, callbacks)

    record = json.loads((result.output_dir / "run.json").read_text())
    shapes, report = record["batch_shapes"], record["compile"]["unet"]
    assert shapes["distinct"] == 3 and result.steps == 6
    assert report["effective"] == "AOT_EAGER" and report["scope"] == scope
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert shapes["recompiles_after_first_pass"] == 0, shapes
    assert len(list((result.output_dir / "samples").glob("*.png"))) == 2
    assert not any(e.kind == "recompile" for e in callbacks.compile_events)
    if scope == "REGIONAL":  # the 2 main blocks and 1 + 1 refiner blocks, one class
        assert any("regional, 4 blocks" in e.message for e in callbacks.compile_events)


def test_a_stopped_and_resumed_run_is_the_unbroken_one(tiny_config, tmp_path):
    settings = ("model.type=ZIMAGE", "model.path=builtin:tiny-zimage", "sampling.prompts=[]",
                "training.max_steps=4", "training.lr_scheduler=COSINE",
                "loss.timestep_sampling=LOGIT_NORMAL")
    assert_resumes_bit_for_bit(tiny_config, tmp_path, settings)


@pytest.mark.inductor
def test_regional_inductor_compiles_the_blocks_and_runs_them(tiny_config, fresh_dynamo):
    """The real inductor (DEFAULT, what the presets compile with; INDUCTOR's autotuning is
    tests/compile/test_inductor.py's) over the tiny model's blocks, 2 steps at 64 px (minutes on a CPU: a
    graph per block kind, forward and backward). Two recompiles, both for a new sequence
    length (the refiners' and the main layers'); without modules/compile/grad_inputs.py a
    third, the second main layer's input requiring grad where the first one's did not. (A
    reason may still name requires_grad: the frozen caption refiner's graph differs from the
    main layers' in that too.)"""
    result = train(tiny_config("model.type=ZIMAGE", "model.path=builtin:tiny-zimage",
                               "sampling.prompts=[]", "training.max_steps=2",
                               "compile.backend=DEFAULT", "compile.scope=REGIONAL"))
    report = run_json(result.output_dir)["compile"]["unet"]
    assert report["effective"] == "DEFAULT" and report["compiled_code_ran"], report
    assert not report["degraded"], report
    assert report["recompiles"] == 2, report["recompile_reasons"]
