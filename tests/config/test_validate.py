"""`validate`: inconsistent combinations and missing inputs, each named by its dotted path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.config import Config, Problem, apply_overrides, validate
from modules.train.setup.inputs import check_inputs


def config_with(*assignments: str, cwd: Path | None = None) -> Config:
    return apply_overrides(Config(), list(assignments), cwd=cwd or Path("/nonexistent"))


def problems_of(config: Config, check_files: bool = False) -> dict[str, Problem]:
    inputs = check_inputs(config) if check_files else []
    return {p.path: p for p in validate(config) + inputs}


def test_text_encoder_2_on_sd15():
    problems = problems_of(config_with("components.text_encoder_2.train=true"))
    problem = problems["components.text_encoder_2.train"]
    assert (problem.expected, problem.given) == ("false", "true")
    assert "Stable Diffusion 1.x has no text_encoder_2" in problem.message
    assert list(problems) == ["components.text_encoder_2.train"]


def test_text_encoder_2_on_sdxl_is_fine():
    config = config_with("model.type=SDXL", "model.path=builtin:tiny-sdxl",
                         "components.text_encoder_2.train=true")
    assert validate(config) + check_inputs(config) == []


def test_training_the_vae():
    problems = problems_of(config_with("components.vae.train=true"))
    assert "not the VAE" in problems["components.vae.train"].message
    assert "components" not in problems  # the UNet is still trained


def test_nothing_trained():
    problem = problems_of(config_with("components.denoiser.train=false"))["components"]
    assert problem.expected == "at least one component with train = true"


def test_only_the_vae_trained_also_means_nothing_trained():
    problems = problems_of(config_with("components.denoiser.train=false",
                                       "components.vae.train=true"))
    assert set(problems) == {"components", "components.vae.train"}


def test_only_an_absent_component_trained_means_nothing_trained():
    problems = problems_of(config_with("components.denoiser.train=false",
                                       "components.text_encoder_2.train=true"))
    assert set(problems) == {"components", "components.text_encoder_2.train"}


@pytest.mark.parametrize("resolution, hint", [(500, "try 512"), (100, "try 128"),
                                              (65, "try 64")])
def test_resolution_not_a_multiple_of_64(resolution, hint):
    problem = problems_of(config_with(f"data.resolution={resolution}"))["data.resolution"]
    assert problem.expected == "a multiple of 64"
    assert problem.given == str(resolution)
    assert problem.message == hint


def test_cache_latents_with_random_crop():
    problems = problems_of(config_with("data.cache_latents=true", "data.center_crop=false"))
    assert "cached latents" in problems["data.center_crop"].message


def test_cache_latents_with_center_crop_is_fine():
    assert validate(config_with("data.cache_latents=true")) == []


def test_empty_prompts_with_sampling_on():
    problem = problems_of(config_with("sampling.prompts=", "sampling.every_steps=10"))[
        "sampling.prompts"]
    assert problem.expected == "at least one prompt when sampling is on"


def test_empty_prompts_with_sampling_off_is_fine():
    assert validate(config_with("sampling.prompts=")) == []


def test_blank_prompt_is_named_by_index():
    problems = problems_of(config_with('sampling.prompts=["a cat", "  "]'))
    assert problems["sampling.prompts[1]"].expected == "a non-empty prompt"


@pytest.mark.parametrize("method,wrong,right", [("lora", "single_file", "DIFFUSERS or KOHYA"),
                                                ("fine_tune", "kohya", "DIFFUSERS or SINGLE_FILE")])
def test_save_format_that_does_not_fit_the_method(method, wrong, right):
    problems = problems_of(config_with(f"training.method={method}",
                                       f"output.formats=diffusers,{wrong}"))
    problem = problems["output.formats[1]"]
    assert (problem.expected, problem.given) == (right, wrong.upper())
    assert "output.formats[0]" not in problems


@pytest.mark.parametrize("method,formats", [("lora", "diffusers,kohya"),
                                            ("fine_tune", "diffusers,single_file")])
def test_save_formats_that_fit(method, formats):
    problems = problems_of(config_with(f"training.method={method}", f"output.formats={formats}"))
    assert not [k for k in problems if k.startswith("output.formats")]


def test_no_save_format():
    assert problems_of(config_with("output.formats="))["output.formats"].given == "[]"


def test_lora_without_target_modules():
    problems = problems_of(config_with("training.lora_target_modules="))
    assert "training.lora_target_modules" in problems


def test_fp16_on_the_cpu():
    problems = problems_of(config_with("general.device=cpu", "training.mixed_precision=fp16"))
    assert problems["training.mixed_precision"].given == "FP16"


def test_bad_caption_extension():
    problems = problems_of(config_with("data.caption_extension=txt"))
    assert problems["data.caption_extension"].given == "'txt'"


def test_empty_paths_are_reported_without_checking_files():
    problems = problems_of(config_with('data.datasets=[{"path": ""}]', "output.dir=",
                                       "model.path="))
    assert {"data.datasets[0].path", "output.dir", "model.path"} <= set(problems)


def test_empty_paths_are_reported_once_with_file_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_with('data.datasets=[{"path": ""}]', "output.dir=", "model.path=")
    problems = validate(config) + check_inputs(config)
    assert sorted(p.path for p in problems) == ["data.datasets[0].path", "model.path",
                                                "output.dir"]


def test_all_problems_at_once():
    config = config_with("components.text_encoder_2.train=true", "data.resolution=500",
                         "data.cache_latents=true", "data.center_crop=false",
                         "output.formats=single_file")
    assert set(problems_of(config)) == {"components.text_encoder_2.train", "data.resolution",
                                        "data.center_crop", "output.formats[0]"}


# --- inputs on disk ----------------------------------------------------------------------------

def _model_folder(root: Path, class_name: str | None = "StableDiffusionPipeline") -> Path:
    folder = root / "model"
    folder.mkdir()
    index = {"_class_name": class_name} if class_name else {}
    (folder / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    return folder


def _files_ok(tmp_path: Path, *assignments: str) -> dict[str, Problem]:
    config = config_with(f"output.dir={tmp_path / 'out'}", *assignments, cwd=tmp_path)
    return problems_of(config, check_files=True)


def test_file_checks_are_skipped_without_check_files(tmp_path):
    config = config_with(f"model.path={tmp_path / 'missing'}")
    assert validate(config) == []


def test_a_valid_model_folder(tmp_path, tempera_cache):
    from modules.models.tiny import ensure_builtin_model
    folder = ensure_builtin_model("builtin:tiny-sd15", tempera_cache)
    assert _files_ok(tmp_path, f"model.path={folder}") == {}


def test_missing_model_folder(tmp_path):
    problem = _files_ok(tmp_path, "model.path=missing")["model.path"]
    assert problem.expected == "an existing diffusers model folder or .safetensors checkpoint"
    assert str(tmp_path / "missing") in problem.given
    assert problem.message == "no such file or folder"


@pytest.mark.parametrize("name", ["model.safetensors", "model.ckpt"])
def test_a_missing_checkpoint_file_is_not_called_a_folder(tmp_path, name):
    """Single files are supported: a missing one is a missing file, not a missing folder."""
    problem = _files_ok(tmp_path, f"model.path={name}")["model.path"]
    assert problem.expected == "an existing checkpoint file"
    assert problem.message == "no such file" and "folder" not in str(problem)


def test_damaged_checkpoint_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    problem = _files_ok(tmp_path, "model.path=model.safetensors")["model.path"]
    assert problem.expected == "a Stable Diffusion 1.x checkpoint"
    assert "not a readable .safetensors file" in problem.message


def test_file_of_an_unknown_kind(tmp_path):
    (tmp_path / "model.zip").write_bytes(b"x")
    problem = _files_ok(tmp_path, "model.path=model.zip")["model.path"]
    assert problem.message == "unknown file type"


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_pickle_checkpoint_is_refused_without_opt_in(tmp_path, suffix):
    import torch
    path = tmp_path / f"model{suffix}"
    torch.save({"model.diffusion_model.x": torch.zeros(1)}, path)
    before = path.read_bytes()
    problem = _files_ok(tmp_path, f"model.path={path.name}")["model.path"]
    assert "arbitrary code" in problem.message and "weights_only=True" in problem.message
    assert path.read_bytes() == before


def test_lora_file_given_as_the_base_model(tmp_path):
    from safetensors.torch import save_file
    import torch
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(1, 1)},
              tmp_path / "style.safetensors")
    problem = _files_ok(tmp_path, "model.path=style.safetensors")["model.path"]
    assert "looks like a LoRA" in problem.message


def test_model_folder_without_model_index(tmp_path):
    (tmp_path / "model").mkdir()
    problem = _files_ok(tmp_path, "model.path=model")["model.path"]
    assert problem.expected == "a diffusers model folder (with model_index.json)"


def test_unreadable_model_index(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_bytes(b"\xff\xfe{")
    problem = _files_ok(tmp_path, "model.path=model")["model.path"]
    assert problem.expected == "a readable model_index.json"


def test_model_index_that_is_not_an_object_is_not_a_crash(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model_index.json").write_text("[]", encoding="utf-8")
    # no crash on the index: the folder's real problem (no components) is what is reported
    assert "has no unet/ folder" in _files_ok(tmp_path, "model.path=model")["model.path"].message


def test_model_index_class_that_does_not_match_model_type(tmp_path):
    _model_folder(tmp_path, "StableDiffusionXLPipeline")
    problem = _files_ok(tmp_path, "model.path=model", "model.type=SD15")["model.type"]
    assert (problem.expected, problem.given) == ("SDXL", "SD15")
    assert "holds a StableDiffusionXLPipeline, not a StableDiffusionPipeline" in problem.message


def test_model_index_of_an_unsupported_pipeline(tmp_path):
    _model_folder(tmp_path, "KandinskyPipeline")
    problem = _files_ok(tmp_path, "model.path=model")["model.path"]
    assert "KandinskyPipeline" in problem.message
    assert "StableDiffusionPipeline" in problem.expected


def test_builtin_model_that_does_not_match_model_type(tmp_path):
    problem = _files_ok(tmp_path, "model.path=builtin:tiny-sdxl", "model.type=SD15")[
        "model.type"]
    assert (problem.expected, problem.given) == ("SDXL", "SD15")


def test_unknown_builtin_model(tmp_path):
    problem = _files_ok(tmp_path, "model.path=builtin:huge-sd15")["model.path"]
    assert problem.expected == ("one of builtin:tiny-sd15, builtin:tiny-sd2, builtin:tiny-sdxl, "
                                "builtin:tiny-zimage, builtin:tiny-klein")


def test_missing_dataset_folder(tmp_path):
    (tmp_path / "a").mkdir()
    problems = _files_ok(tmp_path, 'data.datasets=[{"path": "a"}, {"path": "b"}]')
    assert list(problems) == ["data.datasets[1].path"]
    assert problems["data.datasets[1].path"].message == "no such folder"


def test_dataset_path_that_is_a_file(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    problem = _files_ok(tmp_path, "data.datasets[0].path=a.png")["data.datasets[0].path"]
    assert problem.message == "not a folder"


def test_unknown_builtin_dataset(tmp_path):
    problem = _files_ok(tmp_path, "data.datasets[0].path=builtin:faces")[
        "data.datasets[0].path"]
    assert problem.expected == "one of builtin:shapes"


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "out.txt").write_text("x", encoding="utf-8")
    problem = _files_ok(tmp_path, "output.dir=out.txt")["output.dir"]
    assert (problem.expected, problem.message) == ("a folder", "it is a file")


def test_output_dir_holding_an_earlier_run(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text("{}", encoding="utf-8")
    problem = _files_ok(tmp_path)["output.dir"]
    assert "earlier run" in problem.message
    assert _files_ok(tmp_path, "output.overwrite=true") == {}


def test_resuming_with_overwrite_on_is_no_problem(tmp_path):
    """Resume means continue: overwrite is not applied then (the run says so), so a preset
    that ships with overwrite on (the demo) resumes instead of being refused."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.json").write_text("{}", encoding="utf-8")
    assert _files_ok(tmp_path, "output.overwrite=true", "training.resume_from=latest") == {}
    assert _files_ok(tmp_path, "training.resume_from=latest") == {}


