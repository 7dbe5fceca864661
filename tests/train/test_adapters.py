"""Each adapter through the real trainer: it trains, saves where its tools read it, resumes bit
for bit with its dropouts on, compiles whole, and is refused where it cannot work."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.config.caveats import DORA_TEXT_ENCODER
from modules.config.schema import Adapter, Config
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.train.test_resume import final_tensors, run_json, stop_then_resume

METHODS = {
    Adapter.LORA: ("training.use_rslora=true", "training.lora_dropout=0.1"),
    Adapter.LOCON: ("training.conv_rank=2", "training.lora_dropout=0.1"),
    Adapter.LOHA: ("training.conv_rank=2", "training.module_dropout=0.2",
                   "training.rank_dropout=0.2"),
    Adapter.LOKR: ("training.conv_rank=2", "training.rank_dropout=0.2"),
    Adapter.DORA: ("training.conv_rank=2",),
}
SUFFIX = {Adapter.LORA: "lora_down.weight", Adapter.LOCON: "lora_down.weight",
          Adapter.LOHA: "hada_w1_a", Adapter.LOKR: "lokr_w1", Adapter.DORA: "dora_scale"}


@pytest.mark.parametrize("adapter", list(METHODS), ids=[a.value for a in METHODS])
def test_each_adapter_trains_and_saves_its_kohya_file(adapter, tiny_config):
    config = tiny_config(f"training.adapter={adapter.value}", *METHODS[adapter],
                         "training.max_steps=3", "output.formats=kohya",
                         "components.text_encoder.train=true", "training.lora_rank=4")
    result = train(config)
    assert result.status == "finished"
    record = run_json(result.output_dir)
    assert len(record["losses"]) == 3 and all(torch.isfinite(torch.tensor(record["losses"])))
    path = result.output_dir / "final" / "lora_kohya.safetensors"
    tensors = load_file(str(path))
    assert any(k.endswith("." + SUFFIX[adapter]) for k in tensors)
    assert any(k.startswith("lora_te_") for k in tensors)
    if adapter != Adapter.LORA:
        assert any("resnets_0_conv1." in k for k in tensors)
    # trained: the update-carrying tensors moved away from their initial values
    # (LoRA's up / LoHa's w2_a / LoKr's w2 start at zero)
    zero_init = {"lora_up.weight", "hada_w2_a", "lokr_w2", "lokr_w2_b"}
    moved = [v for k, v in tensors.items() if k.split(".", 1)[1] in zero_init]
    assert moved and all(v.abs().sum() > 0 for v in moved)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    args = json.loads(meta["ss_network_args"])
    if adapter in (Adapter.LOHA, Adapter.LOKR):
        assert meta["ss_network_module"] == "lycoris.kohya"
        assert args["algo"] == adapter.value.lower()
    if adapter != Adapter.LORA:
        assert args["conv_dim"] == "2"


def test_loha_with_dropouts_resumes_bit_for_bit(tiny_config, tmp_path):
    """Module and rank dropout draw from torch's generator, seeded per step: the resumed
    run drops exactly what the uninterrupted one dropped."""
    settings = ("training.adapter=LOHA", "training.conv_rank=2", "training.module_dropout=0.3",
                "training.rank_dropout=0.3", "training.max_steps=4", "output.formats=kohya")
    train(tiny_config(*settings, f"output.dir={tmp_path / 'whole'}"), RecordingCallbacks())
    _, resumed = stop_then_resume(tiny_config(*settings, f"output.dir={tmp_path / 'parts'}"), 2)
    assert resumed.steps == 4
    assert run_json(tmp_path / "parts")["losses"] == run_json(tmp_path / "whole")["losses"]
    want, have = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[k], have[k]) for k in want)
    # and the dropout really acts: another seed for it gives other losses
    other = train(tiny_config(*settings, "training.module_dropout=0.6",
                              f"output.dir={tmp_path / 'other'}"))
    assert run_json(other.output_dir)["losses"] != run_json(tmp_path / "whole")["losses"]


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("adapter", [Adapter.LOHA])
def test_lycoris_layers_trace_without_graph_breaks(adapter, tiny_config, fresh_dynamo):
    """peft's own LoHa / LoKr forward breaks the graph at every layer (a Python branch on a
    random tensor); Tempera's forward keeps it whole, dropouts on. LoKr's, with the same
    dropouts: test_lokr_compiles_with_aot_eager_and_never_recompiles (one forward and one
    backward graph in training, where a break would compile more)."""
    import torch._dynamo
    from modules.train.recipe.adapters import add_adapter
    from tests.compile.conftest import build_one_level_unet

    # the tiny UNet with one level: every layer kind an adapter wraps (attention projections,
    # resnet convolutions, the time embedding), in half the tracing time
    unet = build_one_level_unet()
    unet.requires_grad_(False)
    add_adapter(unet, tiny_config(f"training.adapter={adapter.value}", *METHODS[adapter],
                                  "training.module_dropout=0.2"), denoiser=True)
    unet.train()
    latents = torch.randn(1, unet.config.in_channels, 8, 8)
    context = torch.randn(1, 4, unet.config.cross_attention_dim)
    explained = torch._dynamo.explain(unet)(latents, torch.tensor([10]), context)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_lokr_compiles_with_aot_eager_and_never_recompiles(tiny_config, tmp_path, fresh_dynamo):
    """LoKr with its dropouts (rank and module) under FULL AOT_EAGER: no graph break (the check
    test_lycoris_layers_trace_without_graph_breaks makes for LoHa), no recompile, the eager
    run's losses. Over 10 s: two 4-step runs, one compiled."""
    settings = ("training.adapter=LOKR", "training.conv_rank=2", "training.rank_dropout=0.2",
                "training.module_dropout=0.2", "training.max_steps=4", "output.formats=kohya")
    eager = train(tiny_config(*settings, f"output.dir={tmp_path / 'eager'}"))
    compiled = train(tiny_config(*settings, f"output.dir={tmp_path / 'compiled'}",
                                 "compile.backend=AOT_EAGER", "compile.scope=FULL"))
    record = run_json(compiled.output_dir)
    unet = record["compile"]["unet"]
    assert unet["effective"] == "AOT_EAGER" and unet["compiled_code_ran"]
    assert unet["recompiles"] == 0 and unet["late_recompiles"] == 0
    assert unet["compiles"] <= 2, "graph breaks would compile more graphs"  # forward + backward
    assert record["losses"] == pytest.approx(run_json(eager.output_dir)["losses"], rel=1e-4)


