"""The GPU validation's plan, without a GPU: each phase's ratio first and the budget
arithmetic behind it, a cell cut short by its limit still reporting a median, the plot's bars,
and the packages each phase needs against what the GPU machine has or is carried."""
from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from pathlib import Path

import pytest

from modules.bench import gpu_packages
from modules.bench.cell import StepTimer
from modules.bench.gpu_cli import main as cli_main
from modules.bench.gpu_context import Context
from modules.bench.gpu_phases import (
    LORA_SECONDS,
    PHASES,
    find_phase,
    phase_jobs,
    phase_packages,
)
from modules.bench.gpu_report import cell_rows, plot_bars, speedups
from modules.bench.gpu_validate import PACK_RESERVE_SECONDS, REST, Job, Kind, job_limit, run_phase
from modules.events import CompileEvent, Progress, TrainerCommands

BUDGET = 540.0   # the phase's default budget (gpu_cli.DEFAULT_BUDGET)


def jobs_of(key: str) -> dict[str, Job]:
    return {job.name: job for job in phase_jobs(find_phase(key), tiny=False)}


def first_ratio(jobs: dict[str, Job]) -> tuple[Job, Job]:
    """The phase's first pair of cells timed alone where one is compared with the other."""
    cells = [j for j in jobs.values() if j.kind == "cell" and j.group is None]
    for job in cells:
        if job.spec["compare_with"]:
            return jobs[job.spec["compare_with"]], job
    raise AssertionError("no cell is compared with another")


@pytest.mark.parametrize("key,eager,compiled", [
    ("1", "cell-sd15-none", "cell-sd15-default"),
    ("8", "cell-zimage-none", "cell-zimage-default"),
    ("14", "cell-klein-none", "cell-klein-default"),
    ("9", "cell-sdxl-offload-base-none", "cell-sdxl-offload-none"),
    ("12", "cell-sdxl-float8-base-none", "cell-sdxl-float8-none"),
])
def test_a_phase_that_times_a_backend_measures_its_ratio_first(key, eager, compiled):
    jobs = jobs_of(key)
    base, timed = first_ratio(jobs)
    assert (base.name, timed.name) == (eager, compiled)
    names = list(jobs)
    # nothing but the environment and the model comes before the ratio
    assert names[:names.index(eager)] == ["env", names[1]] and names[1].startswith("build-")
    assert base.spec["backend"] == "NONE" and base.group is None


@pytest.mark.parametrize("key,compiled,eager", [
    ("1", "cell-sd15-default", "cell-sd15-none"),
    ("8", "cell-zimage-default", "cell-zimage-none"),
    ("14", "cell-klein-default", "cell-klein-none"),
    ("9", "cell-sdxl-offload-default", "cell-sdxl-offload-none"),
    ("12", "cell-sdxl-float8-default", "cell-sdxl-float8-none"),
])
def test_the_first_compiled_cell_gets_what_the_budget_leaves(key, compiled, eager):
    """The compiled cell of a ratio-first phase is cold, alone, compared with its eager cell
    and limited by the budget alone (a fixed limit cut SD 1.5's cold DEFAULT at 300 s and
    left the lease without a ratio); only its checks' time is kept back."""
    jobs = jobs_of(key)
    job = jobs[compiled]
    assert job.limit_s == REST and job.group is None and job.spec["warm_from"] is None
    assert job.spec["compare_with"] == eager and job.spec["backend"] != "NONE"
    names = list(jobs)
    after = [jobs[n] for n in names[names.index(compiled) + 1:]]
    # what follows it is its reserve (its LoRA check) or gets what is left in turn
    assert sum(j.limit_s for j in after if j.limit_s != REST) <= job.reserve_s


def test_the_headline_cell_leaves_its_lora_check_exactly_its_time():
    jobs = jobs_of("1")
    default, lora = jobs["cell-sd15-default"], jobs["lora-sd15-default"]
    assert default.reserve_s == LORA_SECONDS == lora.limit_s
    remaining = BUDGET - 20 - 90 - 100      # env, the SD 1.5 build and the eager cell ran
    limit = job_limit(default, remaining)
    assert limit == remaining - PACK_RESERVE_SECONDS - LORA_SECONDS
    # DEFAULT used all of it: the LoRA check still gets its whole limit
    assert job_limit(lora, remaining - limit) == LORA_SECONDS


def test_the_offload_inductor_phase_keeps_its_warm_cells_their_time():
    jobs = jobs_of("11")
    cold = [j for j in jobs.values() if j.group == "cold"]
    warm = [j for j in jobs.values() if j.kind == "cell" and j.group is None]
    assert len(cold) == len(warm) == 2
    assert all(j.limit_s == REST and j.reserve_s == sum(w.limit_s for w in warm) for j in cold)
    assert {w.spec["warm_from"] for w in warm} == {c.name for c in cold}
    offload = jobs["cell-sdxl-offload-default"]
    assert offload.spec["compare_with"] == "cell-sdxl-offload-base-default"