def test_existing_output_dir_without_a_run_is_fine(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("x", encoding="utf-8")
    assert _files_ok(tmp_path) == {}


def test_aspect_buckets_are_off_by_default_and_fine_at_a_usual_resolution():
    config = Config()
    assert config.data.aspect_buckets is False and config.data.bucket_max_aspect == 2.0
    assert validate(config_with("data.aspect_buckets=true", "data.resolution=512")) == []


@pytest.mark.parametrize("settings, hint", [
    (["data.resolution=256", "data.bucket_max_aspect=1.5"],
     "least elongated non-square bucket has aspect 1.67; raise data.bucket_max_aspect to 1.67"),
    (["data.resolution=128"], "aspect 4.00; raise data.bucket_max_aspect to 4.0"),
    (["data.resolution=64", "data.bucket_max_aspect=4"], "only the square bucket"),
])
def test_aspect_buckets_that_can_only_make_the_square_are_a_problem(settings, hint):
    problems = problems_of(config_with("data.aspect_buckets=true", *settings))
    problem = problems["data.aspect_buckets"]
    assert problem.given == "true" and "more than the square bucket" in problem.expected
    assert hint in problem.message
    assert list(problems) == ["data.aspect_buckets"]
    assert "data.aspect_buckets" not in problems_of(config_with(*settings))  # off: no problem


def test_bucket_max_aspect_out_of_range_is_a_load_error():
    from modules.config import ConfigError
    with pytest.raises(ConfigError, match="data.bucket_max_aspect"):
        config_with("data.bucket_max_aspect=5")


# --- settings that would do nothing (issue 44): refused before training, with the fix -------
def test_a_learning_rate_of_zero_is_refused_unless_the_optimizer_ignores_it():
    problem = problems_of(config_with("training.learning_rate=0"))["training.learning_rate"]
    assert problem.given == "0" and "changes no weight" in problem.message
    own = problems_of(config_with("training.learning_rate=0", "components.denoiser."
                                  "learning_rate=1e-4"))
    assert "training.learning_rate" not in own  # every trained component has its own rate
    zero = problems_of(config_with("components.denoiser.learning_rate=0"))
    assert "components.denoiser.train = false" in zero["components.denoiser.learning_rate"].message
    assert "training.learning_rate" not in problems_of(
        config_with("training.learning_rate=0", "training.optimizer=ADAFACTOR_RELATIVE"))


def test_a_warmup_longer_than_the_run_is_refused_with_the_rate_it_would_end_at():
    problem = problems_of(config_with("training.max_steps=25", "training.lr_warmup_steps=600")
                          )["training.lr_warmup_steps"]
    assert problem.expected == "at most training.max_steps (25)"
    assert "at 4% of training.learning_rate" in problem.message
    assert "training.lr_warmup_steps" not in problems_of(
        config_with("training.max_steps=25", "training.lr_warmup_steps=25"))
    # a run counted in epochs is warned once its length is known (recipe setup)
    epochs = config_with("training.lr_warmup_steps=600")
    assert "training.lr_warmup_steps" not in problems_of(epochs)


@pytest.mark.parametrize("factor", [0, 1])
def test_a_lokr_factor_without_meaning_is_refused_with_the_range(factor):
    problem = problems_of(config_with("training.adapter=LOKR", f"training.lokr_factor={factor}",
                                      "output.formats=kohya"))["training.lokr_factor"]
    assert problem.expected == "-1 (the balanced split) or 2 to 64"
    assert not problems_of(config_with("training.adapter=LOKR", "training.lokr_factor=64",
                                       "output.formats=kohya"))


def test_a_lokr_factor_above_64_no_longer_means_minus_one_silently():
    from modules.config.problems import ConfigError
    with pytest.raises(ConfigError, match="training.lokr_factor: expected a value between -1 "
                                          "and 64, got 1024"):
        config_with("training.adapter=LOKR", "training.lokr_factor=1024")


@pytest.mark.parametrize("model_type, readers", [("SD15", "ComfyUI, A1111 / Forge and LyCORIS"),
                                                 ("KLEIN", "ComfyUI")])
def test_a_diffusers_file_diffusers_cannot_load_names_the_tools_that_read_kohya(model_type,
                                                                                readers):
    """LoHa with DIFFUSERS output: refused, pointing to KOHYA and to the tools that read the
    family's KOHYA files (A1111 / Forge read no transformer family's)."""
    problems = problems_of(config_with(f"model.type={model_type}", "training.adapter=LOHA",
                                       'output.formats=["DIFFUSERS"]'))
    message = problems["output.formats[0]"].message
    assert message.endswith(f"use KOHYA ({readers} read it)"), message
