"""Every GPU validation phase end to end on the CPU with the tiny models (``--device cpu
--tiny``), through the script as the GPU machine runs it: so the script cannot rot between the
rare sessions that are lent a GPU. Eager and AOT_EAGER here (inductor costs about a minute per
graph on this CPU); one inductor-marked test runs the warm phase's compiled cells (cold, then
warm on the cache the cold one filled) and loads the compiled cell's LoRA in diffusers, as the
headline phase's LoRA check does.

CI time is scarce: each property is rehearsed once. `REHEARSED` names the jobs each phase runs
here (with what they need); what a job has in common with another phase's (the env job, the
eager cell, a second LoRA check) runs in one phase only, and the rest is left out with the
reason ("not in --jobs"). A phase whose every job is rehearsed in another (its build is the
same cache hit as phase 2's; its cells are the inductor-marked test's or the GPU's) runs no
job here: the runner alone, its outputs and their merge (`""` in `REHEARSED`)."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from modules.bench.gpu_cli import source_commit
from modules.bench.gpu_packages import missing, wheels_command
from modules.bench.gpu_phases import PHASES, phase_jobs
from modules.bench.gpu_report import merge_results

REPO = Path(__file__).resolve().parents[2]
# Why a job may be left out of a rehearsal; anything else not started is a defect.
LEFT_OUT = re.compile(r"backend \w+ not in --backends [\w,]+|needs a CUDA GPU|not in --jobs|"
                      r"needs [\w-]+, which ended not started")
# Each phase's jobs in the CPU rehearsal (None: all of them; "": none, the runner alone): one
# run per property. A warm build (a cache hit) is phases 2 and 4's (SD 1.5), 6 and 9's (SDXL).
REHEARSED: dict[str, str | None] = {
    "1-sd15-headline": None,   # the env job and the eager cell, for every phase
    # a compile wrapper's run and LoRA; eager's run and LoRA check: the SDXL phase's
    "2-sd15-breadth": "build-sd15,train-sd15-aot_eager,tests-gpu,lora-sd15-aot_eager",
    # its cells are the inductor-marked test's; an eager cell with an override (channels_last,
    # a batch size) trains as the headline's does (tests/train covers both settings), and
    # every job's config is built in test_gpu_validate.py
    "3-sd15-warm": "",
    "4-sd15-more": "build-sd15,cell-sd15-finetune-none",
    "5-sdxl": "build-sdxl,train-sdxl-none,lora-sdxl-none",
    # an SDXL full fine-tune: tests/train/test_typed_presets.py's sdxl/fine_tune (buckets,
    # gradient checkpointing); a train job through train.py: phases 2 and 5's
    "6-rest": "",
    "7-sd15-batch": "",
    # a flow-matching transformer's eager cell (its DEFAULT cell: the GPU's; a compiled
    # Z-Image run is tests/models/test_zimage_compile.py's)
    "8-zimage": "build-zimage,cell-zimage-none",
    # the offloaded eager cell (the base cell is the headline's eager cell with an override;
    # its compiled cells: the GPU's)
    "9-offload": "build-sdxl,cell-sdxl-offload-none",
    # its runs are the train kind of phases 2, 5 and 6 on the Z-Image size that phase 8's
    # cell rehearses (the same run_config); Z-Image through train.py is tests/models'
    "10-zimage-train": "",
    # compiled cells only: the GPU's (the offloaded eager cell is phase 9's)
    "11-offload-inductor": "",
    # its cells are eager cells with an override (float8 training is
    # tests/train/test_weight_storage.py's; a float8 step costs seconds here) and DEFAULT's:
    # that torchao is there for them is test_the_packages_the_phases_need_are_installed_here's
    "12-float8": "",
    # DEFAULT cells: the cold one writes a compile bundle, the other starts from it alone
    # (the bundle round trip on the CPU is tests/train/test_compile_ahead.py's; the bundle
    # cell's config is test_gpu_validate.py's)
    "13-bundle": "",
    # its eager cell is phase 8's flow-matching transformer cell on another family (the same
    # run_config and cell; tiny Klein trains, compiled and not, in tests/models); its every
    # config passes the start's checks in test_gpu_validate.py; DEFAULT: the GPU's
    "14-klein": "",
    # eager cells with an override (INT8 training is tests/train/test_weight_storage.py's, W8A8's
    # tests/train/test_w8a8.py's) and a DEFAULT cell: the GPU's
    "15-int8": "",
    # eager cells with overrides: a fused fine-tune with offload is
    # tests/train/test_offload_fine_tune.py's (bit for bit against the run without)
    "16-offload-fine-tune": "",
}


def run_phase(phase: str, out: Path, work: Path, backends: str, jobs: str | None = None,
              overrides: tuple[str, ...] = ()) -> dict:
    command = [sys.executable, str(REPO / "scripts" / "gpu_validate.py"), phase, "--device",
               "cpu", "--tiny", "--backends", backends, "--out", str(out), "--work", str(work),
               *(["--jobs", jobs] if jobs is not None else []),
               *(arg for override in overrides for arg in ("--set", override))]
    # SIGTERM at the limit, not subprocess.run's SIGKILL: the runner then kills its jobs.
    runner = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = runner.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        runner.send_signal(signal.SIGTERM)
        stdout, stderr = runner.communicate(timeout=60)
    assert runner.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert stdout.rstrip().endswith((out / "summary.md").read_text().rstrip()[-200:])
    return summary


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """Every phase, one after another on one work folder (as on a warm GPU machine)."""
    assert set(REHEARSED) == {phase.key for phase in PHASES}  # a new phase is rehearsed too
    root = tmp_path_factory.mktemp("gpu-rehearsal")
    results = {}
    for phase in PHASES:
        out = root / "out" / phase.key
        results[phase.key] = (run_phase(phase.key, out, root / "work", "NONE,AOT_EAGER",
                                        REHEARSED[phase.key]), out)
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
        if REHEARSED[key] == "":   # the runner alone: every job left out, and said so
            assert {r["error"] for r in summary["jobs"]} == {"not in --jobs"}, key
        else:
            assert any(r["status"] == "ok" for r in summary["jobs"]), key


def test_the_headline_phase_names_the_machine_and_times_eager_alone(phases):
    jobs = rows(phases["1-sd15-headline"][0])
    env = jobs["env"]
    assert env["backends"]["TRITON"].startswith("TRITON needs a CUDA GPU")
    assert env["backends"]["AOT_EAGER"] == "runs"
    assert env["tf32"] == {"allow_tf32": True, "applied": False,
                           "why": "TF32 exists only on CUDA GPUs",
                           "matmul_allow_tf32": False, "cudnn_allow_tf32": True}
    assert jobs["build-sd15"]["built_on"] == "cpu"
    eager = jobs["cell-sd15-none"]
    assert eager["timed_steps"] and eager["median_step_seconds"] > 0
    assert eager["cudagraphs"] is False and eager["side_by_side"] == 1
    # DEFAULT and its LoRA check: the inductor-marked test below runs the same cell and check
    # in the warm phase; INDUCTOR (max_autotune): the GPU's
    assert jobs["cell-sd15-default"]["error"].startswith("backend DEFAULT not in")
    assert jobs["lora-sd15-default"]["error"] == "needs cell-sd15-default, which ended not started"
    assert jobs["cell-sd15-inductor"]["error"].startswith("backend INDUCTOR not in")
    assert phases["1-sd15-headline"][0]["commit"] == source_commit(None)  # from git, if any


def test_the_breadth_phase_trains_through_train_py_and_runs_the_cuda_tests(phases):
    summary, out = phases["2-sd15-breadth"]
    jobs = rows(summary)
    run = jobs["train-sd15-aot_eager"]
    assert run["steps_done"] == 4 and run["recompiles_after_first_pass"] == 0
    assert run["peak_rss_bytes"] > 0 and run["median_step_seconds"] > 0
    assert run["effective"] == {"unet": "AOT_EAGER"} and run["compile_seconds"] > 0
    assert run["progress"]["step"] == 4    # the progress file, not --quiet
    lora = jobs["lora-sd15-aot_eager"]
    assert set(lora["files"]) == {"pytorch_lora_weights.safetensors", "lora_kohya.safetensors"}
    for loaded in lora["files"].values():
        assert loaded["adapters"] and loaded["finite"] and loaded["mean_abs_change"] > 0
    tests = jobs["tests-gpu"]
    assert tests["failed"] == 0 and tests["skipped"] >= 9  # skipped without CUDA, and said so
    names = tarfile.open(out / "runs.tar.gz").getnames()
    assert "train-sd15-aot_eager/out/run.json" in names
    assert "train-sd15-aot_eager/progress.json" in names
    assert "lora-sd15-aot_eager/lora.json" in names and "tests-gpu/log-tail.txt" in names


def test_the_sdxl_phase_trains_sdxl_and_leaves_fp16_to_cuda(phases):
    jobs = rows(phases["5-sdxl"][0])
    run = jobs["train-sdxl-none"]    # the eager run through train.py (the SD 1.5 one's twin)
    assert run["steps_done"] == 4 and run["effective"] == {} and run["compile_seconds"] == 0
    assert jobs["train-sdxl-fp16"]["error"] == "needs a CUDA GPU"
    assert jobs["lora-sdxl-none"]["status"] == "ok"


def test_the_sd15_fine_tune_cell_runs_and_is_compared_on_memory_only(phases):
    more = rows(phases["4-sd15-more"][0])
    assert more["cell-sd15-finetune-none"]["status"] == "ok"
    assert more["cell-sd15-finetune-none"]["compare_with"] is None  # side by side: memory only


def test_the_zimage_phase_times_the_transformer_family_in_a_cell(phases):
    jobs = rows(phases["8-zimage"][0])
    cell = jobs["cell-zimage-none"]
    assert cell["status"] == "ok" and cell["median_step_seconds"] > 0, cell
    assert cell["effective"] == {} and cell["peak_rss_bytes"] > 0, cell
    assert cell["timed_steps"] and cell["steps_wanted"] == 3, cell
    # the compiled cell: the GPU's (an inductor graph costs a minute here)
    assert jobs["cell-zimage-default"]["error"] == "not in --jobs"


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
def test_compiled_cells_start_cold_then_warm_and_their_lora_loads(tmp_path):
    """The warm phase's DEFAULT cells (inductor without max_autotune) on a fresh work folder,
    as a lent session starts bare: the cold cell fills the compile cache and runs compiled
    code, the cell alone after it must hit that cache (a warm start), and the LoRA the compiled
    cell saved loads into diffusers and changes its output (`lora_body`, what the headline's
    lora-sd15-default job runs on its DEFAULT cell). Over 10 s: two inductor compiles of the
    tiny UNet, cold then warm (about a minute per graph here). The cold and the warm cell are
    two processes: this is also the check that the compile engine's persistent cache
    (`compile.cache_dir`) is found by a second process (a miss, then a hit, compiled faster).

    The headline phase's own DEFAULT cell is not run again here: it is this cold cell's job
    (`_cell` with no warm_from: a fresh cache) alone and compared with eager, as the warm cell
    below is; its lora job's wiring to it is test_gpu_validate.py's
    test_the_headline_phase_comes_first_and_times_eager_default_and_inductor_alone; a lora job
    run after the job it checks is the breadth phase's, and the eager cell the ratio is against
    the headline phase's, in the rehearsal above; the ratio's arithmetic is
    test_gpu_validate.py's.

    One image shape (`--set data.aspect_buckets=false`, which the summary records): the
    rehearsal's two buckets would compile each block twice, cold and warm; inductor's
    recompile of each block for a second resolution is tests/compile/test_inductor.py's
    test_regional_inductor_training_matches_eager_across_resolutions, and two buckets through
    the runner are the rehearsal's eager and AOT_EAGER phases'."""
    from modules.bench.gpu_jobs import lora_body
    from modules.bench.gpu_phases import TINY_SIZES

    work = tmp_path / "work"
    one_shape = ("data.aspect_buckets=false",)
    summary = run_phase("3", tmp_path / "out", work, "DEFAULT",
                        "build-sd15,cold-sd15-default,cell-sd15-default", one_shape)
    assert summary["overrides"] == list(one_shape)
    timed = rows(summary)
    assert timed["cell-sd15-channels-last-default"]["error"] == "not in --jobs"
    cold, warm = timed["cold-sd15-default"], timed["cell-sd15-default"]
    for cell in (cold, warm):
        assert cell["status"] == "ok" and cell["effective"] == {"unet": "DEFAULT"}, cell
        assert cell["compiled_code_ran"] and cell["compile_seconds"] > 0, cell
        assert cell["median_step_seconds"] > 0, cell
    assert not cold["warm_cache_found"] and "miss" in cold["cache"], cold
    assert cold["compare_with"] is None, cold  # side by side in its phase: memory only
    assert warm["warm_cache_found"] and warm["warm_from"] == "cold-sd15-default", warm
    assert "hit" in warm["cache"] and warm["compile_seconds"] < cold["compile_seconds"], warm
    assert warm["compare_with"] == "cell-sd15-none" and warm["side_by_side"] == 1, warm
    [phase] = [p.key for p in PHASES if p.key.startswith("3-")]
    lora = lora_body({"device": "cpu", "model_path": timed["build-sd15"]["path"],
                      "final": str(work / "jobs" / phase / "cell-sd15-default" / "out" / "final"),
                      "resolution": TINY_SIZES["sd15"].resolution, "steps": 2})
    assert lora["status"] == "ok", lora
    assert set(lora["files"]) == {"pytorch_lora_weights.safetensors", "lora_kohya.safetensors"}
    assert all(f["adapters"] and f["mean_abs_change"] > 0 for f in lora["files"].values())


def test_the_offload_phase_times_a_cell_with_every_block_offloaded(phases):
    jobs = rows(phases["9-offload"][0])
    assert jobs["cell-sdxl-offload-none"]["status"] == "ok", jobs["cell-sdxl-offload-none"]
    assert jobs["cell-sdxl-offload-none"]["compare_with"] == "cell-sdxl-offload-base-none"


def test_the_packages_the_phases_need_are_installed_here():
    """What the phases' runs need besides the engine (torchao for float8 storage, say) is
    installed: on the GPU image's stack (../shared/gpu/emulate.sh, the wheels in .site/ as on
    the GPU machine), a wheel the next lent session would lack fails here first."""
    for phase in PHASES:
        needed = sorted({p for job in phase_jobs(phase, tiny=True)
                         for p in job.spec.get("packages", ())})
        assert missing(needed) == [], f"{phase.key} needs {needed}: {wheels_command(needed)}"