def test_the_zimage_runs_through_train_py_are_a_phase_of_their_own():
    assert not [j for j in jobs_of("8").values() if j.kind == "train"]
    runs = [j for j in jobs_of("10").values() if j.kind == "train"]
    assert {j.spec["backend"] for j in runs} == {"NONE", "DEFAULT"}
    assert all(j.limit_s == REST for j in runs)


def test_every_comparison_is_with_a_cell_of_the_same_phase():
    for phase in PHASES:
        jobs = {j.name: j for j in phase_jobs(phase, tiny=False)}
        for job in jobs.values():
            other = job.spec.get("compare_with")
            if other:
                assert other in jobs and jobs[other].group is None, (phase.key, job.name)


# --- a cell cut short ---------------------------------------------------------------------
def _progress(step: int) -> Progress:
    return Progress(step, 99, 1, 1, 0.1, 0.1, 1e-3, 0.1, 1.0)


def test_a_cell_past_its_stop_time_stops_at_its_first_clean_step():
    commands = TrainerCommands()
    timer = StepTimer(False, steps=15, warmup=1, commands=commands, stop_at=time.time() - 1)
    timer.on_compile(CompileEvent("unet", "compiling UNet (DEFAULT, regional)…"))
    timer.on_progress(_progress(1))          # the compile step: nothing to time yet
    assert not commands.stop_requested
    timer.on_progress(_progress(2))
    assert commands.stop_requested and timer.cut_short and timer.timed_steps(0) == [1]
    # before its stop time, the same steps go on
    commands = TrainerCommands()
    timer = StepTimer(False, steps=15, warmup=1, commands=commands, stop_at=time.time() + 60)
    for step in (1, 2, 3):
        timer.on_progress(_progress(step))
    assert not commands.stop_requested and not timer.cut_short


def test_a_cell_cut_short_gives_its_ratio_and_says_how_short(tmp_path, tempera_cache):
    """A real cell on the tiny model (eager: a few seconds of training) whose stop time has
    passed: it ends by itself with a median from the clean steps it has. Over 10 s: it trains
    through the real trainer, which is what stops (a StepTimer alone cannot show that)."""
    from modules.bench.cell import run_cell
    from modules.bench.matrix import Cell, cell_config
    from modules.config import apply_overrides, Config, to_dict

    base = apply_overrides(Config(), [f"general.cache_dir={tempera_cache}", "data.resolution=64",
                                      "training.batch_size=2", "sampling.prompts=[]",
                                      "logging.tensorboard=false"])
    config = cell_config(base, Cell("NONE", "unet", "REGIONAL", "AUTO"), max_steps=40,
                         output_dir=tmp_path / "out", compile_cache_dir=tmp_path / "cache")
    result = run_cell({"config": to_dict(config), "steps": 30, "warmup": 1,
                       "stop_at": time.time()})
    assert result["status"] == "ok" and result["partial"] and result["stopped_at_time_limit"]
    assert result["steps_run"] < 30 and result["timed_steps"] and result["median_step_seconds"]
    row = {"job": "cell-sd15-default", "kind": "cell", "status": "ok", "seconds": 200,
           "compare_with": "cell-sd15-none", **result,
           "median_step_seconds": result["median_step_seconds"] / 2}
    eager = {"job": "cell-sd15-none", "kind": "cell", "status": "ok", "seconds": 40,
             "median_step_seconds": result["median_step_seconds"]}
    assert speedups([eager, row])["cell-sd15-default"] == ("cell-sd15-none", 2.0)
    table = "\n".join(cell_rows([eager, row]))
    assert "| 2.00× (partial) | cell-sd15-none |" in table
    assert (f"partial steady window: {len(result['timed_steps'])} of 30 clean steps (it "
            "stopped itself at its time limit)") in table


# --- the report -----------------------------------------------------------------------------
def test_the_plot_draws_cold_compiles_of_timed_cells_too():
    jobs = [{"job": "cell-sd15-none", "kind": "cell", "status": "ok", "median_step_seconds": 0.3},
            {"job": "cell-sd15-default", "kind": "cell", "status": "ok", "compile_seconds": 80.0,
             "median_step_seconds": 0.2, "warm_cache_found": False},
            {"job": "cold-sd15-inductor", "kind": "cell", "status": "ok", "side_by_side": 3,
             "compile_seconds": 140.0, "median_step_seconds": 0.4},
            {"job": "cell-sd15-inductor", "kind": "cell", "status": "ok", "compile_seconds": 6.0,
             "median_step_seconds": 0.19, "warm_cache_found": True},
            {"job": "train-sd15-inductor", "kind": "train", "status": "ok",
             "compile_seconds": 120.0},
            {"job": "cell-sd15-triton", "kind": "cell", "status": "timeout", "seconds": 176.1,
             "warm_cache_found": False}]
    steps, cold = plot_bars([{"phase": "1-sd15-headline", "jobs": jobs}])
    assert cold == [("cell-sd15-default (1-sd15-headline)", 80.0),
                    ("cold-sd15-inductor (1-sd15-headline) (side by side)", 140.0),
                    ("train-sd15-inductor (1-sd15-headline)", 120.0),
                    # killed at its limit: a lower bound, labelled so (and hatched)
                    ("cell-sd15-triton (1-sd15-headline) > 176 s, killed", 176.1)]
    assert [label for label, _ in steps] == ["cell-sd15-none (1-sd15-headline)",
                                             "cell-sd15-default (1-sd15-headline)",
                                             "cell-sd15-inductor (1-sd15-headline)"]


