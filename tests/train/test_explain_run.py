"""explain_config / scripts/explain_compile.py: per component graphs, breaks and decisions."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from modules.train.setup.explain_run import explain_config, explain_text
from modules.models.families import family_files

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "explain_compile.py"


def test_explains_only_selected_components_and_reports_the_degrade(tiny_config):
    config = tiny_config("compile.backend=TRITON", "compile.denoiser=true",
                         "compile.text_encoder=true", "compile.vae=false",
                         "data.resolutions=64,128")
    result = explain_config(config)
    assert set(result) == {"unet", "text_encoder"}
    unet = result["unet"]
    assert unet["requested"] == "TRITON"
    assert unet["effective"] != "TRITON" and "CUDA" in unet["degraded"]
    assert unet["regions"] and all(r["graphs"] >= 1 for r in unet["regions"])
    text = explain_text(config)
    assert "degraded" in text
    # several resolutions: their shape sets' cost, at most (before a scan); TRITON runs as
    # INDUCTOR here, which keeps a whole UNet's sizes static: a FULL graph per resolution
    assert ("compile: at most 2 shape set(s) (64 px: 1, 128 px: 1): FULL builds at most 2 "
            "denoiser graph(s)") in text


def test_script_exit_codes(tiny_config, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("explain_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bad = tmp_path / "bad.json"
    bad.write_text('{"compile": {"backend": "FAST"}}')
    assert module.main(["--config", str(bad)]) == 2
    assert "compile.backend" in capsys.readouterr().err


def test_check_compilation_loads_a_single_file_model_as_training_does(tiny_config, tempera_cache,
                                                                      tmp_path):
    from diffusers import StableDiffusionPipeline

    from modules.config.schema import ModelType
    from modules.models.single_file import save_single_file
    from modules.models.tiny import ensure_builtin_model
    folder = ensure_builtin_model("builtin:tiny-sd15", tempera_cache)
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None,
                                                   local_files_only=True)
    checkpoint = save_single_file({"unet": pipe.unet, "vae": pipe.vae,
                                   "text_encoder": pipe.text_encoder, "scheduler": pipe.scheduler},
                                  tmp_path / "my-model.safetensors", family_files(ModelType.SD15))
    config = tiny_config(f"model.path={checkpoint}", f"model.config_path={folder}",
                         "compile.backend=AOT_EAGER", "compile.denoiser=true")
    assert set(explain_config(config)) == {"unet"}


def test_a_run_records_its_compile_time_for_the_next_one_with_the_same_settings(tiny_config,
                                                                                 tmp_path):
    from modules.train.state.history import expected_compile_seconds
    from modules.train.trainer import train
    own_cache = f"compile.cache_dir={tmp_path / 'compile-cache'}"  # a history of its own
    config = tiny_config("compile.backend=AOT_EAGER", "training.max_steps=1", own_cache)
    assert expected_compile_seconds(config, "cpu") is None
    train(config)
    seconds = expected_compile_seconds(config, "cpu")
    assert seconds is not None and seconds > 0
    from modules.train.state.history import compile_expectation
    assert compile_expectation(config, "cpu").graphs["unet"] >= 1  # for "graph N of M"
    other = tiny_config("compile.backend=AOT_EAGER", "training.max_steps=1",
                        "data.resolution=128", own_cache)
    assert expected_compile_seconds(other, "cpu") is None  # other shapes: other compile work
