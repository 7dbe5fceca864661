"""Flux.2 Klein compiled, on the tiny model: REGIONAL over both block classes diffusers
declares repeated (Flux2TransformerBlock, the double-stream blocks; Flux2SingleTransformerBlock,
the single-stream ones), FULL as the alternative, each with no recompile after the first pass
over three aspect-ratio buckets and captions of many lengths, samples drawn on the way; Check
compilation explains a region of each class; a run killed with kill -9 mid-run and resumed
equal to an unbroken one; and one run through the real inductor."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from modules.events import RecordingCallbacks
from modules.train.state.backup_files import list_backups
from modules.train.trainer import train
from tests.cli.test_resume_cli import latest_backup, wait_for
from tests.child_env import REPO, with_repo_on_pythonpath
from tests.train.test_resume import assert_resumed_as, run_json

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


def test_a_run_killed_with_kill_9_and_resumed_is_the_unbroken_one(tiny_config, tmp_path):
    """`tempera-train` killed with SIGKILL once its backup of step 2 is on disk (in step 3, or
    writing its backup: wherever the kill lands) leaves a run whose resume has the unbroken
    run's losses, step by step, and its final LoRA, bit for bit: the model, optimizer,
    schedule, RNG, the data order and Klein's caption cache (written before step 1) all come
    back. One child process (seconds of imports), the rest in this process."""
    import subprocess
    import sys
    settings = ("model.type=KLEIN", "model.path=builtin:tiny-klein", "training.max_steps=6",
                "training.lr_scheduler=COSINE", "loss.timestep_sampling=LOGIT_NORMAL",
                "loss.dynamic_shift=true", "data.cache_text_encoder_outputs=true",
                "output.backup_every_steps=1", "output.keep_backups=2")
    train(tiny_config(*settings, f"output.dir={tmp_path / 'whole'}"), RecordingCallbacks())
    parts = tiny_config(*settings, f"output.dir={tmp_path / 'parts'}")
    config = tmp_path / "parts.json"
    config.write_text("{}")
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--config", str(config), "--quiet",
         *(f"--set={s}" for s in (*settings, f"general.cache_dir={parts.general.cache_dir}",
                                  f"output.dir={tmp_path / 'parts'}", "data.resolution=64",
                                  "training.batch_size=2", "training.learning_rate=1e-3",
                                  "sampling.prompts=[]", "logging.tensorboard=false"))],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=with_repo_on_pythonpath())
    try:
        assert wait_for(lambda: latest_backup(tmp_path / "parts") >= 2 or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()  # killed before the end, not finished
    finally:
        proc.kill()
        proc.communicate()
    assert run_json(tmp_path / "parts")["status"] == "running"  # what kill -9 leaves
    assert 2 <= list_backups(tmp_path / "parts")[-1][0] < 6
    parts.training.resume_from = "latest"
    assert train(parts, RecordingCallbacks()).steps == 6
    assert_resumed_as(tmp_path / "whole", tmp_path / "parts")


@pytest.mark.inductor
def test_regional_inductor_compiles_the_blocks_and_runs_them(tiny_config, fresh_dynamo):
    """The real inductor (DEFAULT, what the presets compile with; INDUCTOR's autotuning is
    tests/compile/test_inductor.py's) over the tiny model's two block classes, 2 steps at 64 px (minutes on
    a CPU: a graph per block class, forward and backward). One graph per class: the first
    double-stream block's input comes from frozen layers, the second's through LoRA, and both
    meet the graph the first compiled (modules/compile/grad_inputs.py; without it the class
    compiled twice: "requires_grad mismatch")."""
    result = train(tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                               "sampling.prompts=[]", "training.max_steps=2",
                               "compile.backend=DEFAULT", "compile.scope=REGIONAL"))
    report = run_json(result.output_dir)["compile"]["unet"]
    assert report["effective"] == "DEFAULT" and report["compiled_code_ran"], report
    assert not report["degraded"], report
    assert report["recompiles"] == 0, report["recompile_reasons"]