@pytest.mark.parametrize("adapter", [Adapter.LOCON, Adapter.DORA])
def test_diffusers_layout_loads_with_every_layer(adapter, tiny_config, pipelines):
    """LoCon and DoRA in the diffusers/peft layout: diffusers' load_lora_weights restores
    every adapted layer (convolutions and the UNet's DoRA magnitudes too) and renders what
    was trained. A DoRA text encoder's magnitudes are what does not hold (below)."""
    dora = adapter == Adapter.DORA
    callbacks = RecordingCallbacks()
    result = train(tiny_config(f"training.adapter={adapter.value}", "training.conv_rank=2",
                               "training.max_steps=2", "output.formats=diffusers",
                               *(["components.text_encoder.train=true"] if dora else [])),
                   callbacks)
    base_folder = json.loads((result.output_dir / "config.json").read_text())["model"]["path"]
    pipe = pipelines.load(base_folder)
    before = pipelines.image(pipe)
    pipe.load_lora_weights(str(result.output_dir / "final"),
                           weight_name="pytorch_lora_weights.safetensors")
    from peft.tuners.lora import LoraLayer
    layers = {n: m for n, m in pipe.unet.named_modules() if isinstance(m, LoraLayer)}
    assert any(n.endswith("resnets.0.conv1") for n in layers)
    conv = next(m for n, m in layers.items() if n.endswith("resnets.0.conv1"))
    assert conv.r["default_0"] == 2
    if dora:
        assert all(m.use_dora["default_0"] for m in layers.values())
        assert_dora_text_encoder_magnitudes_are_dropped(result.output_dir, pipe, layers)
        assert any(DORA_TEXT_ENCODER in s for s in callbacks.statuses)  # said at the start
    assert not torch.allclose(pipelines.image(pipe), before, atol=1e-5)


