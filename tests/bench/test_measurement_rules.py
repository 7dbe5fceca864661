"""What a benchmark number means, without training: which steps are timed, memory columns,
default precision, timeouts, and when --apply refuses. (Issue 16 item 8.)"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from modules.bench import BenchmarkResult, apply_fastest
from modules.bench.apply import ApplyError, recommended_settings
from modules.bench.buckets import bucket_config
from modules.bench.cell import StepTimer, excluded_steps, step_cap
from modules.train.outputs.record import peak_memory
from modules.bench.cli import benchmark_config, build_parser
from modules.bench.models import unet_parameter_count
from modules.bench.report import markdown_report, plain_table
from modules.bench.timeouts import autotunes, cell_timeout_seconds, denoiser_parameters
from modules.config import Config, apply_overrides
from modules.config.schema import DType, MixedPrecision, ModelType, TrainingMethod
from modules.config.validate import validate
from modules.bench.matrix import model_config
from modules.events import CompileEvent, Progress, TrainerCommands
from modules.model_types import MODEL_TYPES
from modules.models.families import FAMILIES, family_files, family_of


@pytest.mark.parametrize("warmup,compiles,settle,expected", [
    (1, {0}, 0, {0}),
    (3, {0}, 0, {0, 1, 2}),
    (1, {0, 4}, 0, {0, 4}),                  # a later compile (new bucket, fallback) is out
    (1, {0, 4}, 2, {0, 1, 2, 4, 5, 6}),      # with CUDA graphs: warm-up and recording too
    (1, {6}, 2, {0, 6}),                     # the run ends before the recording steps
])
def test_excluded_steps_follow_the_compiles_not_a_count(warmup, compiles, settle, expected):
    assert excluded_steps(7, warmup, compiles, settle) == expected


def _progress(step: int) -> Progress:
    return Progress(step, 99, 1, 1, 0.1, 0.1, 1e-3, 0.1, 1.0)


def test_step_timer_marks_compile_steps_and_stops_after_enough_clean_ones():
    commands = TrainerCommands()
    timer = StepTimer(False, steps=2, warmup=1, commands=commands)
    timer.on_compile(CompileEvent("unet", "compiling UNet (AOT_EAGER, full)…"))  # apply()
    timer.on_progress(_progress(1))
    timer.on_progress(_progress(2))
    timer.on_compile(CompileEvent("unet", "UNet: compiled 2 graphs so far"))  # new bucket
    timer.on_compile(CompileEvent("unet", "UNet recompiled", kind="recompile"))
    timer.on_progress(_progress(3))
    assert timer.compile_steps == {0, 2} and timer.timed_steps(0) == [1]
    assert not commands.stop_requested
    timer.on_progress(_progress(4))
    assert timer.timed_steps(0) == [1, 3] and commands.stop_requested
    assert [e["step"] for e in timer.compile_events] == [3]  # kept kinds, 1-based step
    seconds = timer.step_seconds(first_step=5.0)
    assert len(seconds) == 4 and seconds[0] == 5.0 and all(s >= 0 for s in seconds[1:])
    assert step_cap(1, 2) > 1 + 2  # room for a later compile


def test_cpu_memory_is_rss_and_says_so():
    memory = peak_memory(cuda=False)
    assert memory["peak_rss_bytes"] > 10 * 2**20
    assert memory["peak_allocated_bytes"] is None and memory["peak_reserved_bytes"] is None
    assert "RSS" in memory["memory_measured"]


def _cells(cuda: bool) -> list[dict]:
    memory = ({"peak_allocated_bytes": 300 * 2**20, "peak_reserved_bytes": 900 * 2**20,
               "peak_rss_bytes": 2**30} if cuda else
              {"peak_allocated_bytes": None, "peak_reserved_bytes": None,
               "peak_rss_bytes": 500 * 2**20})
    base = {"backend": "NONE", "label": "NONE (eager)", "status": "ok", "components": "-",
            "scope": "-", "dynamic": "-", "median_step_seconds": 0.2, "speedup": 1.0,
            "timed_steps": [2, 3, 4], **memory}
    timed_out = {"backend": "TRITON", "label": "TRITON unet FULL AUTO", "status": "timeout",
                 "components": "unet", "scope": "FULL", "dynamic": "AUTO",
                 "error": "timed out after 4379 s (scaled ...)"}
    return [base, timed_out]


def _settings() -> dict:
    return {"model": "sd15", "model_path": "x", "model_type": "SD15", "resolution": 512,
            "batch_size": 1, "method": "LORA", "mixed_precision": "BF16",
            "weight_dtype": "BFLOAT16", "warmup": 1, "steps": 10}


def test_cuda_report_shows_allocated_and_reserved():
    machine = {"cpu": "x", "cpu_cores": 16, "torch": "2.11", "date": "d",
               "cuda_device": "NVIDIA H100"}
    text = markdown_report(BenchmarkResult(machine, _settings(), _cells(cuda=True)))
    assert "| peak allocated MiB | peak reserved MiB |" in text and "RSS MiB" not in text
    assert "| 300 | 900 |" in text
    assert "CUDA events" in text and "Device: NVIDIA H100" in text
    assert "**timeout**: timed out after 4379 s" in text
    assert "Not finished (not compared): TRITON unet FULL AUTO" in text
    assert "TRITON" in plain_table(BenchmarkResult(machine, _settings(), _cells(cuda=True)))


def test_cpu_report_shows_rss_only_even_on_a_gpu_machine():
    machine = {"cpu": "Xeon", "cpu_cores": 2, "torch": "2.13", "date": "d",
               "cuda_device": "NVIDIA H100"}  # --device cpu on a GPU machine
    text = markdown_report(BenchmarkResult(machine, _settings(), _cells(cuda=False)))
    assert "| peak RSS MiB |" in text and "| 500 |" in text and "allocated MiB" not in text
    assert "perf_counter" in text and "Device: CPU Xeon, 2 cores" in text


@pytest.mark.parametrize("args,mixed,weights", [
    (["--device", "cuda"], MixedPrecision.BF16, DType.BFLOAT16),
    (["--device", "cpu"], MixedPrecision.NO, DType.FLOAT32),
    (["--device", "cuda", "--precision", "fp32"], MixedPrecision.NO, DType.FLOAT32),
    (["--device", "cpu", "--precision", "fp16"], MixedPrecision.FP16, DType.FLOAT16),
])
def test_bf16_is_the_default_on_cuda_only(tmp_path, tempera_cache, args, mixed, weights):
    parsed = build_parser().parse_args(["--model", "tiny", "--out", str(tmp_path),
                                        "--cache-dir", str(tempera_cache), *args])
    config, _ = benchmark_config(parsed)
    assert (config.training.mixed_precision, config.model.weight_dtype) == (mixed, weights)


def test_a_config_keeps_its_own_precision(tmp_path):
    preset = tmp_path / "p.json"
    preset.write_text('{"config_version": 1, "general": {"device": "CUDA"}}')
    parsed = build_parser().parse_args(["--config", str(preset), "--out", str(tmp_path)])
    config, _ = benchmark_config(parsed)
    assert config.training.mixed_precision == MixedPrecision.NO


def test_timeout_scales_with_the_model_and_autotuning():
    sd15 = unet_parameter_count("sd15")
    tiny = unet_parameter_count("tiny")
    assert autotunes("INDUCTOR") and autotunes("TRITON")
    assert not autotunes("DEFAULT") and not autotunes("AOT_EAGER") and not autotunes("NOPE")
    # the case: an SD-size autotuned compile can pass 900 s
    assert cell_timeout_seconds(sd15, "INDUCTOR") > 2 * 900
    assert (cell_timeout_seconds(sd15, "INDUCTOR") > cell_timeout_seconds(sd15, "DEFAULT")
            > cell_timeout_seconds(tiny, "DEFAULT"))
    assert cell_timeout_seconds(sd15, "NONE") == cell_timeout_seconds(tiny, "NONE")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_family_gets_a_cell_timeout_from_its_denoiser(model_type, tempera_cache, tmp_path):
    """The benchmark's timeout reads the denoiser (a UNet or a transformer) of every family the
    trainer offers: its built-in model's folder, and the family's shipped config for a single
    file (a family missing from a table of UNets failed with a KeyError before any cell ran)."""
    spec = MODEL_TYPES[model_type]
    config = apply_overrides(Config(), [f"general.cache_dir={tempera_cache}",
                                        f"model.path={spec.builtin}",
                                        f"model.type={model_type.value}"])
    count, source = denoiser_parameters(config)
    assert source.endswith(f"{spec.denoiser}/config.json") and "models/configs" not in source
    assert count > 0 and cell_timeout_seconds(count, "INDUCTOR") > cell_timeout_seconds(count,
                                                                                        "NONE")
    if family_of(model_type).files is None:
        return  # a family read from diffusers folders only (Klein, yet): no shipped config
    config.model.path = str(tmp_path / "model.safetensors")   # no folder: the shipped config
    count, source = denoiser_parameters(config)
    shipped = family_files(model_type).single_file_configs
    assert source.endswith(f"models/configs/{shipped}/{spec.denoiser}/config.json")
    assert count > 100e6   # the real architecture, built on the meta device


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_benchmark_config_validates_for_every_family(model_type):
    # Z-Image samples with its flow-matching Euler scheduler only: a benchmark of it was
    # refused for the default sampler before a cell ran.
    config = model_config(Config(), model_path=MODEL_TYPES[model_type].builtin,
                          model_type=model_type, resolution=64, batch=2,
                          method=TrainingMethod.LORA, precision="fp32")
    assert validate(config) == []


def test_a_tiny_unet_counts_as_the_benchmark_model_of_the_same_shape(tmp_path, tempera_cache):
    from modules.models.tiny_sd import TINY_SPECS
    config = apply_overrides(Config(), [f"general.cache_dir={tempera_cache}"])
    assert denoiser_parameters(config)[0] == unet_parameter_count("tiny")
    folder = tmp_path / "model"
    (folder / "unet").mkdir(parents=True)
    (folder / "unet" / "config.json").write_text(json.dumps(
        {"_class_name": "UNet2DConditionModel", **TINY_SPECS[ModelType.SD15].unet}))
    config.model.path = str(folder)
    assert denoiser_parameters(config) == (unet_parameter_count("tiny"),
                                           str(folder / "unet" / "config.json"))


def _result(base_status: str, compiled_status: str, speedup: float = 1.5) -> BenchmarkResult:
    base = {"backend": "NONE", "label": "NONE (eager)", "status": base_status,
            "components": "-", "scope": "-", "dynamic": "-"}
    if base_status == "ok":
        base.update(median_step_seconds=1.0, speedup=1.0)
    finished = {"backend": "DEFAULT", "label": "DEFAULT unet FULL AUTO", "status": "ok",
                "components": "unet", "scope": "FULL", "dynamic": "AUTO", "fallbacks": [],
                "compiled_code_ran": True, "effective": {"unet": "DEFAULT"},
                "median_step_seconds": 1 / speedup,
                "speedup": speedup if base_status == "ok" else None}
    other = {"backend": "TRITON", "label": "TRITON unet FULL AUTO", "status": compiled_status,
             "components": "unet", "scope": "FULL", "dynamic": "AUTO",
             "error": "timed out after 4379 s"}
    return BenchmarkResult({}, {}, [base, finished, other])


@pytest.mark.parametrize("base,other,message", [
    ("ok", "timeout", "not every cell finished: TRITON unet FULL AUTO (timeout)"),
    ("ok", "skipped", "not every cell finished"),
    ("timeout", "failed", "not every cell finished: NONE (eager) (timeout)"),
    ("failed", "failed", "the eager baseline did not finish (failed"),
])
def test_apply_never_picks_over_an_unfinished_cell(tmp_path, base, other, message):
    preset = tmp_path / "p.json"
    preset.write_text('{"config_version": 1}')
    before = preset.read_bytes()
    with pytest.raises(ApplyError, match=re.escape(message)):
        apply_fastest(_result(base, other), preset)
    assert preset.read_bytes() == before


def test_a_failed_cell_does_not_block_the_finished_winner():
    values, note, cell = recommended_settings(_result("ok", "failed"))
    assert values["compile.backend"].value == "DEFAULT" and cell["backend"] == "DEFAULT"


@pytest.mark.parametrize("device,precision,mixed", [
    ("cuda", None, MixedPrecision.BF16), ("cpu", None, MixedPrecision.NO),
    ("cuda", "fp32", MixedPrecision.NO)])
def test_bucket_measurement_takes_a_device(tmp_path, device, precision, mixed):
    config = bucket_config(tmp_path, tmp_path / "data", "", "AOT_EAGER", "REGIONAL", "AUTO", 2,
                           device, precision)
    assert config.general.device.value == device.upper()
    assert config.training.mixed_precision == mixed
    assert apply_overrides(config, []).data.aspect_buckets


def test_one_command_line(capsys):
    from modules.bench.cli import main
    with pytest.raises(SystemExit) as exit_info:
        main(["buckets", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "benchmark_compile.py buckets" in out and "--device" in out
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    assert not (scripts / "measure_buckets.py").exists()
