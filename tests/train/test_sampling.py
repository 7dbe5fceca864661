"""Sampling while training: kohya's per-prompt flags, a prompts file, the samplers, and no
recompile of the training graphs when samples are drawn at another size."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from modules.config import Config, apply_overrides
from modules.config.prompts import parse_prompt, prompt_defaults, sample_prompts
from modules.config.schema import Sampler
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.models.tiny import ensure_builtin_model
from modules.train.setup.inputs import check_inputs
from modules.train.outputs.sampling import SAMPLERS, sampling_scheduler
from modules.train.trainer import train


def _prompt(line: str, **settings):
    config = apply_overrides(Config(), [f"sampling.{k}={v}" for k, v in settings.items()])
    return parse_prompt(line, prompt_defaults(config, 0), "sampling.prompts[0]")


def test_kohya_flags_set_each_prompts_own_settings():
    prompt, problems = _prompt("a cat, sitting --n blurry, text --w 768 --h 512 --d 7 --s 30 "
                               "--l 6.5")
    assert problems == []
    assert (prompt.text, prompt.negative, prompt.width, prompt.height, prompt.seed,
            prompt.steps, prompt.guidance_scale) == ("a cat, sitting", "blurry, text", 768, 512,
                                                     7, 30, 6.5)
    plain, _ = _prompt("a dog", negative_prompt="ugly", seed=10, steps=5)
    assert (plain.text, plain.negative, plain.seed, plain.steps, plain.width) == (
        "a dog", "ugly", 10, 5, 512)
    # a double dash inside a word is part of the prompt
    assert _prompt("well--made chair")[0].text == "well--made chair"


@pytest.mark.parametrize("line, expected", [
    ("a cat --w 100", "--w: a width in pixels, a multiple of 8"),
    ("a cat --h 8192", "--h: a height in pixels"),
    ("a cat --s many", "--s: denoising steps"),
    ("a cat --x 3", "flags among --n, --w, --h, --d, --s, --l"),
    ("--w 512", "a prompt before its --flags"),
])
def test_a_bad_flag_is_named_with_its_prompt(line, expected):
    config = apply_overrides(Config(), [f"sampling.prompts={json.dumps([line])}"])
    problems = [p for p in validate(config) if p.path == "sampling.prompts[0]"]
    assert len(problems) == 1 and str(problems[0]).startswith(f"sampling.prompts[0]: expected "
                                                              f"{expected}")


def test_a_prompts_file_adds_prompts_and_its_errors_name_the_line(tmp_path):
    good = tmp_path / "prompts.txt"
    good.write_text("# style checks\n\na red circle --d 3\na blue square --s 4\n",
                    encoding="utf-8")
    config = apply_overrides(Config(), ['sampling.prompts=["first"]',
                                        f"sampling.prompts_file={good}"])
    prompts, problems = sample_prompts(config)
    assert problems == [] and [p.text for p in prompts] == ["first", "a red circle",
                                                            "a blue square"]
    assert [p.seed for p in prompts] == [42, 3, 44]  # sampling.seed + index unless --d
    bad = tmp_path / "bad.txt"
    bad.write_text("a cat\n# fine\na dog --w 65\n", encoding="utf-8")
    config.sampling.prompts_file = str(bad)
    assert validate(config) == []  # validation opens no file
    (problem,) = check_inputs(config)
    assert problem.path == "sampling.prompts_file" and "line 3" in str(problem)
    config.sampling.prompts_file = str(tmp_path / "missing.txt")
    (problem,) = check_inputs(config)
    assert problem.path == "sampling.prompts_file" and "missing.txt" in str(problem)
    assert bad.read_text(encoding="utf-8") == "a cat\n# fine\na dog --w 65\n"  # left alone


def test_a_prompts_file_gone_after_the_checks_stops_the_start_naming_it(tiny_config, tmp_path,
                                                                       monkeypatch):
    """The prompts file is read for the run once, right after the checks read it
    (`check_run`; setup samples what was read then): a file gone in between stops the start
    with the file named, never a run that samples nothing."""
    from modules.config.problems import ConfigError
    from modules.train.setup import prepare
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("a red circle\n", encoding="utf-8")

    def checked_then_gone(config):
        problems = check_inputs(config)
        prompts_file.unlink()
        return problems
    monkeypatch.setattr(prepare, "check_inputs", checked_then_gone)
    with pytest.raises(ConfigError) as caught:
        prepare.check_run(tiny_config(f"sampling.prompts_file={prompts_file}"),
                          RecordingCallbacks())
    [problem] = caught.value.problems
    assert problem.path == "sampling.prompts_file" and str(prompts_file) in str(problem)
    assert "No such file" in str(problem)


def test_each_sampler_runs_on_the_models_own_noise_schedule(tempera_cache):
    from diffusers import StableDiffusionPipeline
    folder = ensure_builtin_model("builtin:tiny-sd15", tempera_cache)
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    model = pipe.scheduler.config
    images = {}
    for sampler in Sampler:
        scheduler = sampling_scheduler(sampler, model)
        assert type(scheduler).__name__ == SAMPLERS[sampler][0]
        for key in ("num_train_timesteps", "beta_schedule", "beta_start", "beta_end",
                    "prediction_type"):
            assert scheduler.config[key] == model[key], (sampler, key)
        pipe.scheduler = scheduler
        run = [pipe("a red circle", height=64, width=64, num_inference_steps=3,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images
               for _ in range(2)]
        assert torch.equal(run[0], run[1])  # a sampler with a seed repeats itself
        images[sampler] = run[0]
    assert sampling_scheduler(Sampler.DPMPP_2M_KARRAS, model).config.use_karras_sigmas
    others = [s for s in Sampler if s != Sampler.DDIM]
    assert all(not torch.equal(images[Sampler.DDIM], images[s]) for s in others)


def test_samples_follow_their_flags_without_recompiling_the_training_graphs(tiny_config,
                                                                            tmp_path):
    prompts = ["a red circle --w 128 --h 64 --s 2 --d 5",
               "a red circle --w 128 --h 64 --s 2 --d 5 --n circle",
               "a red circle --s 2 --d 5"]
    config = tiny_config("training.max_steps=2", "sampling.every_steps=1",
                         f"sampling.prompts={json.dumps(prompts)}", "sampling.sampler=EULER_A",
                         "compile.backend=AOT_EAGER", "compile.scope=REGIONAL")
    callbacks = RecordingCallbacks()
    result = train(config, callbacks)
    files = sorted((result.output_dir / "samples").glob("step-000002-*.png"))
    sizes = [Image.open(f).size for f in files]
    assert sizes == [(128, 64), (128, 64), (64, 64)]  # (width, height)
    pixels = [torch.from_numpy(np.asarray(Image.open(f))) for f in files[:2]]
    assert not torch.equal(*pixels)  # the negative prompt changed the image
    record = json.loads((result.output_dir / "run.json").read_text())
    unet = record["compile"]["unet"]
    assert unet["compiled_code_ran"]
    # sampling at 128x64 after step 1 compiled nothing: step 2 ran the step-1 graphs
    assert record["batch_shapes"]["recompiles_after_first_pass"] == 0
    assert unet["late_recompiles"] == 0
    assert not any(e.kind == "recompile" for e in callbacks.compile_events)