def assert_dora_text_encoder_magnitudes_are_dropped(output, pipe, unet_layers) -> None:
    """What holds in diffusers 0.42 / transformers 5 (docs/adapters.md): the UNet's trained
    DoRA magnitudes load exactly; the text encoder's are dropped (transformers reports each
    `lora_magnitude_vector` key as unexpected and keeps its start value, the weight's norm).
    When this fails because upstream loads them, correct the docs and drop the warning."""
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file
    saved = load_file(str(output / "final" / "pytorch_lora_weights.safetensors"))
    for name, layer in unet_layers.items():
        loaded = layer.lora_magnitude_vector["default_0"].weight
        assert torch.equal(loaded, saved[f"unet.{name}.lora_magnitude_vector"]), name
    text = {n: m for n, m in pipe.text_encoder.named_modules() if isinstance(m, LoraLayer)}
    assert text
    for name, layer in text.items():
        (key,) = [k for k in saved if k.startswith("text_encoder.")
                  and k.endswith(f"{name}.lora_magnitude_vector")]
        loaded = layer.lora_magnitude_vector["default_0"].weight
        norm = layer.get_base_layer().weight.norm(dim=1)
        assert not torch.equal(loaded, saved[key]) and torch.allclose(loaded, norm), name


def _problems(*overrides: str) -> dict[str, str]:
    from modules.config.overrides import apply_overrides
    config = apply_overrides(Config(), list(overrides))
    return {p.path: str(p) for p in validate(config)}


def test_options_a_method_lacks_are_refused_with_the_fix():
    assert not _problems("training.adapter=LOCON", "training.conv_rank=8",
                         "training.use_rslora=true", "output.formats=diffusers,kohya")
    assert not _problems("training.adapter=LOKR", "training.rank_dropout=0.1",
                         "training.lokr_factor=4", "output.formats=kohya")
    got = _problems("training.adapter=LOHA", "training.use_rslora=true",
                    "training.lora_dropout=0.1")
    assert "LORA / LOCON / DORA have it" in got["training.use_rslora"]
    assert "training.lora_dropout" in got
    assert "use KOHYA" in got["output.formats[0]"]
    assert "use LOCON" in _problems("training.conv_rank=4")["training.conv_rank"]
    assert "expected at least 1" in _problems("training.adapter=LOCON")["training.conv_rank"]
    assert "training.module_dropout" in _problems("training.module_dropout=0.1")
    assert "training.lokr_factor" in _problems("training.adapter=LOHA", "training.lokr_factor=2",
                                               "output.formats=kohya")
    # fine-tuning has no adapter: its options are not checked
    assert not _problems("training.method=FINE_TUNE", "training.adapter=LOHA",
                         "output.formats=diffusers")


@pytest.mark.parametrize("adapter", [Adapter.LORA, Adapter.LOCON, Adapter.DORA])
def test_lora_family_layers_trace_without_graph_breaks(adapter, tiny_config, fresh_dynamo):
    """LoRA, LoCon (convolutions too) and DoRA through peft's own forward, with their
    options on (rsLoRA, dropout): one graph, so compiling them costs no extra graphs."""
    import torch._dynamo
    from modules.train.recipe.adapters import add_adapter
    from tests.compile.conftest import build_one_level_unet

    # the tiny UNet with one level: every layer kind an adapter wraps (attention projections,
    # resnet convolutions, the time embedding), in half the tracing time
    unet = build_one_level_unet()
    unet.requires_grad_(False)
    add_adapter(unet, tiny_config(f"training.adapter={adapter.value}", *METHODS[adapter]),
                denoiser=True)
    unet.train()
    latents = torch.randn(1, unet.config.in_channels, 8, 8)
    context = torch.randn(1, 4, unet.config.cross_attention_dim)
    explained = torch._dynamo.explain(unet)(latents, torch.tensor([10]), context)
    assert explained.graph_break_count == 0, explained.break_reasons