def test_the_date_and_load_are_read_before_the_first_job(tmp_path):
    def command(job: Job, ctx: Context, folder: Path) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(2.5)"]

    ctx = Context(phase="9-test", device="cpu", tiny=True, out=tmp_path / "out",
                  work=tmp_path / "work", budget_s=60, parallel=1)
    started = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    run_phase(ctx, [Job("slow", "sleep", 30)], {"sleep": Kind(command, lambda *a: {})},
              print_line=lambda line: None)
    summary = json.loads((ctx.out / "summary.json").read_text())
    read = dt.datetime.fromisoformat(summary["machine"]["date"])
    assert read - started <= dt.timedelta(seconds=1), (read, started)
    assert "load_average_start" in summary["machine"]


def test_list_names_what_each_phase_measures_not_issue_numbers(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    assert cli_main(["--list", "--docs", str(docs)]) == 0
    text = capsys.readouterr().out
    listing = text.split("\nnext:")[0]
    assert not re.search(r"issue|\(\d+\)", listing, re.IGNORECASE), listing
    for phase in PHASES:
        assert f"{phase.key} " in listing and phase.answers in listing
        assert f"{phase.topic}; no results yet" in listing


# --- packages -------------------------------------------------------------------------------
def test_every_package_a_phase_needs_is_on_the_gpu_image_or_carried():
    for phase in PHASES:
        needed = phase_packages(phase)
        assert set(gpu_packages.EVERY_PHASE) <= set(needed)
        assert gpu_packages.not_carried(needed) == [], phase.key


def test_float8_storage_needs_torchao_and_its_wheel_is_named():
    assert "torchao" not in gpu_packages.GPU_IMAGE and "torchao" not in gpu_packages.CARRIED
    assert gpu_packages.config_packages(["model.weight_storage=FLOAT8"]) == ["torchao"]
    assert gpu_packages.config_packages(["model.weight_storage=W8A8"]) == []  # torch alone
    assert gpu_packages.config_packages(["training.optimizer=PRODIGY"]) == ["pytorch-optimizer"]
    assert gpu_packages.config_packages(["model.offload_blocks=1000"]) == []
    float8 = find_phase("12")
    assert "torchao" in phase_packages(float8)
    assert gpu_packages.wheels_command(phase_packages(float8)) == (
        f"bash ../shared/gpu/wheels.sh torchao=={gpu_packages.EXTRA_WHEELS['torchao']}")
    # A phase without such settings carries the default wheels only.
    assert gpu_packages.extra_wheels(phase_packages(find_phase("1"))) == []
    jobs = {j.name: j for j in phase_jobs(float8, tiny=True)}
    assert jobs["cell-sdxl-float8-none"].spec["packages"] == ["torchao"]
    assert jobs["cell-sdxl-float8-base-none"].spec["packages"] == []


def test_list_names_the_wheels_the_next_phase_needs_besides_the_default(tmp_path, capsys,
                                                                       monkeypatch):
    import modules.bench.gpu_phases as gpu_phases

    monkeypatch.setattr(gpu_phases, "PHASES", [find_phase("12")])
    docs = tmp_path / "docs"
    docs.mkdir()
    assert cli_main(["--list", "--docs", str(docs)]) == 0
    text = capsys.readouterr().out
    assert "bash ../shared/gpu/wheels.sh torchao==" in text.split("\nnext:")[1]


def test_a_job_whose_package_is_missing_is_not_started_with_the_wheel_to_carry(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setitem(gpu_packages.EXTRA_WHEELS, "no-such-package-here", "1.0")

    def command(job: Job, ctx: Context, folder: Path) -> list[str]:
        return [sys.executable, "-c", "pass"]

    ctx = Context(phase="9-test", device="cpu", tiny=True, out=tmp_path / "out",
                  work=tmp_path / "work", budget_s=60, parallel=1)
    run_phase(ctx, [Job("needs", "x", 30, {"packages": ["no-such-package-here"]}),
                    Job("plain", "x", 30, {"packages": []})],
              {"x": Kind(command, lambda *a: {})}, print_line=lambda line: None)
    rows = {r["job"]: r for r in ctx.rows}
    assert rows["needs"]["status"] == "not started"
    assert rows["needs"]["error"] == ("needs no-such-package-here, not installed here: carry "
                                      "the wheel (bash ../shared/gpu/wheels.sh "
                                      "no-such-package-here==1.0)")
    assert rows["plain"]["status"] == "ok"
