"""Every GPU validation phase end to end on the CPU with the tiny models (``--device cpu
--tiny``), through the script as the GPU machine runs it: so the script cannot rot between the
rare sessions that are lent a GPU. Eager and AOT_EAGER here (inductor costs about a minute per
graph on this CPU); one inductor-marked test checks a compiled run's LoRA and the warm cache."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from modules.bench.gpu_phases import PHASES
from modules.bench.gpu_report import merge_results

REPO = Path(__file__).resolve().parents[2]
# Why a job may be left out of a rehearsal; anything else not started is a defect.
LEFT_OUT = re.compile(r"backend \w+ not in --backends [\w,]+|needs a CUDA GPU|"
                      r"needs [\w-]+, which ended not started")


def run_phase(phase: str, out: Path, work: Path, backends: str, jobs: str = "") -> dict:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_validate.py"), phase, "--device", "cpu",
         "--tiny", "--backends", backends, "--out", str(out), "--work", str(work),
         *(["--jobs", jobs] if jobs else [])],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert done.stdout.rstrip().endswith((out / "summary.md").read_text().rstrip()[-200:])
    return summary


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """Every phase, one after another on one work folder (as on a warm GPU machine)."""
    root = tmp_path_factory.mktemp("gpu-rehearsal")
    results = {}
    for phase in PHASES:
        out = root / "out" / phase.key
        results[phase.key] = (run_phase(phase.key, out, root / "work", "NONE,AOT_EAGER"), out)
    return results


def rows(summary: dict) -> dict[str, dict]:
    return {r["job"]: r for r in summary["jobs"]}


def test_every_phase_completes_with_no_failed_job_and_at_most_8_files(phases):
    for key, (summary, out) in phases.items():
        assert summary["complete"] and summary["tiny"] and summary["device"] == "cpu"
        assert len(list(out.iterdir())) <= 8, key
        for row in summary["jobs"]:
            if row["status"] == "not started":
                assert LEFT_OUT.fullmatch(row["error"]), (key, row)
            else:
                assert row["status"] == "ok", (key, row)
        assert any(r["status"] == "ok" for r in summary["jobs"]), key


def test_phase_1_reports_the_backends_and_runs_the_cuda_tests(phases):
    jobs = rows(phases["1-sd15"][0])
    assert jobs["env"]["backends"]["TRITON"].startswith("TRITON needs a CUDA GPU")
    assert jobs["env"]["backends"]["AOT_EAGER"] == "runs"
    tests = jobs["tests-gpu"]
    assert tests["failed"] == 0 and tests["skipped"] >= 9  # skipped without CUDA, and said so


def test_phase_1_trains_through_train_py_and_its_loras_load_in_diffusers(phases):
    summary, out = phases["1-sd15"]
    jobs = rows(summary)
    for name, backend in (("none", None), ("aot_eager", "AOT_EAGER")):
        run = jobs[f"train-sd15-{name}"]
        assert run["steps_done"] == 4 and run["recompiles_after_first_pass"] == 0
        assert run["peak_rss_bytes"] > 0 and run["median_step_seconds"] > 0
        assert (run["effective"] == {"unet": backend} if backend else run["effective"] == {})
        lora = jobs[f"lora-sd15-{name}"]
        assert set(lora["files"]) == {"pytorch_lora_weights.safetensors",
                                      "lora_kohya.safetensors"}
        for loaded in lora["files"].values():
            assert loaded["adapters"] and loaded["finite"] and loaded["mean_abs_change"] > 0
    names = tarfile.open(out / "runs.tar.gz").getnames()
    assert "train-sd15-aot_eager/out/run.json" in names
    assert "lora-sd15-none/lora.json" in names and "train-sd15-none/log-tail.txt" in names


def test_phase_2_times_each_setting_alone_against_its_baseline(phases):
    jobs = rows(phases["2-sd15-warm"][0])
    assert jobs["cell-sd15-none"]["timed_steps"] and jobs["cell-sd15-none"]["cudagraphs"] is False
    channels_last = jobs["cell-sd15-channels-last-none"]
    assert channels_last["status"] == "ok" and channels_last["median_step_seconds"] > 0
    assert channels_last["compare_with"] == "cell-sd15-none"
    # each compiled cell starts from the cache its cold twin filled in the same phase (the
    # inductor-marked test below); without that backend it is left out, and says why
    assert jobs["cold-sd15-inductor"]["error"].startswith("backend INDUCTOR not in")
    assert jobs["cell-sd15-inductor"]["error"].startswith("backend INDUCTOR not in")


def test_phase_4_trains_sdxl_and_leaves_fp16_to_cuda(phases):
    jobs = rows(phases["4-sdxl"][0])
    assert jobs["train-sdxl-none"]["steps_done"] == 4
    assert jobs["train-sdxl-fp16"]["error"] == "needs a CUDA GPU"
    assert jobs["lora-sdxl-none"]["status"] == "ok"


def test_phases_3_5_and_6_run_fine_tunes_and_batch_sizes(phases):
    more = rows(phases["3-sd15-more"][0])
    assert more["cell-sd15-finetune-none"]["status"] == "ok"
    assert more["cell-sd15-finetune-none"]["compare_with"] is None  # side by side: memory only
    assert more["cell-sd15-inductor-autotune"]["error"].startswith("backend INDUCTOR not in")
    rest = rows(phases["5-rest"][0])
    assert rest["train-sdxl-finetune"]["steps_done"] == 4
    assert rest["train-sd15-inductor-full"]["error"].startswith("backend INDUCTOR not in")
    batch = rows(phases["6-sd15-batch"][0])
    assert batch["cell-sd15-batch1-none"]["status"] == batch["cell-sd15-batch4-none"]["status"] \
        == "ok"


def test_merge_folds_the_rehearsal_into_a_docs_copy(phases, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copyfile(REPO / "docs" / "benchmarks.md", docs / "benchmarks.md")
    merge_results([out for _, out in phases.values()], docs, allow_rehearsal=True)
    page = (docs / "benchmarks.md").read_text()
    for phase in PHASES:
        assert f"### Phase {phase.key} (tiny rehearsal)" in page
    assert "| train-sd15-aot_eager | ok | AOT_EAGER |" in page
    assert (docs / "images" / "gpu-validate.png").is_file()


@pytest.mark.inductor
def test_a_compiled_runs_lora_loads_and_the_warm_cell_starts_from_its_cold_twin(tmp_path):
    """INDUCTOR through train.py on the tiny model and its LoRA into diffusers (phase 1); then
    phase 2 on a fresh work folder, as a lent session starts bare: the cold cell fills the
    cache, the cell after it must hit it (a warm start)."""
    # each inductor graph costs about a minute here: only the jobs this test reads
    trained = rows(run_phase("1", tmp_path / "out1", tmp_path / "work1", "INDUCTOR",
                             "build-sd15,train-sd15-inductor,lora-sd15-inductor"))
    run = trained["train-sd15-inductor"]
    assert run["status"] == "ok" and run["effective"] == {"unet": "INDUCTOR"}
    assert run["compiled_code_ran"] and run["recompiles_after_first_pass"] == 0
    lora = trained["lora-sd15-inductor"]
    assert lora["status"] == "ok", lora
    assert all(f["mean_abs_change"] > 0 for f in lora["files"].values())
    timed = rows(run_phase("2", tmp_path / "out2", tmp_path / "work2", "INDUCTOR",
                           "build-sd15,cold-sd15-inductor,cell-sd15-inductor"))
    assert timed["cell-sd15-channels-last-inductor"]["error"] == "not in --jobs"
    cold, warm = timed["cold-sd15-inductor"], timed["cell-sd15-inductor"]
    assert cold["status"] == "ok" and not cold["warm_cache_found"]
    assert warm["status"] == "ok" and warm["warm_cache_found"], warm
    assert warm["warm_from"] == "cold-sd15-inductor" and "hit" in warm["cache"], warm
    assert warm["compile_seconds"] < cold["compile_seconds"]
