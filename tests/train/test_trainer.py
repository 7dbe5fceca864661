"""The trainer on the tiny model: real runs, real files, real loss."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modules.config import ConfigError
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.trainer import TrainingError, train


def test_lora_run_saves_a_file_diffusers_loads_and_that_changes_the_output(tiny_config, pipelines):
    """With the text encoder trained too (one run for both): the file holds both parts."""
    from safetensors.torch import load_file
    config = tiny_config("training.max_steps=4", "components.text_encoder.train=true")
    result = train(config)
    lora = result.output_dir / "final" / "pytorch_lora_weights.safetensors"
    assert result.status == "finished" and result.steps == 4
    assert lora.is_file()
    keys = load_file(lora).keys()
    assert any(k.startswith("unet.") for k in keys)
    assert any(k.startswith("text_encoder.") for k in keys)

    base_folder = Path(json.loads((result.output_dir / "config.json").read_text())["model"]["path"])
    pipe = pipelines.load(base_folder)
    before = pipelines.image(pipe)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    after = pipelines.image(pipe)
    assert not torch.allclose(before, after), "the LoRA did not change the model's output"


def test_fine_tune_saves_a_diffusers_folder_with_changed_weights(tiny_config, pipelines):
    result = train(tiny_config("training.method=FINE_TUNE", "training.max_steps=3"))
    final = result.output_dir / "final"
    base_folder = Path(json.loads((result.output_dir / "config.json").read_text())["model"]["path"])
    tuned, base = pipelines.load(final), pipelines.load(base_folder)
    assert not torch.allclose(tuned.unet.conv_in.weight, base.unet.conv_in.weight)
    assert torch.equal(tuned.vae.decoder.conv_in.weight, base.vae.decoder.conv_in.weight)
    assert not torch.allclose(pipelines.image(tuned), pipelines.image(base))


def test_loss_goes_down_on_the_shapes_dataset(tiny_config):
    # 30 steps: the last ten's mean loss is about a third of the first ten's (0.7 is asked)
    result = train(tiny_config("training.method=FINE_TUNE", "training.max_steps=30",
                               "training.batch_size=4", "training.learning_rate=2e-3"))
    losses = result.record["losses"] if "losses" in result.record else \
        json.loads((result.output_dir / "run.json").read_text())["losses"]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.7 * first, f"loss did not go down enough: {first:.3f} -> {last:.3f}"


def test_same_seed_gives_the_same_losses_and_the_resolved_config_alone_reproduces_the_run(
        tiny_config, tmp_path):
    """The second run of the same settings is the first's resolved config.json, loaded alone:
    it has the same seed, so one run shows both properties."""
    from modules.config import apply_overrides, load_config
    a = train(tiny_config(f"output.dir={tmp_path / 'a'}"))
    again = apply_overrides(load_config(a.output_dir / "config.json"),
                            [f"output.dir={tmp_path / 'b'}"])
    assert again.training.seed == tiny_config().training.seed
    b = train(again)
    c = train(tiny_config(f"output.dir={tmp_path / 'c'}", "training.seed=7"))
    losses = [json.loads((r.output_dir / "run.json").read_text())["losses"] for r in (a, b, c)]
    assert losses[0] == losses[1]
    assert losses[0] != losses[2]


def test_run_record_and_resolved_config_and_progress_events_with_accumulation(tiny_config):
    callbacks = RecordingCallbacks()
    result = train(tiny_config("training.max_steps=3", "output.save_every_steps=2",
                               "training.gradient_accumulation=2"), callbacks)
    # one progress event per optimizer step, not per accumulated micro-batch
    assert [p.step for p in callbacks.progress] == [1, 2, 3]
    assert all(p.max_steps == 3 and p.lr > 0 for p in callbacks.progress)
    record = json.loads((result.output_dir / "run.json").read_text())
    assert record["status"] == "finished"
    assert record["steps_done"] == 3 and len(record["losses"]) == 3
    assert record["final_loss"] == record["losses"][-1]
    assert record["mean_loss"] == pytest.approx(sum(record["losses"]) / 3)
    assert record["median_step_seconds"] > 0 and record["wall_seconds"] > 0
    assert record["versions"]["torch"] == torch.__version__
    assert record["device"].startswith("cpu")
    assert record["dataset"]["images"] == 48
    assert set(record["compile"]) == {"unet", "text_encoder", "vae"}
    # The CPU has no allocator counters: the process's peak RSS stands in, and says so.
    memory = record["memory"]
    assert memory["peak_rss_bytes"] > 50 * 2**20 and memory["peak_reserved_bytes"] is None
    assert "RSS" in memory["memory_measured"]
    for path in record["output_files"]:
        assert Path(path).exists(), path
    assert (result.output_dir / "checkpoints" / "step-000002" /
            "pytorch_lora_weights.safetensors").is_file()

    resolved = json.loads((result.output_dir / "config.json").read_text())
    model_folder = Path(resolved["model"]["path"])
    assert (model_folder / "model_index.json").is_file(), "builtin model not resolved to a folder"
    assert Path(resolved["data"]["datasets"][0]["path"]).is_dir()
    assert Path(resolved["output"]["dir"]).is_absolute()


def test_stop_command_ends_the_run_with_a_save(tiny_config):
    commands = TrainerCommands()

    class StopAtTwo(RecordingCallbacks):
        def on_progress(self, progress):
            super().on_progress(progress)
            if progress.step == 2:
                commands.request_stop()

    callbacks = StopAtTwo()
    result = train(tiny_config("training.max_steps=50"), callbacks, commands)
    record = json.loads((result.output_dir / "run.json").read_text())
    assert result.status == "stopped" and record["status"] == "stopped"
    assert record["steps_done"] == 2
    assert (result.output_dir / "final" / "pytorch_lora_weights.safetensors").is_file()
    assert callbacks.saves[-1][1] == 2


def test_save_now_and_sample_now_commands(tiny_config):
    commands = TrainerCommands()

    class AskAtOne(RecordingCallbacks):
        def on_progress(self, progress):
            super().on_progress(progress)
            if progress.step == 1:
                commands.request_save()
                commands.request_sample()

    callbacks = AskAtOne()
    result = train(tiny_config("training.max_steps=2", "sampling.prompts=[\"a red circle\"]",
                               "sampling.steps=2"), callbacks, commands)
    assert (result.output_dir / "checkpoints" / "step-000001").is_dir()
    assert (result.output_dir / "samples" / "step-000001-0.png").is_file()
    assert [s for _, _, s in callbacks.samples] == [1, 2]


def test_sampling_every_n_steps_writes_pngs_and_tensorboard(tiny_config, tmp_path,
                                                          monkeypatch):
    """Also, on the same run (one run fewer for CI): the second prompt comes from a prompts
    file that is gone once the run is prepared (checked and read by then: setup never reads
    it again, so it cannot sample nothing in silence), and the run leaves torch's global
    generator as it found it (setup seeds it; docs/resume.md, "Random states")."""
    from PIL import Image
    from modules.train import trainer
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("a blue square\n", encoding="utf-8")

    def prepared_then_file_gone(*args):
        prepared = prepare_run(*args)
        prompts_file.unlink()
        return prepared
    prepare_run = trainer.prepare_run
    monkeypatch.setattr(trainer, "prepare_run", prepared_then_file_gone)
    torch.manual_seed(20261127)
    torch.rand(3)  # a state no seed call gives
    before = torch.get_rng_state()
    callbacks = RecordingCallbacks()
    result = train(tiny_config("training.max_steps=4", "sampling.every_steps=2",
                               "sampling.prompts=[\"a red circle\"]",
                               f"sampling.prompts_file={prompts_file}",
                               "sampling.steps=2", "logging.tensorboard=true"), callbacks)
    assert torch.equal(torch.get_rng_state(), before)
    assert not prompts_file.exists()
    samples = sorted(p.name for p in (result.output_dir / "samples").glob("*.png"))
    assert samples == ["step-000002-0.png", "step-000002-1.png",
                       "step-000004-0.png", "step-000004-1.png"]
    assert Image.open(result.output_dir / "samples" / samples[0]).size == (64, 64)
    assert [step for _, _, step in callbacks.samples] == [2, 2, 4, 4]
    assert [prompt for _, prompt, _ in callbacks.samples] == ["a red circle",
                                                              "a blue square"] * 2
    assert list((result.output_dir / "tensorboard").glob("events.out.tfevents.*"))
    for p in callbacks.progress:  # the ETA counts the passes at steps 2 and 4 still to come
        assert p.sampling_eta_seconds > 0
        steps_part = (p.max_steps - p.step) * p.seconds_per_step
        assert abs(p.eta_seconds - steps_part - p.sampling_eta_seconds) < 1e-6


def test_epochs_mode_runs_whole_epochs(tiny_config):
    callbacks = RecordingCallbacks()
    # 48 images / batch 16 = 3 steps per epoch, 2 epochs.
    result = train(tiny_config("training.max_steps=0", "training.epochs=2",
                               "training.batch_size=16"), callbacks)
    assert result.steps == 6
    assert [p.epoch for p in callbacks.progress] == [1, 1, 1, 2, 2, 2]


def test_cached_latents_train_and_the_second_run_reuses_them(tiny_config, tmp_path):
    first_cb, second_cb = RecordingCallbacks(), RecordingCallbacks()
    train(tiny_config("data.cache_latents=true", f"output.dir={tmp_path / 'a'}"), first_cb)
    train(tiny_config("data.cache_latents=true", f"output.dir={tmp_path / 'b'}"), second_cb)
    assert any("0 reused, 48 encoded" in s for s in first_cb.statuses) or \
        any("48 reused" in s for s in first_cb.statuses)
    assert any("48 reused, 0 encoded" in s for s in second_cb.statuses)


def test_v_prediction_model_trains(tiny_config):
    result = train(tiny_config("model.path=builtin:tiny-sd2", "model.type=SD2"))
    assert result.status == "finished"


def test_sdxl_model_trains_lora_on_both_text_encoders(tiny_config):
    from safetensors.torch import load_file
    result = train(tiny_config("model.path=builtin:tiny-sdxl", "model.type=SDXL",
                               "components.text_encoder.train=true",
                               "components.text_encoder_2.train=true"))
    keys = load_file(result.output_dir / "final" / "pytorch_lora_weights.safetensors").keys()
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}


def test_invalid_config_raises_before_anything_is_written(tiny_config, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ConfigError) as info:
        train(tiny_config(f"output.dir={out}", "data.resolution=100",
                          "components.text_encoder_2.train=true"))
    paths = {p.path for p in info.value.problems}
    assert paths == {"data.resolution", "components.text_encoder_2.train"}
    assert not out.exists()


def test_failure_mid_run_keeps_earlier_checkpoints(tiny_config, monkeypatch):
    import modules.train.recipe.recipe as recipe_module
    config = tiny_config("training.max_steps=6", "output.save_every_steps=2")
    real_step = recipe_module.micro_step
    calls = {"n": 0}

    def failing_step(run, batch, draws):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("simulated out of memory\nsecond line")
        return real_step(run, batch, draws)

    monkeypatch.setattr(recipe_module, "micro_step", failing_step)
    callbacks = RecordingCallbacks()
    with pytest.raises(TrainingError, match="simulated out of memory"):
        train(config, callbacks)
    out = Path(config.output.dir)
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "failed" and "step 3" in record["error"]
    assert record["memory"]["peak_rss_bytes"] > 0  # what the failed run had reached
    assert (out / "checkpoints" / "step-000002" / "pytorch_lora_weights.safetensors").is_file()
    assert callbacks.errors and "simulated out of memory" in callbacks.errors[0]


def test_interrupted_save_leaves_the_previous_checkpoint_intact(tiny_config, monkeypatch):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file
    config = tiny_config("training.max_steps=2", "output.save_every_steps=1")
    result = train(config)
    final = result.output_dir / "final" / "pytorch_lora_weights.safetensors"
    good = load_file(final)

    def broken_save(*args, save_directory, weight_name, **kwargs):
        (Path(save_directory) / weight_name).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(StableDiffusionPipeline, "save_lora_weights", broken_save)
    config.output.overwrite = True
    with pytest.raises(TrainingError, match="disk full"):
        train(config)
    after = load_file(final)
    assert after.keys() == good.keys()
    assert all(torch.equal(after[k], good[k]) for k in good)
    assert not list(final.parent.parent.glob(".final.*"))
