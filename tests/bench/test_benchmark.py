"""The compile benchmark on the tiny model: real cells in subprocesses, outputs, --apply."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.bench import BenchmarkResult, apply_fastest, run_benchmark
from modules.bench.apply import ApplyError
from modules.bench.cli import main as bench_main
from modules.bench.models import unet_parameter_count
from modules.config import load_config, save_config
from modules.config.schema import CompileBackend

PRESETS = Path(__file__).resolve().parents[2] / "training_presets"


@pytest.fixture(scope="module")
def benchmark(tempera_cache, tmp_path_factory):
    """One real benchmark: eager, aot_eager (cold + warm process) and a backend that fails."""
    from modules.config import Config, apply_overrides
    out = tmp_path_factory.mktemp("bench")
    config = apply_overrides(Config(), [f"general.cache_dir={tempera_cache}",
                                        "data.resolution=64", "training.batch_size=2",
                                        'data.datasets=[{"path": "builtin:shapes", "repeats": 2}]',
                                        "compile.scope=REGIONAL", "compile.dynamic=STATIC"])
    events = []
    result = run_benchmark(config, backends=["NONE", "AOT_EAGER", "NO_SUCH_BACKEND"],
                           steps=3, warmup=2, out_dir=out, progress=events.append)
    return result, result.write(out), events


def test_every_cell_is_a_row_and_the_failing_one_says_why(benchmark):
    result, _, events = benchmark
    rows = {c["backend"]: c for c in result.cells}
    assert list(rows) == ["NONE", "AOT_EAGER", "NO_SUCH_BACKEND"]
    assert rows["NONE"]["status"] == rows["AOT_EAGER"]["status"] == "ok"
    failed = rows["NO_SUCH_BACKEND"]
    assert failed["status"] == "failed" and "unknown compile backend" in failed["error"]
    assert [e.phase for e in events if e.phase in ("done", "failed")] == ["done", "done", "failed"]


def test_ratios_come_from_the_same_run(benchmark):
    result, _, _ = benchmark
    base, cell = result.cells[0], result.cells[1]
    assert base["speedup"] == 1.0
    assert cell["speedup"] == pytest.approx(base["median_step_seconds"]
                                            / cell["median_step_seconds"], rel=1e-2)
    assert cell["cold_start_seconds"] == pytest.approx(
        cell["first_step_seconds"] - base["median_step_seconds"], abs=2e-3)
    # warm-up 2, then 3 clean steps: REGIONAL aot_eager compiles only in the first step.
    assert 1 in cell["compile_steps"] and cell["timed_steps"] == [3, 4, 5]
    assert len(cell["step_seconds"]) == 5 and cell["steps_run"] == 5
    assert cell["timing"] == "perf_counter" and not cell["cudagraphs"]
    assert cell["median_step_seconds"] == pytest.approx(
        sorted(cell["step_seconds"][2:])[1], abs=1e-5)
    assert cell["median_step_seconds"] > 0 and cell["peak_rss_bytes"] > 50 * 2**20
    assert cell["peak_allocated_bytes"] is None and cell["peak_reserved_bytes"] is None
    assert "RSS" in cell["memory_measured"]
    assert cell["compile_seconds"] > 0 and cell["compiled_code_ran"]
    assert cell["effective"] == {"unet": "AOT_EAGER"} and cell["fallbacks"] == []
    assert cell["graphs_after_warmup"] == 0, "a recompile inside the timed steps"
    warm = cell["warm"]
    assert warm["status"] == "ok" and warm["median_step_seconds"] > 0


def test_outputs_are_written_and_agree(benchmark):
    result, paths, _ = benchmark
    data = json.loads(paths["json"].read_text())
    assert data["cells"] == json.loads(json.dumps(result.cells))
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["torch"]
    # the timeout scales with the model: the tiny UNet gets the base limit
    assert data["settings"]["unet_parameters"] == unet_parameter_count("tiny")
    assert [c["timeout_seconds"] for c in data["cells"]] == [600, 600, 600]
    table = paths["markdown"].read_text()
    assert "| peak RSS MiB |" in table and "allocated MiB" not in table
    assert "perf_counter" in table and "peak RSS" in table
    assert "| AOT_EAGER | unet | REGIONAL | STATIC |" in table
    assert "**failed**: unknown compile backend" in table
    assert f"{result.cells[1]['speedup']:.2f}" in table
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_apply_writes_only_the_compile_settings(benchmark, tmp_path):
    result, _, _ = benchmark
    preset = tmp_path / "mine.json"
    save_config(load_config(PRESETS / "demo.json"), preset, sparse=True)
    before = json.loads(preset.read_text())
    applied = apply_fastest(result, preset)
    after = json.loads(preset.read_text())
    untouched = {k: v for k, v in before.items() if k != "compile"}
    assert {k: v for k, v in after.items() if k != "compile"} == untouched
    compiled = result.cells[1]
    expected = "AOT_EAGER" if compiled["speedup"] > 1.0 else "NONE"
    assert applied["backend"] == expected
    assert load_config(preset).compile.backend == CompileBackend(expected)


def _result(speedup_of_compiled: float | None) -> BenchmarkResult:
    base = {"backend": "NONE", "label": "NONE (eager)", "status": "ok", "components": "-",
            "scope": "-", "dynamic": "-", "median_step_seconds": 1.0, "speedup": 1.0}
    compiled = {"backend": "INDUCTOR", "label": "INDUCTOR unet+te FULL AUTO", "status": "ok",
                "components": "unet+te", "scope": "FULL", "dynamic": "AUTO", "fallbacks": [],
                "compiled_code_ran": True,
                "effective": {"unet": "INDUCTOR", "text_encoder": "INDUCTOR"}}
    if speedup_of_compiled is None:
        compiled.update(status="failed", error="boom")
    else:
        compiled.update(median_step_seconds=1 / speedup_of_compiled, speedup=speedup_of_compiled)
    return BenchmarkResult({}, {}, [base, compiled])


@pytest.mark.parametrize("speedup,backend", [(1.6, "INDUCTOR"), (0.8, "NONE"), (None, "NONE")])
def test_apply_picks_eager_when_compiling_does_not_pay(tmp_path, speedup, backend):
    preset = tmp_path / "p.json"
    preset.write_text('{"config_version": 1, "training": {"max_steps": 7}}')
    applied = apply_fastest(_result(speedup), preset)
    config = load_config(preset)
    assert applied["backend"] == backend and config.compile.backend == CompileBackend(backend)
    assert config.training.max_steps == 7
    if backend == "INDUCTOR":
        assert config.compile.text_encoder and config.compile.scope.value == "FULL"


def test_apply_refuses_a_shipped_preset_before_running_anything(tmp_path, capsys):
    preset = PRESETS / "demo.json"
    before = preset.read_bytes()
    assert bench_main(["--model", "tiny", "--out", str(tmp_path), "--apply", str(preset)]) == 1
    assert "ships with Tempera" in capsys.readouterr().err
    assert preset.read_bytes() == before and not (tmp_path / "benchmark.json").exists()
    with pytest.raises(ApplyError, match="ships with Tempera"):
        apply_fastest(_result(2.0), preset)
    assert preset.read_bytes() == before


@pytest.mark.parametrize("subcommand", [[], ["matrix"]])
def test_bad_arguments_are_reported(tmp_path, capsys, subcommand):
    assert bench_main([*subcommand, "--model", "tiny", "--components", "unet,everything",
                       "--out", str(tmp_path)]) == 2
    assert "unknown components 'everything'" in capsys.readouterr().err


def test_a_cell_that_hangs_is_killed_and_recorded(tiny_config, tmp_path):
    result = run_benchmark(tiny_config(), backends=["NONE"], steps=1, warmup=1,
                           cell_timeout=0.5, out_dir=tmp_path)
    assert result.cells[0]["status"] == "timeout"
    # in the engine's words, which the window shows too: no command-line flag
    assert "timed out after 0.5 s (the time per cell given)" in result.cells[0]["error"]
    assert "--" not in result.cells[0]["error"]
    assert result.cells[0]["timeout_seconds"] == 0.5
    assert result.fastest() is None and "No compiled cell" in result.markdown()
    assert "Not finished (not compared): NONE (eager)" in result.markdown()


def test_the_scaled_timeout_says_where_it_came_from(tiny_config, tmp_path, monkeypatch):
    import modules.bench.runner as runner
    asked = []
    monkeypatch.setattr(runner, "cell_timeout_seconds",
                        lambda params, backend, mode: asked.append((params, backend)) or 0.5)
    result = run_benchmark(tiny_config(), backends=["NONE"], steps=1, warmup=1,
                           out_dir=tmp_path)
    assert asked == [(unet_parameter_count("tiny"), "NONE")]
    assert result.cells[0]["status"] == "timeout"
    assert "scaled for a 0.4 M-parameter UNet and NONE" in result.cells[0]["error"]
    assert "--cell-timeout" not in result.cells[0]["error"]


def test_the_command_line_says_how_to_give_a_timed_out_cell_more_time(tmp_path, capsys):
    assert bench_main(["--model", "tiny", "--backends", "NONE", "--cell-timeout", "0.5",
                       "--out", str(tmp_path)]) == 0
    assert "--cell-timeout SECONDS gives every cell that long" in capsys.readouterr().err


@pytest.mark.parametrize("name,millions", [("sd15", 859.5), ("sdxl", 2567.5),
                                           ("zimage", 6154.9), ("klein", 3875.5)])
def test_real_size_shapes_have_the_real_parameter_counts(name, millions):
    # The GPU benchmark's SD 1.5 / SDXL UNets and Z-Image's and Klein 4B's transformers, built
    # on the meta device (no memory, no time).
    assert unet_parameter_count(name) / 1e6 == pytest.approx(millions, abs=0.5)


def test_the_real_size_zimage_builds_its_encoder_and_vae_from_the_shipped_configs():
    """The GPU phase's Z-Image: Qwen3-4B (its 36 layers; a 600-token vocabulary) and Flux's
    VAE, as the builder makes them, on the meta device."""
    import diffusers
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from modules.bench.models import bench_spec
    spec = bench_spec("zimage")
    with torch.device("meta"):
        encoder = Qwen3Model(Qwen3Config(**spec["text_encoder"], vocab_size=600))
        vae = diffusers.AutoencoderKL(**spec["vae"])
    layers = sum(p.numel() for n, p in encoder.named_parameters() if n.startswith("layers."))
    assert encoder.config.num_hidden_layers == 36 and layers / 1e9 == pytest.approx(3.63, abs=0.01)
    assert vae.config.latent_channels == 16 and vae.config.shift_factor == 0.1159


def test_the_real_size_klein_is_4b_from_the_shipped_configs_and_builds_in_bf16(tmp_path,
                                                                              capsys):
    """`--model klein` (scripts/benchmark_compile.py's choices come from the family table):
    Klein 4B's 5 + 20 blocks, Qwen3-4B's 36 layers (a 600-token vocabulary) and Flux.2's
    32-channel VAE, on the meta device; its builder, given the tiny spec, writes a
    Flux2KleinPipeline folder in bf16 (as Klein is released) that the family loads."""
    import diffusers
    import torch
    from transformers import Qwen3Config, Qwen3Model

    from modules.bench.cli import build_parser
    from modules.bench.models import bench_spec
    from modules.model_types import ModelType
    from modules.models.families import family_of
    from modules.models.tiny_klein import TINY_KLEIN
    assert build_parser().parse_args(["--model", "klein", "--out", "x"]).model == "klein"
    spec = bench_spec("klein")
    assert (spec["transformer"]["num_layers"], spec["transformer"]["num_single_layers"]) == (5, 20)
    with torch.device("meta"):
        encoder = Qwen3Model(Qwen3Config(**spec["text_encoder"], vocab_size=600))
        vae = diffusers.AutoencoderKLFlux2(**spec["vae"])
    layers = sum(p.numel() for n, p in encoder.named_parameters() if n.startswith("layers."))
    assert encoder.config.num_hidden_layers == 36 and layers / 1e9 == pytest.approx(3.63, abs=0.01)
    assert vae.config.latent_channels == 32
    assert spec["transformer"]["joint_attention_dim"] == 3 * spec["text_encoder"]["hidden_size"]
    family = family_of(ModelType.KLEIN)
    assert family.real_size is not None
    from safetensors import safe_open
    folder = family.real_size.build(TINY_KLEIN, tmp_path / "klein")
    files = sorted(folder.rglob("*.safetensors"))
    assert {p.parent.name for p in files} == {"transformer", "text_encoder", "vae"}
    for path in files:
        with safe_open(str(path), "pt") as f:
            # every float in bf16 (the batch norm counts its updates in int64)
            assert {f.get_slice(k).get_dtype() for k in f.keys()} - {"I64"} == {"BF16"}, path
    bundle = family.load_folder(folder, None, torch.bfloat16)
    assert not torch.equal(bundle.vae.bn.running_var, torch.ones_like(bundle.vae.bn.running_var))
