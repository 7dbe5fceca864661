"""The table of cold compiles measured on GPUs, and the first-run estimate that quotes it."""
from __future__ import annotations

import json

import pytest

from modules.bench.gpu_phases import FULL_SIZES, find_phase, measured_table, phase_jobs
from modules.compile.measured import MeasuredCompile, load_table, table_rows
from modules.config import Config, apply_overrides
from modules.train.state.history import CompileExpectation, with_measured

LABELS = {"SD15": "Stable Diffusion 1.x", "SDXL": "Stable Diffusion XL", "ZIMAGE": "Z-Image"}


def phase(key: str, jobs: list[dict], device: str = "cuda", tiny: bool = False) -> dict:
    return {"phase": key, "device": device, "tiny": tiny,
            "machine": {"cuda_device": "NVIDIA H200"}, "jobs": jobs}


def rows_of(*phases: dict) -> list[dict]:
    return table_rows(list(phases), lambda key: phase_jobs(find_phase(key), tiny=False),
                      FULL_SIZES, LABELS)


def test_only_cold_compiles_alone_are_rows_and_a_stopped_one_is_a_lower_bound():
    headline = phase("1-sd15-headline", [
        {"job": "cell-sd15-none", "kind": "cell", "status": "ok", "backend": "NONE"},
        {"job": "cell-sd15-default", "kind": "cell", "status": "ok", "backend": "DEFAULT",
         "compile_seconds": 157.2, "side_by_side": 1, "warm_cache_found": False},
        {"job": "cell-sd15-inductor", "kind": "cell", "status": "timeout", "backend": "INDUCTOR",
         "seconds": 176.1, "side_by_side": 1}])
    warm = phase("3-sd15-warm", [
        # side by side: the CPU was shared, so its seconds are no estimate
        {"job": "cold-sd15-default", "kind": "cell", "status": "ok", "backend": "DEFAULT",
         "compile_seconds": 300.0, "side_by_side": 3},
        # warm on its cold twin's cache
        {"job": "cell-sd15-default", "kind": "cell", "status": "ok", "backend": "DEFAULT",
         "compile_seconds": 9.0, "side_by_side": 1, "warm_cache_found": True,
         "warm_from": "cold-sd15-default"}])
    rest = phase("6-rest", [
        {"job": "train-sd15-default-full", "kind": "train", "status": "ok", "backend": "DEFAULT",
         "compile_seconds": 410.0, "side_by_side": 1}])
    rehearsal = phase("1-sd15-headline", headline["jobs"], device="cpu", tiny=True)
    rows = rows_of(headline, warm, rest, rehearsal)
    assert [(r["backend"], r["scope"], r["seconds"], r["ended"], r["phase"]) for r in rows] == [
        ("DEFAULT", "REGIONAL", 157.2, True, "1-sd15-headline"),
        ("INDUCTOR", "REGIONAL", 176.1, False, "1-sd15-headline"),
        ("DEFAULT", "FULL", 410.0, True, "6-rest")]
    assert rows[0] == {"family": "SD15", "label": "Stable Diffusion 1.x",
                            "backend": "DEFAULT", "scope": "REGIONAL", "device": "NVIDIA H200",
                            "resolution": 512, "batch": 2, "seconds": 157.2, "ended": True,
                            "phase": "1-sd15-headline"}


def test_the_repository_table_is_what_merge_makes_of_the_merged_phases():
    """`modules/compile/measured_compiles.json` is written by `gpu_validate.py merge`: it must
    agree with docs/benchmarks/gpu/ (a phase merged without it, or a hand edit, fails here)."""
    from pathlib import Path

    from modules.bench.gpu_report import load_phases
    raw = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "gpu"
    table = measured_table(load_phases(raw))
    assert [MeasuredCompile(**row) for row in table["rows"]] == load_table()


@pytest.fixture
def table(tmp_path, monkeypatch):
    rows = [MeasuredCompile("SD15", "Stable Diffusion 1.x", "INDUCTOR", "REGIONAL", "NVIDIA H200",
                            512, 2, 176.1, False, "1-sd15-headline"),
            MeasuredCompile("SD15", "Stable Diffusion 1.x", "DEFAULT", "REGIONAL", "NVIDIA H200",
                            512, 2, 157.2, True, "1-sd15-headline")]
    path = tmp_path / "measured.json"
    path.write_text(json.dumps({"rows": [row.__dict__ for row in rows]}))
    monkeypatch.setattr("modules.compile.measured.TABLE", path)
    return rows


def test_a_first_cold_compile_on_a_gpu_quotes_the_measurement_for_its_settings(table):
    config = apply_overrides(Config(), ["model.type=SD15", "compile.backend=DEFAULT",
                                                "compile.scope=REGIONAL"])
    expected = with_measured(None, config, "cuda")
    assert expected is not None and not expected.warm and expected.seconds is None
    assert expected.measured == ("DEFAULT REGIONAL compiled Stable Diffusion 1.x (512 px, "
                                 "batch 2) in 2:37 cold on an NVIDIA H200")
    stopped = with_measured(None, apply_overrides(config, ["compile.backend=INDUCTOR"]), "cuda")
    assert "in over 2:56 (stopped before it ended) cold" in stopped.measured
    # nothing measured for these settings, another device, or an estimate of its own: as it was
    assert with_measured(None, apply_overrides(config, ["compile.scope=FULL"]), "cuda") is None
    assert with_measured(None, config, "cpu") is None
    own = CompileExpectation(seconds=90.0, warm=False, cold_seconds=90.0, graphs={})
    assert with_measured(own, config, "cuda") is own
    warm = CompileExpectation(seconds=None, warm=True, cold_seconds=None, graphs={}, bundle=True)
    assert with_measured(warm, config, "cuda") is warm


def test_the_busy_line_says_what_was_measured_elsewhere(table):
    from app.run_panel import compile_hint
    config = apply_overrides(Config(), ["model.type=SD15", "compile.backend=DEFAULT"])
    assert compile_hint(with_measured(None, config, "cuda")) == (
        " · first compile with these settings here; measured elsewhere: DEFAULT REGIONAL "
        "compiled Stable Diffusion 1.x (512 px, batch 2) in 2:37 cold on an NVIDIA H200")
