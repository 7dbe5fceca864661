"""The real inductor path (slow on a CPU: about a minute per graph). Run with -m inductor.

That a second process finds the persistent compile cache the first one filled (its report says
"hit" where the first said "miss", and compiles faster) is tests/bench/test_gpu_rehearsal.py's
test_compiled_cells_start_cold_then_warm_and_their_lora_loads: two processes of the UNet
there, through the same engine and `compile.cache_dir`."""
from __future__ import annotations

import pytest

from modules.compile import CompileEngine, detect_capabilities
from modules.config.schema import CompileBackend, CompileConfig, CompileScope, DynamicShapes

pytestmark = pytest.mark.inductor


def test_regional_inductor_training_matches_eager_across_resolutions(make_one_level_unet,
                                                                     train, tmp_path):
    # AUTO (the default): the second resolution recompiles each block dynamically, once.
    eager = train(make_one_level_unet(), steps=3, sizes=(8, 12))
    unet = make_one_level_unet()
    config = CompileConfig(backend=CompileBackend.INDUCTOR, scope=CompileScope.REGIONAL,
                           dynamic=DynamicShapes.AUTO)
    # Only the transformer blocks (one shape in the one-level UNet: all at 32 channels) keep
    # this to a few graphs.
    engine = CompileEngine(config, {"unet": unet}, capabilities=detect_capabilities("cpu"),
                           cache_dir=tmp_path / "cache",
                           regional_blocks={"unet": ("BasicTransformerBlock",),
                                            "text_encoder": (), "vae": ()})
    engine.apply()
    losses = train(unet, engine, steps=3, sizes=(8, 12))
    engine.close()
    report = engine.report()["unet"]
    assert report["effective"] == "INDUCTOR" and report["fallbacks"] == []
    assert report["compiled_code_ran"] is True
    assert losses == pytest.approx(eager, rel=1e-3, abs=1e-4)


def test_full_inductor_still_cannot_take_symbolic_height_and_width(make_unet):
    """The known limit behind plan.SPATIAL_DYNAMIC_LIMITS (torch 2.11 and 2.13). When a torch
    release fixes it this test fails: then lift the limit for that release."""
    import torch
    import torch._dynamo
    from torch._inductor.exc import InductorError

    unet = make_unet()
    unet.compile(backend="inductor", dynamic=None)
    latents = torch.randn(2, 4, 8, 8)
    torch._dynamo.maybe_mark_dynamic(latents, (2, 3))
    with pytest.raises(InductorError, match="cannot determine truth value of Relational"):
        unet(latents, torch.tensor([1, 2]), torch.randn(2, 7, 32)).sample.sum().backward()
