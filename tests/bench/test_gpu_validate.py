"""The GPU validation's runner, outputs and merge, with small stand-in jobs (no training here;
tests/bench/test_gpu_rehearsal.py runs the real phases on the tiny models)."""
from __future__ import annotations

import json
import os
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from modules.bench import gpu_validate
from modules.bench.gpu_cli import main as cli_main
from modules.bench.gpu_phases import PHASES, find_phase, phase_jobs
from modules.bench.gpu_report import BEGIN, END, merge_results
from modules.bench.gpu_validate import (
    Context,
    Job,
    Kind,
    child_env,
    run_phase,
)


def script_kind() -> Kind:
    """A job that runs ``spec["code"]`` (Python; FOLDER and OUT are its paths) and whose row is
    the result.json it wrote (missing: the exit code decides)."""
    def command(job: Job, ctx: Context, folder: Path) -> list[str]:
        code = f"FOLDER = {str(folder)!r}; OUT = {str(ctx.out)!r}\n" + textwrap.dedent(
            job.spec["code"])
        return [sys.executable, "-c", code]

    def collect(job: Job, ctx: Context, folder: Path) -> dict:
        return json.loads((folder / "result.json").read_text())
    return Kind(command, collect)


def context(tmp_path: Path, budget: float = 120.0, parallel: int = 1, **kw) -> Context:
    return Context(phase="9-test", device="cpu", tiny=True, out=tmp_path / "out",
                   work=tmp_path / "work", budget_s=budget, parallel=parallel, **kw)


WRITE_OK = """
import json, pathlib
pathlib.Path(FOLDER, "result.json").write_text(json.dumps({"status": "ok", "value": 7}))
"""


def rows_by_job(ctx: Context) -> dict[str, dict]:
    return {r["job"]: r for r in ctx.rows}


