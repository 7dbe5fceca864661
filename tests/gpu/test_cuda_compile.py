"""The compile engine on CUDA, through the real trainer on the tiny model: what a CPU cannot
show of the CUDA-readiness work (sampling recompiles, late compile failures, OOM, CUDA graphs
with checkpointing / accumulation / buckets, text-encoder cache under CUDA graphs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modules.compile import backend_problem, detect_capabilities
from modules.compile.backends import BACKENDS, BackendRow
from modules.compile.capabilities import triton_c_compiler
from modules.config.schema import CompileBackend
from modules.events import RecordingCallbacks
from modules.models.families import family_of
from modules.train.recipe import recipe as recipe_module
from modules.train.recipe.builders import float32_precision
from modules.train.trainer import TrainingError, train
from tests.gpu.scenarios import (assert_unet_keeps_cudagraphs, bucket_images, buckets,
                                 cudagraphs_through_three_buckets)

FP32 = ("training.allow_tf32=false",)  # exact enough to compare compiled with eager losses


def record_of(result) -> dict:
    return json.loads((result.output_dir / "run.json").read_text())


def test_this_gpu_runs_every_backend():
    caps = detect_capabilities("cuda")
    assert caps.triton_ok, caps.triton_problem
    assert triton_c_compiler() is not None
    assert all(backend_problem(b, caps) is None for b in CompileBackend)


@pytest.mark.parametrize("backend", ["INDUCTOR", "TRITON"])
def test_sampling_with_a_compiled_unet_does_not_recompile(cuda_config, backend):  # item 1
    callbacks = RecordingCallbacks()
    result = train(cuda_config(f"compile.backend={backend}", "training.max_steps=6",
                               "sampling.every_steps=2", "sampling.steps=2",
                               'sampling.prompts=["a red circle"]'), callbacks)
    record = record_of(result)
    unet = record["compile"]["unet"]
    assert unet["effective"] == backend and unet["fallbacks"] == []
    assert unet["compiled_code_ran"] and unet["late_recompiles"] == 0
    assert record["batch_shapes"]["recompiles_after_first_pass"] == 0
    assert len(callbacks.samples) == 3


def test_a_compile_failure_at_a_late_bucket_falls_back(cuda_config, tmp_path,
                                                       monkeypatch):  # item 2
    from tests.compile.failing_backends import register_failing_after_first
    register_failing_after_first("tempera_gpu_late_fail", "tempera gpu test: a later compile failed")
    monkeypatch.setitem(BACKENDS, CompileBackend.TRITON,
                        BackendRow("tempera_gpu_late_fail", inductor=False))
    result = train(cuda_config(*buckets(bucket_images(tmp_path / "data")), "training.epochs=2",
                               "training.max_steps=0", "compile.backend=TRITON",
                               "compile.scope=FULL", "compile.dynamic=STATIC"))
    unet = record_of(result)["compile"]["unet"]
    assert result.status == "finished"
    assert [(f["from"], f["to"]) for f in unet["fallbacks"]] == [("TRITON", "INDUCTOR")]


def test_out_of_memory_is_reported_as_such(cuda_config, monkeypatch):  # item 3
    def huge(*args, **kwargs):
        return torch.empty(1 << 45, device="cuda")  # 32 TiB: a real CUDA OOM

    monkeypatch.setattr(recipe_module, "diffusion_loss", huge)
    config = cuda_config("compile.backend=INDUCTOR")
    with pytest.raises(TrainingError, match="out of memory at step 0.*batch_size"):
        train(config)
    record = json.loads((Path(config.output.dir) / "run.json").read_text())
    assert record["status"] == "failed"


@pytest.mark.parametrize("scope", ["FULL", "REGIONAL"])
def test_cuda_graphs_with_accumulation_and_checkpointing_train_like_eager(cuda_config, tmp_path,
                                                                          scope):  # item 4
    options = (*FP32, "training.max_steps=4", "training.gradient_accumulation=2",
               "training.gradient_checkpointing=true")
    eager = train(cuda_config(f"output.dir={tmp_path / 'eager'}", *options))
    graphs = train(cuda_config(f"output.dir={tmp_path / 'triton'}", *options,
                               "compile.backend=TRITON", f"compile.scope={scope}"))
    unet = record_of(graphs)["compile"]["unet"]
    assert unet["fallbacks"] == [] and unet["compiled_code_ran"]
    if scope == "FULL":
        assert unet["cudagraphs"] and unet["persistent_grads"]
    else:
        assert not unet["cudagraphs"] and "154306" in unet["degraded"]
    assert record_of(graphs)["losses"] == pytest.approx(record_of(eager)["losses"], rel=2e-3)


def test_triton_through_three_buckets_never_crashes_mid_epoch(tiny_config, tmp_path):  # item 4
    # FULL scope: CUDA graphs stay on with checkpointing there (tests/gpu/scenarios.py; the
    # plan's side of it is held on the CPU by tests/compile/test_gpu_scenarios_plan.py)
    data = bucket_images(tmp_path / "data")
    result = train(cudagraphs_through_three_buckets(tiny_config, data))
    record = record_of(result)
    unet, shapes = record["compile"]["unet"], record["batch_shapes"]
    assert result.status == "finished"
    assert_unet_keeps_cudagraphs(unet)
    assert unet["fallbacks"] == [] and unet["compiled_code_ran"]
    # all three bucket shapes trained (wide, square, tall), and trained again after the first
    # pass: the later epochs replay the recorded CUDA graphs of every bucket, no recompile
    sides = {(s["height"], s["width"]) for s in shapes["shapes"]}
    assert shapes["distinct"] == 3 and len(sides) == 3
    assert {(h > w) - (h < w) for h, w in sides} == {-1, 0, 1}
    assert shapes["micro_steps"] > shapes["first_pass_micro_steps"]
    assert shapes["recompiles_after_first_pass"] == 0


def test_cached_captions_stay_themselves_under_cuda_graphs(cuda_config, monkeypatch):  # item 5
    """Each cached caption is its own encoding, not another caption's: a cache entry that
    aliased a CUDA graph's output would hold whatever the next replay wrote there."""
    from modules.train.recipe import text_cache

    caches = []

    class Kept(text_cache.TextEncoderCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    import modules.train.setup.start as start_module
    monkeypatch.setattr(start_module, "TextEncoderCache", Kept)
    # One precision for the cache and the fresh encodes below: full float32. A TF32 cache was
    # 2.6e-3 from a float32 encode (a TF32 simulation), past the 1e-4 below; TF32 on both sides
    # is no cure, the compiled and the eager kernels would round differently. Distinct captions
    # of the tiny model differ by 0.33 at least (measured on the CPU), so 1e-4 tells them apart.
    config = cuda_config(*FP32, "compile.backend=TRITON", "compile.text_encoder=true",
                         "data.cache_text_encoder_outputs=true", "training.max_steps=8")
    result = train(config)
    assert record_of(result)["compile"]["text_encoder"]["cudagraphs"]
    [cache] = caches
    assert len(cache.entries) > 2  # several batches of captions, each a CUDA-graph replay
    # run.close() restored the precision from before the run: set the run's own again
    restore, precision = float32_precision(config, torch.device("cuda"))
    try:
        assert record_of(result)["precision"] == precision  # the one the cache was filled at
        with torch.no_grad():
            fresh = {caption: family_of(cache.bundle.model_type).encode_text(cache.bundle, [caption],
                                                           torch.device("cuda"), None)[0][0]
                     .clone() for caption in cache.entries}
    finally:
        restore()
    for caption, (hidden, *_) in cache.entries.items():  # (hidden, pooled, length)
        assert torch.allclose(hidden, fresh[caption], atol=1e-4), caption
        others = [(hidden - fresh[other]).abs().max().item() for other in fresh if other != caption]
        assert min(others) > 1e-2, caption  # the tolerance does tell one caption from another
