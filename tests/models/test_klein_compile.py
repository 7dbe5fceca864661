"""Flux.2 Klein compiled, on the tiny model: REGIONAL over both block classes diffusers
declares repeated (Flux2TransformerBlock, the double-stream blocks; Flux2SingleTransformerBlock,
the single-stream ones), FULL as the alternative, each with no recompile after the first pass
over three aspect-ratio buckets and captions of many lengths, samples drawn on the way; Check
compilation explains a region of each class; and one run through the real inductor."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.train.test_resume import run_json

# three buckets at resolution 192 (128x256, 192x192, 256x128), two images each; captions from
# one word to past 64 tokens (Klein pads every one to 512 tokens: their lengths must not reach
# the transformer as shapes)
SIZES = [(120, 60), (120, 60), (64, 64), (64, 64), (60, 120), (60, 120)]
CAPTIONS = ["a cat", "a very long caption about a noisy picture, with many words that go on "
            "past thirty-two tokens and then past sixty-four of them, for sure, yes indeed "
            "it does, on and on and on", "dog", "a noisy picture number three",
            "a picture of noise, bright and busy, red and blue dots over a grey field", "x"]
BLOCK_CLASSES = {"Flux2TransformerBlock", "Flux2SingleTransformerBlock"}


@pytest.fixture
def buckets_config(tiny_config, tmp_path):
    for i, (size, caption) in enumerate(zip(SIZES, CAPTIONS)):
        Image.effect_noise(size, 30 + i).convert("RGB").save(tmp_path / f"img{i:02d}.png")
        (tmp_path / f"img{i:02d}.txt").write_text(caption, encoding="utf-8")

    def make(*overrides: str):
        return tiny_config(
            "model.type=KLEIN", "model.path=builtin:tiny-klein", f"data.datasets[0].path="
            f"{tmp_path}", "data.resolution=192", "data.aspect_buckets=true",
            "training.max_steps=0", "training.epochs=2", "training.batch_size=2",
            "compile.backend=AOT_EAGER",
            'sampling.prompts=["a red circle --n a blue square --w 128 --h 256"]',
            "sampling.sampler=EULER", "sampling.steps=2", "sampling.every_steps=3", *overrides)
    return make


@pytest.mark.parametrize("scope", ["REGIONAL", "FULL"])
def test_no_recompile_after_the_first_pass_over_buckets_and_caption_lengths(
        buckets_config, fresh_dynamo, scope):
    """Two epochs over 3 buckets at batch size 2, 6 steps, a sample in each pass. FULL needs
    no batch size 1 here (Z-Image's does): every caption is 512 tokens, so no batch has a
    longest caption for dynamo to guard on."""
    callbacks = RecordingCallbacks()
    result = train(buckets_config(f"compile.scope={scope}"), callbacks)

    record = json.loads((result.output_dir / "run.json").read_text())
    shapes, report = record["batch_shapes"], record["compile"]["unet"]
    assert shapes["distinct"] == 3 and result.steps == 6
    assert report["effective"] == "AOT_EAGER" and report["scope"] == scope
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert shapes["recompiles_after_first_pass"] == 0, shapes
    assert len(list((result.output_dir / "samples").glob("*.png"))) == 2
    assert not any(e.kind == "recompile" for e in callbacks.compile_events)
    if scope == "REGIONAL":  # 2 double-stream and 2 single-stream blocks, two classes
        assert any("regional, 4 blocks" in e.message for e in callbacks.compile_events)


def test_check_compilation_explains_a_region_of_each_block_class(tiny_config, fresh_dynamo):
    """What "Check compilation" reports for REGIONAL: one region per block class, both of
    Klein's, each compiled (the plan and the run compile the same two)."""
    from modules.train.setup.explain_run import explain_config
    config = tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                         "sampling.prompts=[]", "compile.backend=AOT_EAGER",
                         "compile.scope=REGIONAL", "compile.text_encoder=false",
                         "compile.vae=false")
    unet = explain_config(config)["unet"]
    assert {region["module"] for region in unet["regions"]} == BLOCK_CLASSES, unet["regions"]
    assert all(region["graphs"] >= 1 for region in unet["regions"]), unet["regions"]


@pytest.mark.inductor
def test_regional_inductor_compiles_the_blocks_and_runs_them(tiny_config, fresh_dynamo):
    """The real inductor (DEFAULT, what the presets compile with; INDUCTOR's autotuning is
    tests/compile/test_inductor.py's) over the tiny model's two block classes, 2 steps at 64 px (minutes on
    a CPU: a graph per block class, forward and backward)."""
    result = train(tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                               "sampling.prompts=[]", "training.max_steps=2",
                               "compile.backend=DEFAULT", "compile.scope=REGIONAL"))
    report = run_json(result.output_dir)["compile"]["unet"]
    assert report["effective"] == "DEFAULT" and report["compiled_code_ran"], report
    assert not report["degraded"], report