def test_a_job_past_its_limit_is_a_timeout_row_and_the_rest_still_runs(tmp_path):
    ctx = context(tmp_path)
    jobs = [Job("slow", "script", 2, {"code": "import time; time.sleep(60)"}),
            Job("after-slow", "script", 30, {"code": WRITE_OK})]
    run_phase(ctx, jobs, {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["slow"]["status"] == "timeout"
    assert "slow > 2 s" in rows["slow"]["error"] and rows["slow"]["seconds"] < 30
    assert rows["after-slow"]["status"] == "ok" and rows["after-slow"]["value"] == 7


def test_a_crash_is_reported_from_its_log_and_what_needed_it_is_not_started(tmp_path):
    ctx = context(tmp_path)
    jobs = [Job("crash", "script", 30, {"code": "raise SystemExit('the model folder is gone')"}),
            Job("needs-crash", "script", 30, {"code": WRITE_OK}, after=("crash",))]
    run_phase(ctx, jobs, {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["crash"]["status"] == "failed"
    assert rows["crash"]["error"] == "the model folder is gone"
    assert rows["needs-crash"]["status"] == "not started"
    assert rows["needs-crash"]["error"] == "needs crash, which ended failed"


def test_a_run_that_train_py_refuses_up_front_is_a_refused_row_with_its_reason(tmp_path):
    # train.py exits 2 on a ConfigError (the check phase: a fine-tune too big for the card)
    # before it writes run.json; that is an answer (issue 31), not a crash.
    refuse = ("import sys; print('error: training.method: expected a run that fits, got "
              "FINE_TUNE, which needs at least 60.00 GiB', file=sys.stderr); sys.exit(2)")
    ctx = context(tmp_path)
    jobs = [Job("train-big", "train", 30, {"code": refuse}),
            Job("train-crash", "train", 30, {"code": "raise SystemExit('segfault')"})]
    run_phase(ctx, jobs, {"train": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["train-big"]["status"] == "refused"
    assert rows["train-big"]["error"].endswith("which needs at least 60.00 GiB")
    assert rows["train-crash"]["status"] == "failed"  # exit 1: not a refusal


def test_a_spent_budget_leaves_the_remaining_jobs_not_started(tmp_path):
    ctx = context(tmp_path, budget=gpu_validate.PACK_RESERVE_SECONDS + 5)
    run_phase(ctx, [Job("late", "script", 30, {"code": WRITE_OK})], {"script": script_kind()},
              print_line=lambda line: None)
    row = rows_by_job(ctx)["late"]
    assert row["status"] == "not started" and "budget is spent" in row["error"]


def test_the_results_so_far_are_written_before_the_next_job_runs(tmp_path):
    # The second job reads summary.json and runs.tar.gz while the phase is still running.
    check = """
    import json, pathlib, tarfile
    summary = json.loads(pathlib.Path(OUT, "summary.json").read_text())
    names = tarfile.open(pathlib.Path(OUT, "runs.tar.gz")).getnames()
    ok = (not summary["complete"] and [r["job"] for r in summary["jobs"]] == ["first"]
          and "first/log-tail.txt" in names)
    pathlib.Path(FOLDER, "result.json").write_text(json.dumps({"status": "ok" if ok else "failed",
                                                               "error": None if ok else str(summary)}))
    """
    ctx = context(tmp_path)
    run_phase(ctx, [Job("first", "script", 30, {"code": WRITE_OK}),
                    Job("second", "script", 30, {"code": check})],
              {"script": script_kind()}, print_line=lambda line: None)
    assert rows_by_job(ctx)["second"]["status"] == "ok", rows_by_job(ctx)["second"]
    summary = json.loads((ctx.out / "summary.json").read_text())
    assert summary["complete"] and [r["job"] for r in summary["jobs"]] == ["first", "second"]
    assert "| first | ok |" in (ctx.out / "summary.md").read_text()
    assert len(list(ctx.out.iterdir())) <= 8


def test_a_group_runs_side_by_side_and_a_job_starts_once_what_it_needs_has_ended(tmp_path):
    # a and b each wait for the other to have started: only side by side can both finish.
    meet = """
    import json, pathlib, time
    folder = pathlib.Path(FOLDER)
    (folder.parent / (folder.name + ".started")).write_text("")
    other = folder.parent / ("{other}" + ".started")
    deadline = time.monotonic() + 60
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (folder / "result.json").write_text(json.dumps({{"status": "ok" if other.exists() else "failed"}}))
    """
    after_a = """
    import json, pathlib
    a = pathlib.Path(FOLDER).parent / "a" / "result.json"
    pathlib.Path(FOLDER, "result.json").write_text(json.dumps({"status": "ok" if a.exists() else "failed"}))
    """
    ctx = context(tmp_path, parallel=2)
    jobs = [Job("a", "script", 90, {"code": meet.format(other="b")}, group="g"),
            Job("b", "script", 90, {"code": meet.format(other="a")}, group="g"),
            Job("c", "script", 90, {"code": after_a}, group="g", after=("a",))]
    run_phase(ctx, jobs, {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert [rows[n]["status"] for n in "abc"] == ["ok", "ok", "ok"], rows
    assert rows["a"]["side_by_side"] == 2 and rows["b"]["side_by_side"] == 2


def test_backends_and_cuda_only_jobs_are_not_started_with_the_reason(tmp_path):
    ctx = context(tmp_path, backends=("NONE",))
    jobs = [Job("inductor", "script", 30, {"code": WRITE_OK, "backend": "INDUCTOR"}),
            Job("fp16", "script", 30, {"code": WRITE_OK, "backend": "NONE", "needs_cuda": True}),
            Job("eager", "script", 30, {"code": WRITE_OK, "backend": "NONE"})]
    run_phase(ctx, jobs, {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["inductor"]["error"] == "backend INDUCTOR not in --backends NONE"
    assert rows["fp16"]["error"] == "needs a CUDA GPU"
    assert rows["eager"]["status"] == "ok"


def test_child_processes_extend_pythonpath_instead_of_replacing_it(monkeypatch):
    # The GPU image keeps diffusers in .site/ on PYTHONPATH: a job must still find it.
    monkeypatch.setenv("PYTHONPATH", "/somewhere/.site")
    env = child_env(threads=3)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(gpu_validate.REPO), "/somewhere/.site"]
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == "3" and env["HF_HUB_OFFLINE"] == "1"


def test_phases_are_found_by_number_name_or_key_and_fit_the_command_limit():
    assert find_phase("1").key == find_phase("sd15").key == find_phase("1-sd15").key == "1-sd15"
    with pytest.raises(ValueError, match="unknown phase 'x'.*1-sd15"):
        find_phase("x")
    for phase in PHASES:
        assert phase.minutes <= 9
        for tiny in (False, True):
            jobs = phase_jobs(phase, tiny)
            names = [j.name for j in jobs]
            assert len(names) == len(set(names)), phase.key
            for job in jobs:  # what a job needs comes before it in the phase
                assert all(names.index(n) < names.index(job.name) for n in job.after), job
                assert job.limit_s < gpu_validate.PACK_RESERVE_SECONDS + 540
                # A phase needs nothing from an earlier one: a lent session starts bare.
                if job.spec.get("warm_from"):
                    assert job.spec["warm_from"] in job.after, job


def phase_summary(tmp_path: Path, phase: str, device: str, tiny: bool) -> Path:
    """A returned output folder with one train row and one cell row, as a phase writes them."""
    out = tmp_path / f"out-{phase}"
    out.mkdir()
    jobs = [{"job": "train-sd15-inductor", "kind": "train", "status": "ok", "seconds": 200,
             "backend": "INDUCTOR", "effective": {"unet": "INDUCTOR"}, "compile_seconds": 120.0,
             "median_step_seconds": 0.31, "first_step_seconds": 121.0,
             "recompiles_after_first_pass": 0, "late_recompiles": 0,
             "peak_reserved_bytes": 9 * 2**30, "first_loss": 0.2, "final_loss": 0.1},
            {"job": "cold-sd15-inductor", "kind": "cell", "status": "ok", "seconds": 150,
             "compile_seconds": 100.0, "median_step_seconds": 0.5, "side_by_side": 4},
            {"job": "cell-sd15-none", "kind": "cell", "status": "ok", "seconds": 40,
             "median_step_seconds": 0.30, "peak_reserved_bytes": 8 * 2**30},
            {"job": "cell-sd15-inductor", "kind": "cell", "status": "ok", "seconds": 40,
             "compare_with": "cell-sd15-none", "warm_cache_found": True,
             "warm_from": "cold-sd15-inductor",
             "median_step_seconds": 0.20, "compile_seconds": 6.0,
             "peak_reserved_bytes": 8.5 * 2**30}]
    data = {"phase": phase, "device": device, "tiny": tiny, "complete": True,
            "budget_seconds": 540, "parallel": 6, "elapsed_seconds": 500,
            "machine": {"cuda_device": "NVIDIA H100 80GB HBM3", "date": "2026-11-25T15:00:00"},
            "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"},
            "jobs": jobs}
    (out / "summary.json").write_text(json.dumps(data))
    with tarfile.open(out / "runs.tar.gz", "w:gz"):
        pass
    return out


def docs_copy(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "benchmarks.md").write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nan earlier block\n{END}\n\nafter\n")
    return docs


def test_merge_puts_a_gpu_phase_into_the_docs_block_with_its_targets(tmp_path):
    docs = docs_copy(tmp_path)
    out = phase_summary(tmp_path, "2-sd15-warm", "cuda", tiny=False)
    written = merge_results([out], docs)
    page = (docs / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks\n\nbefore") and page.endswith("after\n")
    assert "an earlier block" not in page and "### Phase 2-sd15-warm" in page
    assert "NVIDIA H100 80GB HBM3; torch 2.11.0+cu130; cuda 13.0; triton 3.6.0" in page
    assert "| cell-sd15-inductor | ok | warm | — | 200.0 | 1.50× | cell-sd15-none |" in page
    assert "cell-sd15-inductor: 1.50×" in page           # the speed-up target's row
    assert "cell-sd15-inductor: 1.06×" in page           # memory: 8.5 / 8 GiB reserved
    assert "cell-sd15-inductor: 6.0 s of 100.0 s (6%" in page  # warm against its cold start
    assert "| cold-sd15-inductor | ok | cold | — | 500.0 | — | — |" in page  # never compared
    assert (docs / "benchmarks" / "gpu" / "2-sd15-warm.json").is_file()
    assert (docs / "images" / "gpu-validate.png").stat().st_size > 1000
    assert docs / "benchmarks.md" in written


def test_merge_refuses_a_rehearsal_and_leaves_the_docs_alone(tmp_path, capsys):
    docs = docs_copy(tmp_path)
    before = (docs / "benchmarks.md").read_text()
    out = phase_summary(tmp_path, "1-sd15", "cpu", tiny=True)
    code = cli_main(["merge", str(out), "--docs", str(docs)])
    assert code == 2 and "is a rehearsal (tiny, device cpu)" in capsys.readouterr().err
    assert (docs / "benchmarks.md").read_text() == before
    assert not (docs / "benchmarks" / "gpu" / "1-sd15.json").exists()


def test_jobs_runs_only_the_named_jobs_and_refuses_a_name_the_phase_lacks(tmp_path, capsys):
    ctx = context(tmp_path, jobs=("second",))
    run_phase(ctx, [Job("first", "script", 30, {"code": WRITE_OK}),
                    Job("second", "script", 30, {"code": WRITE_OK})],
              {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["first"] == {**rows["first"], "status": "not started", "error": "not in --jobs"}
    assert rows["second"]["status"] == "ok"
    code = cli_main(["1", "--device", "cpu", "--tiny", "--jobs", "train-sd15-none,typo",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert code == 2 and "phase 1-sd15 has no job typo; its jobs: env, build-sd15," in err
    assert not (tmp_path / "o").exists()


def test_list_names_every_phase_and_which_have_results(tmp_path, capsys):
    docs = docs_copy(tmp_path)
    merge_results([phase_summary(tmp_path, "1-sd15", "cuda", tiny=False)], docs)
    assert cli_main(["--list", "--docs", str(docs)]) == 0
    text = capsys.readouterr().out
    for phase in PHASES:
        assert phase.key in text
    assert "results: 2026-11-25 on NVIDIA H100 80GB HBM3 (4/4 jobs ok)" in text
    assert text.count("no results yet") == len(PHASES) - 1
    assert "next: phase 2-sd15-warm" in text  # the earliest without results


def test_the_real_docs_page_has_the_block_merge_rewrites():
    page = (gpu_validate.REPO / "docs" / "benchmarks.md").read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1


def test_a_cuda_phase_without_a_gpu_is_refused_up_front(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = cli_main(["2", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")])
    assert code == 2 and "rehearse with --device cpu --tiny" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
