"""Compilation through the real trainer: same losses, same saved keys, honest run record."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from modules.events import RecordingCallbacks
from modules.train.trainer import train


def _record(result) -> dict:
    return json.loads((result.output_dir / "run.json").read_text())


def test_aot_eager_training_matches_eager_and_saves_the_same_keys(tiny_config, tmp_path):
    eager = train(tiny_config(f"output.dir={tmp_path / 'eager'}", "training.max_steps=2"))
    callbacks = RecordingCallbacks()
    compiled = train(tiny_config(f"output.dir={tmp_path / 'compiled'}", "training.max_steps=2",
                                 "compile.backend=AOT_EAGER", "compile.denoiser=true",
                                 "compile.text_encoder=true"), callbacks)
    assert _record(compiled)["losses"] == pytest.approx(_record(eager)["losses"], rel=1e-4)

    report = _record(compiled)["compile"]
    assert report["unet"]["effective"] == "AOT_EAGER" and report["unet"]["compiled_code_ran"]
    assert report["text_encoder"]["effective"] == "AOT_EAGER"
    assert report["vae"]["effective"] == "NONE"
    assert report["unet"]["torch_compile_kwargs"]["backend"] == "aot_eager"
    assert any(e.component == "unet" and e.kind == "done" for e in callbacks.compile_events)

    def keys(result):
        return set(load_file(result.output_dir / "final" / "pytorch_lora_weights.safetensors"))
    assert keys(compiled) == keys(eager)
    assert not any("_orig_mod" in k for k in keys(compiled))


@pytest.mark.inductor
def test_triton_on_a_cpu_degrades_with_a_reason_and_the_run_finishes(tiny_config):
    """TRITON requested on a CPU runs as inductor without CUDA graphs, says why, and trains.
    The frozen text encoder is the compiled component: its forward-only graph is the cheapest
    real inductor compile a run makes (the UNet's forward and backward would take several
    minutes of CI; inductor training of the UNet is tests/compile/test_inductor.py's)."""
    callbacks = RecordingCallbacks()
    result = train(tiny_config("training.max_steps=2", "compile.backend=TRITON",
                               "compile.scope=FULL", "compile.unet=false",
                               "compile.text_encoder=true"), callbacks)
    record = _record(result)["compile"]
    encoder = record["text_encoder"]
    assert result.status == "finished" and record["unet"]["effective"] == "NONE"
    assert encoder["requested"] == "TRITON" and encoder["effective"] == "INDUCTOR"
    assert "CUDA" in encoder["degraded"] and encoder["compiled_code_ran"] is True
    assert not encoder["inductor_options"].get("triton.cudagraphs")
    assert any(e.kind == "degraded" for e in callbacks.compile_events)
