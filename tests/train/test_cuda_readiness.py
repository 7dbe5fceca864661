"""What a CUDA run needs from the trainer, checked on the CPU: no recompiles from sampling, one
host sync per optimizer step, persistent gradients, copied text-encoder outputs, TF32, OOM
reported as OOM, stop checks across processes, pinned memory, the torch floor."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from modules.compile.guarded import FallbackGuard
from modules.config.problems import ConfigError
from modules.events import RecordingCallbacks, TrainerCommands
from modules.runtime import runtime_problems, version_tuple
from modules.train.recipe import recipe as recipe_module
from modules.train import trainer as trainer_module
from modules.train.state.run import Run
from modules.train.recipe.builders import float32_precision
from modules.train.trainer import TrainingError, failure_message, train


def _record(result) -> dict:
    return json.loads((result.output_dir / "run.json").read_text())


def test_sampling_every_few_steps_does_not_recompile_the_compiled_unet(tiny_config):
    callbacks = RecordingCallbacks()
    result = train(tiny_config("training.max_steps=6", "compile.backend=AOT_EAGER",
                               "compile.denoiser=true", "sampling.every_steps=2",
                               "sampling.steps=2", 'sampling.prompts=["a red circle"]'),
                   callbacks)
    record = _record(result)
    unet = record["compile"]["unet"]
    assert len(callbacks.samples) == 3 and unet["compiled_code_ran"]
    assert unet["late_recompiles"] == 0
    assert record["batch_shapes"]["recompiles_after_first_pass"] == 0
    assert not [e for e in callbacks.compile_events if e.kind in ("recompile", "warning")]
    assert record["sampling"].startswith("eager")


def test_the_loss_is_read_once_per_optimizer_step_and_tf32_is_not_touched_on_the_cpu(
        tiny_config, monkeypatch):
    reads = {"count": 0}
    train_code = str(Path(trainer_module.__file__).parent)

    def counting(real):
        def read(self):
            if sys._getframe(1).f_code.co_filename.startswith(train_code):  # the trainer's own
                reads["count"] += 1
            return real(self)
        return read

    config = tiny_config("training.max_steps=3", "training.gradient_accumulation=2")
    precision_before = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.Tensor, "item", counting(torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting(torch.Tensor.tolist))
    result = train(config)
    monkeypatch.undo()
    # once per optimizer step (loss and gradient norm together, not per micro-step: 6), plus
    # the end-of-run weight checksum
    assert result.steps == 3 and reads["count"] == 3 + 1
    # and TF32 is not touched on the CPU, which the run records (the same run: one run less)
    assert torch.get_float32_matmul_precision() == precision_before
    assert _record(result)["precision"]["applied"] is False


def test_persistent_gradients_train_exactly_like_freed_ones(tiny_config, tmp_path, monkeypatch):
    freed = train(tiny_config(f"output.dir={tmp_path / 'a'}", "training.max_steps=3",
                              "training.gradient_accumulation=2", "compile.backend=AOT_EAGER"))
    # the guard decides for the engine and the window alike (engine.persistent_grads asks it)
    monkeypatch.setattr(FallbackGuard, "persistent_grads", property(lambda self: True))
    zero_grad_calls = []
    real_zero_grad = torch.optim.AdamW.zero_grad

    def spy(self, set_to_none=True):
        zero_grad_calls.append(set_to_none)
        return real_zero_grad(self, set_to_none=set_to_none)

    monkeypatch.setattr(torch.optim.AdamW, "zero_grad", spy)
    kept = train(tiny_config(f"output.dir={tmp_path / 'b'}", "training.max_steps=3",
                             "training.gradient_accumulation=2", "compile.backend=AOT_EAGER"))
    assert zero_grad_calls and not any(zero_grad_calls)  # zeroed in place, never freed
    assert _record(kept)["losses"] == pytest.approx(_record(freed)["losses"], rel=1e-6)


def test_cached_text_encoder_outputs_are_copies_not_views(tiny_config):
    from modules.events import NullCallbacks
    from modules.train.setup.prepare import prepare_run
    from modules.train.recipe.text_cache import TextEncoderCache

    bundle = prepare_run(tiny_config(), NullCallbacks()).bundle
    cache = TextEncoderCache(bundle, torch.device("cpu"))
    cache.encode(["a red circle", "a blue square"])
    storages = set()
    for hidden, pooled, _length in cache.entries.values():  # (hidden, pooled, token length)
        assert not hidden._is_view() and pooled is None
        storages.add(hidden.untyped_storage().data_ptr())
    assert len(storages) == 2  # one storage per caption, not one batch shared by both


@pytest.mark.parametrize("allow, precision", [(True, "high"), (False, "highest")])
def test_tf32_is_set_on_cuda_and_put_back(tiny_config, allow, precision):
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    restore, record = float32_precision(tiny_config(f"training.allow_tf32={allow}"),
                                        torch.device("cuda"))
    assert torch.get_float32_matmul_precision() == precision
    assert torch.backends.cudnn.allow_tf32 is allow
    assert record == {"allow_tf32": allow, "applied": True,
                      "float32_matmul_precision": precision, "cudnn_allow_tf32": allow}
    restore()
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == before


def test_out_of_memory_stops_the_run_with_advice_and_no_fallback(tiny_config, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    monkeypatch.setattr(recipe_module, "diffusion_loss", out_of_memory)
    config = tiny_config("compile.backend=AOT_EAGER")
    with pytest.raises(TrainingError, match="out of memory at step 0.*batch_size"):
        train(config)
    record = json.loads((Path(config.output.dir) / "run.json").read_text())
    assert record["status"] == "failed" and "gradient_checkpointing" in record["error"]


def test_failure_messages():
    oom = failure_message(torch.OutOfMemoryError("CUDA out of memory"), 12)
    assert oom.startswith("out of memory at step 12") and "training.batch_size" in oom
    other = failure_message(ValueError("bad shape\nmore"), 3)
    assert other == "training failed at step 3: ValueError: bad shape"


class CountingDist:
    enabled = True

    def __init__(self):
        self.collectives = 0

    def any(self, flag: bool) -> bool:
        self.collectives += 1
        return flag


def test_several_processes_agree_on_stop_only_every_few_steps():
    dist = CountingDist()
    commands = TrainerCommands()
    fake = SimpleNamespace(dist=dist, step=0, STOP_CHECK_EVERY_STEPS=10)
    seen = []
    for step in range(25):
        fake.step = step
        seen.append(Run.stop_requested(fake, commands))
    assert dist.collectives == 3 and not any(seen)  # steps 0, 10, 20
    commands.request_stop()
    fake.step = 30
    assert Run.stop_requested(fake, commands) is True


def test_pinned_memory_on_cuda_only(monkeypatch, tiny_config):
    import modules.train.state.run as run_module

    seen = {}
    monkeypatch.setattr(run_module, "epoch_dataloader", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(run_module, "set_sampler_epoch", lambda batches, epoch: None)
    fake = SimpleNamespace(config=tiny_config(), dataset=[], batches=None,
                           dist=SimpleNamespace(rank=0, world_size=1))
    for device, pinned in (("cuda", True), ("cpu", False)):
        fake.device = torch.device(device)
        Run.loader_for_epoch(fake, 0)
        assert seen["pin_memory"] is pinned


def test_a_torch_older_than_the_tested_floor_is_refused(tiny_config, monkeypatch):
    assert version_tuple("2.11.0+cu130") == (2, 11, 0)
    assert runtime_problems("2.11.0+cu130") == [] and runtime_problems("2.13.0") == []
    [problem] = runtime_problems("2.10.1")
    assert problem.path == "torch" and "2.11" in problem.expected
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    config = tiny_config()
    with pytest.raises(ConfigError, match=r"torch: expected torch >= 2\.11"):
        train(config)
    assert not Path(config.output.dir).exists()  # nothing written


def test_component_dtypes(tiny_config):
    from modules.train.recipe.trainable import component_dtypes

    lora = component_dtypes(tiny_config("model.weight_dtype=BFLOAT16"))
    assert set(lora.values()) == {torch.bfloat16}
    fine = component_dtypes(tiny_config("model.weight_dtype=BFLOAT16", "training.method=FINE_TUNE",
                                        "model.train_dtype=FLOAT32"))
    assert fine == {"unet": torch.float32, "text_encoder": torch.bfloat16, "vae": torch.bfloat16}
    sdxl = component_dtypes(tiny_config("model.type=SDXL", "model.weight_dtype=FLOAT16"))
    assert sdxl["vae"] == torch.float32 and sdxl["unet"] == torch.float16


def test_a_fine_tuned_unet_is_loaded_at_its_training_dtype_not_rounded(tiny_config):
    from modules.events import NullCallbacks
    from modules.models.sd_folder import load_model
    from modules.train.setup.prepare import prepare_run

    config = tiny_config("model.weight_dtype=BFLOAT16", "training.method=FINE_TUNE",
                         "model.train_dtype=FLOAT32")
    prepared = prepare_run(config, NullCallbacks())
    exact = load_model(prepared.bundle.path, config.model.type, config.model.prediction_type)
    got, want = prepared.bundle.denoiser.state_dict(), exact.denoiser.state_dict()
    assert prepared.bundle.denoiser.dtype == torch.float32
    assert all(torch.equal(got[k], want[k]) for k in want)  # not rounded through bfloat16
    assert prepared.bundle.vae.dtype == torch.bfloat16


def test_sdxl_keeps_its_vae_in_float32_under_float16(tiny_config):
    from modules.events import NullCallbacks
    from modules.train.setup.prepare import prepare_run

    config = tiny_config("model.path=builtin:tiny-sdxl", "model.type=SDXL",
                         "model.weight_dtype=FLOAT16")
    bundle = prepare_run(config, NullCallbacks()).bundle
    assert bundle.vae.dtype == torch.float32 and bundle.denoiser.dtype == torch.float16
