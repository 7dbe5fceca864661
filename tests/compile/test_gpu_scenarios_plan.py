"""The CUDA checks' configs (tests/gpu/scenarios.py) still get what those checks are about,
asked of the real plan on a faked CUDA machine: a GPU is lent too rarely to find out there."""
from __future__ import annotations

from modules.compile import Capabilities, CompileEngine, CompileFacts, build_plan
from modules.config.schema import CompileBackend
from modules.train.recipe.compile_guard import component_training
from modules.train.recipe.trainable import trained_components
from tests.gpu.scenarios import assert_unet_keeps_cudagraphs, cudagraphs_through_three_buckets

# What tests/gpu's check asserts first: an H100-like machine on which every backend runs.
H100 = Capabilities.everything("cuda")


def test_the_three_bucket_cuda_graph_check_keeps_cuda_graphs_on(tiny_config, tmp_path,
                                                                make_unet):
    config = cudagraphs_through_three_buckets(tiny_config, tmp_path / "data")
    training = component_training(config, trained_components(config))
    # the settings that make CUDA graphs hard are really in the config under test
    assert config.data.aspect_buckets and training["unet"].trained
    assert training["unet"].gradient_checkpointing and training["unet"].accumulation == 2

    plan = build_plan(config.compile, CompileFacts(H100, training))["unet"]
    assert plan.effective == CompileBackend.TRITON and plan.cudagraphs
    assert plan.degraded is None, plan.degraded

    # The same question through the engine the trainer builds (modules/train/recipe/compile_guard.py),
    # answered with the report run.json gets; applying is lazy, so nothing compiles here.
    engine = CompileEngine(config.compile, {"unet": make_unet(lora=False, checkpointing=True)},
                           capabilities=H100, training=training, cache_dir=tmp_path / "compile")
    try:
        engine.apply()
        assert_unet_keeps_cudagraphs(engine.report()["unet"])
    finally:
        engine.close()
