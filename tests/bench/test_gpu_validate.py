"""The GPU validation's runner, outputs and merge, with small stand-in jobs (no training here;
tests/bench/test_gpu_rehearsal.py runs the real phases on the tiny models)."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from modules.bench import gpu_validate
from modules.bench.gpu_cli import gpu_command, source_commit
from modules.bench.gpu_cli import main as cli_main
from modules.bench.gpu_jobs import KINDS, on_gpu_else_cpu, run_config, train_collect
from modules.bench.gpu_phases import LORA_SECONDS, PHASES, find_phase, phase_jobs
from modules.bench.gpu_report import BEGIN, END, merge_results, summary_markdown, train_rows
from modules.bench.gpu_machine import versions
from modules.bench.gpu_context import Context
from modules.config.validate import validate
from modules.train.recipe.loss_checks import family_problems
from modules.bench.gpu_validate import (
    REST,
    Job,
    Kind,
    child_env,
    job_limit,
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


def datasets_made(work: Path) -> None:
    """Mark the full-size runs' datasets as made (`buckets_dataset` makes each once per
    resolution): these tests read the commands and configs, and encoding the noise PNGs at
    1024 px costs about a minute of CPU. The rehearsal trains on the images themselves."""
    from modules.bench.gpu_phases import FULL_SIZES
    for key, size in FULL_SIZES.items():
        folder = work / "data" / f"{key}-{size.resolution}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "done").write_text("", encoding="utf-8")


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
    stale = ctx.job_dir("from-an-earlier-run")   # the same phase, run before on this machine
    stale.mkdir(parents=True)
    (stale / "run.json").write_text("{}")
    run_phase(ctx, [Job("first", "script", 30, {"code": WRITE_OK}),
                    Job("second", "script", 30, {"code": check})],
              {"script": script_kind()}, print_line=lambda line: None)
    assert rows_by_job(ctx)["second"]["status"] == "ok", rows_by_job(ctx)["second"]
    names = tarfile.open(ctx.out / "runs.tar.gz").getnames()
    assert not [n for n in names if n.startswith("from-an-earlier-run")], names
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


def test_the_runner_reads_the_machine_and_versions_without_importing_torch():
    """The runner starts once per phase (13 in the CPU rehearsal): torch's version and CUDA
    build come from its version file, as torch itself reports them."""
    import torch
    code = ("import sys, json; from modules.bench.gpu_context import Context; "
            "from pathlib import Path; c = Context(phase='1', device='cpu', tiny=True, "
            "out=Path('o'), work=Path('w'), budget_s=1, parallel=1); "
            "m, v = c.machine(), c.versions(); "
            "print(json.dumps([m, v, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=gpu_validate.REPO,
                          capture_output=True, text=True, timeout=120)
    machine, found, imported = json.loads(done.stdout.splitlines()[-1])
    assert not imported, "the runner imported torch"
    assert found["torch"] == machine["torch"] == torch.__version__
    assert found["cuda"] == machine["cuda_version"] == torch.version.cuda
    assert machine["cuda_device"] is None and "load_average_start" in machine


def test_phases_are_found_by_number_name_or_key_and_fit_the_command_limit():
    assert find_phase("1").key == find_phase("sd15-headline").key == "1-sd15-headline"
    assert find_phase("2").key == find_phase("2-sd15-breadth").key == "2-sd15-breadth"
    with pytest.raises(ValueError, match="unknown phase 'x'.*1-sd15-headline"):
        find_phase("x")
    assert [int(p.key.split("-")[0]) for p in PHASES] == list(range(1, len(PHASES) + 1))
    for phase in PHASES:
        assert phase.minutes <= 9
        for tiny in (False, True):
            jobs = phase_jobs(phase, tiny)
            names = [j.name for j in jobs]
            assert len(names) == len(set(names)), phase.key
            # Every phase names its GPU in its own env job (the runner holds no CUDA context).
            assert names[0] == "env", phase.key
            for job in jobs:  # what a job needs comes before it in the phase
                assert all(names.index(n) < names.index(job.name) for n in job.after), job
                assert job.limit_s == REST or job.limit_s < gpu_validate.PACK_RESERVE_SECONDS + 540
                # A phase needs nothing from an earlier one: a lent session starts bare.
                if job.spec.get("warm_from"):
                    assert job.spec["warm_from"] in job.after, job


def test_the_headline_phase_comes_first_and_times_eager_default_and_inductor_alone():
    assert PHASES[0].key == "1-sd15-headline"
    jobs = {j.name: j for j in phase_jobs(PHASES[0], tiny=False)}
    assert list(jobs) == ["env", "build-sd15", "cell-sd15-none", "cell-sd15-default",
                          "lora-sd15-default", "cell-sd15-inductor"]
    assert all(j.group is None for j in jobs.values())        # each alone
    for name in ("cell-sd15-default", "cell-sd15-inductor"):
        assert jobs[name].spec["compare_with"] == "cell-sd15-none"
        assert jobs[name].spec["warm_from"] is None and not jobs[name].spec["overrides"]  # cold
    assert jobs["lora-sd15-default"].spec["train_job"] == "cell-sd15-default"
    # the headline with what the budget leaves after its LoRA check; INDUCTOR with the rest
    assert jobs["cell-sd15-default"].limit_s == REST
    assert jobs["cell-sd15-default"].reserve_s == LORA_SECONDS
    assert jobs["cell-sd15-inductor"].limit_s == REST


def test_the_breadth_phase_wastes_no_slot():
    jobs = {j.name: j for j in phase_jobs(find_phase("2-sd15-breadth"), tiny=False)}
    runs = [j for j in jobs.values() if j.kind == "train"]
    # TRITON REGIONAL (checkpointing turns its CUDA graphs off: INDUCTOR again) is not run
    assert [j.name for j in runs] == ["train-sd15-none", "train-sd15-aot_eager",
                                      "train-sd15-default", "train-sd15-inductor",
                                      "train-sd15-triton-full"]
    assert all(j.limit_s == REST and j.reserve_s == LORA_SECONDS
               for j in [*runs, jobs["tests-gpu"]])
    loras = sorted(j.spec["train_job"] for j in jobs.values() if j.kind == "lora")
    assert loras == ["train-sd15-aot_eager", "train-sd15-default", "train-sd15-none"]


def test_every_job_of_every_phase_builds_its_command_at_full_size(tmp_path):
    # The CPU rehearsal runs one job per property; every job's command and config are still
    # built here, on CUDA at full size: an override that no longer exists fails now, not on
    # the GPU machine.
    datasets_made(tmp_path / "work")
    for phase in PHASES:
        ctx = Context(phase=phase.key, device="cuda", tiny=False, out=tmp_path / "out",
                      work=tmp_path / "work", budget_s=540, parallel=6,
                      rows=[{"job": f"build-{key}", "path": f"/models/{key}"}
                            for key in ("sd15", "sdxl", "zimage", "klein")])
        for job in phase_jobs(phase, tiny=False):
            folder = ctx.job_dir(job.name)
            folder.mkdir(parents=True)
            command = KINDS[job.kind].command(dataclasses.replace(job, limit_s=300), ctx, folder)
            assert command[0] == sys.executable, job
            if job.kind == "train":
                config = json.loads((folder / "config.json").read_text())
                assert config["compile"]["backend"] == job.spec["backend"]
                assert command[command.index("--progress-file") + 1] == str(
                    folder / "progress.json")
            if job.kind == "cell":
                spec = json.loads((folder / "cell-spec.json").read_text())
                assert spec["config"]["compile"]["backend"] == job.spec["backend"]
                assert spec["config"]["general"]["device"] == "CUDA"
            if job.kind in ("train", "cell"):
                # what a start checks short of the files: a setting the family refuses (Klein
                # had the runs' KOHYA output) fails here, not minutes into a lent GPU
                config = run_config(job, ctx, folder, tmp_path / "compile")
                problems = [p for p in validate(config) + family_problems(config)
                            if p.path != "general.device"]  # CUDA: the GPU machine's
                assert not problems, (phase.key, job.name, problems)


def test_the_bundle_phase_starts_its_last_cell_from_the_bundle_alone(tmp_path):
    """Phase 13's bundle cell: an empty cache folder of its own, compile.bundle pointing at
    the bundles the cold cell wrote, started only once that cell ended, and timed against
    eager (a new machine's first step)."""
    from modules.bench.gpu_phases import find_phase
    phase = find_phase("13")
    jobs = {job.name: job for job in phase_jobs(phase, tiny=False)}
    cold, warm = jobs["cell-sd15-default"], jobs["bundle-sd15-default"]
    assert cold.spec["backend"] == warm.spec["backend"] == "DEFAULT"
    assert "cell-sd15-default" in warm.after and warm.spec["compare_with"] == "cell-sd15-none"
    assert cold.reserve_s >= warm.limit_s  # the cold cell leaves the bundle cell its time
    ctx = Context(phase=phase.key, device="cuda", tiny=False, out=tmp_path / "out",
                  work=tmp_path / "work", budget_s=540, parallel=1,
                  rows=[{"job": "build-sd15", "path": "/models/sd15"}])
    datasets_made(ctx.work)
    written = ctx.compile_cache() / "cell-sd15-default" / "bundles"
    written.mkdir(parents=True)
    (written / "sd15-x.tcb").write_bytes(b"a bundle")
    own = ctx.compile_cache() / "bundle-sd15-default"
    (own / "stale").mkdir(parents=True)
    folder = ctx.job_dir(warm.name)
    folder.mkdir(parents=True)
    KINDS["cell"].command(dataclasses.replace(warm, limit_s=150), ctx, folder)
    config = json.loads((folder / "cell-spec.json").read_text())["config"]["compile"]
    assert config["bundle"] == str(written) and config["cache_dir"] == str(own)
    assert not own.exists()  # its own cache folder starts empty (the run makes it)
    cache = json.loads((folder / "cache.json").read_text())
    assert cache["warm_cache_found"] and cache["bundle_from"] == "cell-sd15-default"


def test_a_run_gets_what_the_budget_has_left_less_the_checks_after_it(tmp_path):
    pack = gpu_validate.PACK_RESERVE_SECONDS
    run = Job("r", "train", REST, reserve_s=120)
    assert job_limit(run, 500) == 500 - pack - 120
    assert job_limit(Job("r", "train", 300, reserve_s=120), 500) == 300
    # A run that would eat the checks' reserve is not started: the checks of the runs before
    # it (which ended) still get their time.
    ctx = context(tmp_path, budget=pack + 120 + 10)
    run_phase(ctx, [Job("run", "script", REST, {"code": WRITE_OK}, reserve_s=120),
                    Job("check", "script", 60, {"code": WRITE_OK})],
              {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["run"]["status"] == "not started"
    assert rows["run"]["error"].endswith("120 s of it kept for the checks after the runs)")
    assert rows["check"]["status"] == "ok"


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
            "commit": "3ece051ca06a",
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
    out = phase_summary(tmp_path, "3-sd15-warm", "cuda", tiny=False)
    written = merge_results([out], docs)
    page = (docs / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks\n\nbefore") and page.endswith("after\n")
    assert "an earlier block" not in page and "### Phase 3-sd15-warm" in page
    assert "NVIDIA H100 80GB HBM3; torch 2.11.0+cu130; cuda 13.0; triton 3.6.0" in page
    assert "; commit 3ece051ca06a" in page
    assert "| cell-sd15-inductor | ok | warm | — | 200.0 | 1.50× | cell-sd15-none |" in page
    assert "cell-sd15-inductor (3-sd15-warm): 1.50×" in page   # the speed-up target's row
    assert "cell-sd15-inductor (3-sd15-warm): 1.06×" in page   # memory: 8.5 / 8 GiB reserved
    assert "cell-sd15-inductor (3-sd15-warm): 6.0 s of 100.0 s (6%" in page  # warm vs cold
    assert "| cold-sd15-inductor | ok | cold | — | 500.0 | — | — |" in page  # never compared
    assert "not measured (phase 6-rest)" in page
    assert (docs / "benchmarks" / "gpu" / "3-sd15-warm.json").is_file()
    assert (docs / "images" / "gpu-validate.png").stat().st_size > 1000
    assert docs / "benchmarks.md" in written


def test_merge_refuses_a_rehearsal_and_leaves_the_docs_alone(tmp_path, capsys):
    docs = docs_copy(tmp_path)
    before = (docs / "benchmarks.md").read_text()
    out = phase_summary(tmp_path, "1-sd15-headline", "cpu", tiny=True)
    code = cli_main(["merge", str(out), "--docs", str(docs)])
    assert code == 2 and "is a rehearsal (tiny, device cpu)" in capsys.readouterr().err
    assert (docs / "benchmarks.md").read_text() == before
    assert not (docs / "benchmarks" / "gpu" / "1-sd15-headline.json").exists()


def test_merged_rows_are_keyed_by_phase_and_job(tmp_path):
    # Two phases each time their own eager cell: neither replaces the other, and each ratio
    # is against its own phase's eager cell (another phase may have had another card).
    docs = docs_copy(tmp_path)
    headline = phase_summary(tmp_path, "1-sd15-headline", "cuda", tiny=False)
    data = json.loads((headline / "summary.json").read_text())
    for row in data["jobs"]:
        if row["job"] == "cell-sd15-none":
            row["median_step_seconds"] = 0.40    # 0.40 / 0.20: 2.00× in this phase
    data["jobs"].append({"job": "cell-sd15-default", "kind": "cell", "status": "timeout",
                         "seconds": 290.4, "compare_with": "cell-sd15-none", "side_by_side": 1,
                         "progress": {"step": 0, "compile": "unet progress: graph 3"}})
    (headline / "summary.json").write_text(json.dumps(data))
    merge_results([headline, phase_summary(tmp_path, "3-sd15-warm", "cuda", tiny=False)], docs)
    page = (docs / "benchmarks.md").read_text()
    assert "best backend" in page and "cell-sd15-inductor (1-sd15-headline): 2.00×" in page
    assert "cell-sd15-default (1-sd15-headline): cold start > 290 s alone" in page
    assert page.count("| cell-sd15-none | ok |") == 2
    assert "| cell-sd15-default | timeout | cold | — | — | cold start > 290 s alone |" in page
    assert "last progress: step 0, unet progress: graph 3" in page


def test_jobs_runs_only_the_named_jobs_and_refuses_a_name_the_phase_lacks(tmp_path, capsys):
    ctx = context(tmp_path, jobs=("second",))
    run_phase(ctx, [Job("first", "script", 30, {"code": WRITE_OK}),
                    Job("second", "script", 30, {"code": WRITE_OK})],
              {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["first"] == {**rows["first"], "status": "not started", "error": "not in --jobs"}
    assert rows["second"]["status"] == "ok"
    code = cli_main(["2", "--device", "cpu", "--tiny", "--jobs", "train-sd15-none,typo",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert code == 2 and "phase 2-sd15-breadth has no job typo; its jobs: env, build-sd15," in err
    assert not (tmp_path / "o").exists()


def test_set_overrides_every_run_and_refuses_a_field_that_does_not_exist(tmp_path, capsys):
    from modules.bench.gpu_jobs import run_config
    from modules.bench.gpu_outputs import summary_data
    from modules.bench.gpu_report import phase_markdown
    ctx = context(tmp_path, overrides=("data.aspect_buckets=false", "training.seed=7"))
    ctx.rows.append({"job": "build-sd15", "kind": "build", "status": "ok",
                     "path": str(tmp_path / "model")})
    [job] = [j for j in phase_jobs(find_phase("2"), tiny=True) if j.name == "train-sd15-none"]
    config = run_config(job, ctx, tmp_path / "run", tmp_path / "cache")
    assert not config.data.aspect_buckets and config.training.seed == 7
    assert config.training.method.value == "LORA"     # the phase's own settings stay
    assert "Every run with --set `data.aspect_buckets=false`, `training.seed=7`." in \
        phase_markdown(summary_data(ctx, final=True))
    code = cli_main(["2", "--device", "cpu", "--tiny", "--set", "data.aspect_bucketz=false",
                     "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert code == 2 and "data.aspect_bucketz" in err and "did you mean 'data.aspect_buckets'" \
        in err
    assert not (tmp_path / "o").exists()


def test_list_names_every_phase_and_which_have_results(tmp_path, capsys):
    docs = docs_copy(tmp_path)
    assert cli_main(["--list", "--docs", str(docs)]) == 0
    text = capsys.readouterr().out
    assert "next: phase 1-sd15-headline" in text      # the headline first, until it has results
    commit = source_commit(None)   # this checkout's (None where there is no git: a tarball)
    assert text.rstrip().endswith("scripts/gpu_validate.py 1"
                                  + (f" --commit {commit}" if commit else "") + " --out $OUT")
    merge_results([phase_summary(tmp_path, "1-sd15-headline", "cuda", tiny=False)], docs)
    assert cli_main(["--list", "--docs", str(docs)]) == 0
    text = capsys.readouterr().out
    for phase in PHASES:
        assert phase.key in text
    assert "results: 2026-11-25 on NVIDIA H100 80GB HBM3 (4/4 jobs ok)" in text
    assert text.count("no results yet") == len(PHASES) - 1
    assert "next: phase 2-sd15-breadth" in text  # the earliest without results
    assert "python3 scripts/gpu_validate.py 2 " in text


def test_the_gpu_command_carries_the_wheels_and_the_commit():
    command = gpu_command("3", "abc123-dirty")
    assert command.startswith("python3 -m pip install -q --no-index --no-deps")
    assert "--target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD || exit;" in command
    assert command.endswith("scripts/gpu_validate.py 3 --commit abc123-dirty --out $OUT")


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


# --- nothing outlives the phase ------------------------------------------------------------
# A job that writes its pid, then sleeps: the tests below check that it is gone afterwards.
SLEEPER = """
import os, pathlib, time
pathlib.Path(FOLDER, "pid").write_text(str(os.getpid()))
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child of a living parent stays a zombie until reaped: it holds nothing
    status = Path(f"/proc/{pid}/stat")
    return not (status.is_file() and status.read_text().split(")")[-1].split()[0] == "Z")


def wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def runner_script(tmp_path: Path) -> Path:
    """A runner process (as scripts/gpu_validate.py is) with one sleeping job."""
    script = tmp_path / "runner.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path[:0] = [{str(gpu_validate.REPO)!r}, {str(Path(__file__).parent)!r}]
        from test_gpu_validate import SLEEPER, context, script_kind
        from modules.bench.gpu_validate import Job, PhaseStopped, run_phase
        ctx = context(Path({str(tmp_path)!r}))
        try:
            run_phase(ctx, [Job("sleeper", "script", 100, {{"code": SLEEPER}}),
                            Job("later", "script", 30, {{"code": "pass"}})],
                      {{"script": script_kind()}}, print_line=lambda line: None)
        except PhaseStopped as stop:
            sys.exit(128 + stop.signum)
        """))
    return script


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_runner_stopped_from_outside_takes_its_jobs_with_it(tmp_path, how):
    # SIGTERM: the runner kills its jobs and writes why; SIGKILL cannot be caught, and there
    # the kernel kills the job (it started in its own session, so nothing else would).
    runner = subprocess.Popen([sys.executable, str(runner_script(tmp_path))],
                              env=child_env(threads=1))
    pid_file = tmp_path / "work" / "jobs" / "9-test" / "sleeper" / "pid"
    wait_for(pid_file)
    job = int(pid_file.read_text())
    runner.send_signal(how)
    assert runner.wait(timeout=60) == (128 + how if how == signal.SIGTERM else -how)
    deadline = time.monotonic() + 10
    while alive(job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(job)
    if how == signal.SIGTERM:
        rows = {r["job"]: r for r in json.loads((tmp_path / "out" / "summary.json")
                                                .read_text())["jobs"]}
        assert rows["sleeper"]["status"] == "stopped"
        assert rows["sleeper"]["error"].startswith("the runner got SIGTERM: killed after")
        assert rows["later"] == {**rows["later"], "status": "not started",
                                 "error": "the runner got SIGTERM"}


def test_a_failure_in_the_runner_kills_the_jobs_it_started(tmp_path):
    def collect(job: Job, ctx: Context, folder: Path) -> dict:
        raise RuntimeError("a bug in a collect function")

    broken = Kind(script_kind().command, collect)
    ctx = context(tmp_path, parallel=2)
    jobs = [Job("sleeper", "script", 100, {"code": SLEEPER}, group="g"),
            Job("quick", "broken", 100, {"code": "pass"}, group="g")]
    with pytest.raises(RuntimeError, match="a bug"):
        run_phase(ctx, jobs, {"script": script_kind(), "broken": broken},
                  print_line=lambda line: None)
    job = int((ctx.job_dir("sleeper") / "pid").read_text())
    assert not alive(job)
    row = rows_by_job(ctx)["sleeper"]
    assert row["status"] == "stopped" and "the runner failed: RuntimeError" in row["error"]


def test_a_pytest_job_is_interrupted_before_it_is_killed_and_keeps_its_results(tmp_path):
    # At its limit pytest gets SIGINT: it writes its junit file (and -v lines) before SIGKILL.
    # test_0 passes at once (pytest's start on a loaded machine takes seconds), the rest
    # sleep well past the SIGINT
    tests = tmp_path / "slow_tests"
    tests.mkdir()
    (tests / "test_slow.py").write_text(
        "import time\ndef test_0():\n    pass\n"
        + "".join(f"def test_{i}():\n    time.sleep(30)\n" for i in range(1, 4)))
    ctx = context(tmp_path)
    limit = KINDS["pytest"].interrupt_s + 8     # SIGINT after ~8 s, while test_1 still runs
    run_phase(ctx, [Job("tests", "pytest", limit, {"paths": [str(tests)], "per_test": 300})],
              KINDS, print_line=lambda line: None)
    row = rows_by_job(ctx)["tests"]
    assert row["status"] == "timeout" and "interrupted at its time limit" in row["error"], row
    assert row["passed"] >= 1 and row["seconds"] < limit - 5    # it ended on the SIGINT
    command = json.loads((ctx.job_dir("tests") / "command.json").read_text())
    assert "-v" in command and command[command.index("--timeout") + 1] == "10"
    assert "test_slow.py::test_0 PASSED" in (ctx.job_dir("tests") / "log.txt").read_text()


# --- cheap guards ----------------------------------------------------------------------------
def test_versions_survive_a_library_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "tempera_broken_lib.py").write_text("raise RuntimeError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = versions(("tempera_broken_lib", "tempera_missing_lib", "torch"))
    assert found["tempera_broken_lib"] == "import failed: RuntimeError: half installed"
    assert found["tempera_missing_lib"] is None and found["torch"]


def test_an_out_of_memory_row_says_how_much_the_card_had_free(tmp_path, monkeypatch):
    # nvidia-smi stands in for the card: the parent reads it without a CUDA context.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) echo '81559, 80100, 1459';;\n"
                   "  *) echo '4242, 61000'; echo '4343, 19000';;\nesac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    oom = "raise SystemExit('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB')"
    ctx = context(tmp_path)
    run_phase(ctx, [Job("train-big", "script", 30, {"code": oom}),
                    Job("fine", "script", 30, {"code": WRITE_OK})],
              {"script": script_kind()}, print_line=lambda line: None)
    rows = rows_by_job(ctx)
    assert rows["train-big"]["card_memory"] == {
        "total_mib": 81559, "used_mib": 80100, "free_mib": 1459,
        "processes": [{"pid": 4242, "used_mib": 61000}, {"pid": 4343, "used_mib": 19000}]}
    assert "card_memory" not in rows["fine"]
    assert ("card when it ended: 1459 MiB free of 81559 MiB (held: pid 4242 61000 MiB, "
            "pid 4343 19000 MiB)") in (ctx.out / "summary.md").read_text()


def test_the_model_is_built_on_the_cpu_when_the_gpu_build_raises():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the CUDA build would not raise")
    built, where = on_gpu_else_cpu(lambda: torch.zeros(1).device.type, cuda=True)
    assert built == "cpu" and where["built_on"] == "cpu" and where["gpu_build_error"]
    assert on_gpu_else_cpu(lambda: "x", cuda=False) == ("x", {"built_on": "cpu"})


def test_a_run_killed_at_its_limit_shows_what_it_never_reported_as_a_dash(tmp_path):
    # run.json as train.py writes it at the start; killed during its first compile.
    folder = tmp_path / "train-sd15-inductor"
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "run.json").write_text(json.dumps(
        {"status": "running", "steps_done": 0, "losses": [], "device": "cuda: H100"}))
    (folder / "progress.json").write_text(json.dumps(
        {"step": 0, "max_steps": None, "compile": "unet progress: autotuning mm 41 of 96"}))
    row = train_collect(Job("train-sd15-inductor", "train", 60), context(tmp_path), folder)
    assert row["compile_seconds"] is None and row["cudagraphs"] is None
    assert row["late_recompiles"] is None and row["effective"] is None
    row = {**row, "job": "train-sd15-inductor", "status": "timeout", "side_by_side": 6,
           "error": "train-sd15-inductor > 330 s (killed at its time limit)"}
    table = "\n".join(train_rows([row]))
    assert "| train-sd15-inductor | timeout | — | — | — | — | — | — | — |" in table
    assert "last progress: step 0, unet progress: autotuning mm 41 of 96" in table


def test_the_summary_names_the_gpu_from_the_env_job_and_records_the_commit(tmp_path):
    env = """
    import json, pathlib
    pathlib.Path(FOLDER, "result.json").write_text(json.dumps(
        {"status": "ok", "gpu": {"name": "NVIDIA H200"}}))
    """
    ctx = context(tmp_path, commit="abc123")
    run_phase(ctx, [Job("env", "script", 30, {"code": env})], {"script": script_kind()},
              print_line=lambda line: None)
    summary = json.loads((ctx.out / "summary.json").read_text())
    assert summary["machine"]["cuda_device"] == "NVIDIA H200" and summary["commit"] == "abc123"
    assert summary_markdown(summary).splitlines()[2].startswith("NVIDIA H200; torch ")
    assert "; commit abc123." in summary_markdown(summary)


def test_pytest_results_give_each_failure_its_first_line_as_text(tmp_path):
    """tests.json's failures carry their message's first line as a string (it was a one-item
    list), and the job row names the failed test."""
    (tmp_path / "junit.xml").write_text(
        '<testsuite><testcase classname="tests.t" name="test_a">'
        '<failure message="assert 1 == 2&#10;where 1 = f()"/></testcase>'
        '<testcase classname="tests.t" name="test_b"><error/></testcase>'
        '<testcase classname="tests.t" name="test_c"/></testsuite>', encoding="utf-8")
    job = Job("pytest-cpu", "pytest", 60.0, {"paths": ["tests/t.py"]})
    row = KINDS["pytest"].collect(job, context(tmp_path), tmp_path)
    written = json.loads((tmp_path / "tests.json").read_text(encoding="utf-8"))
    assert written["failures"] == [{"test": "tests.t::test_a", "message": "assert 1 == 2"},
                                   {"test": "tests.t::test_b", "message": ""}]
    assert (row["status"], row["passed"], row["failed"]) == ("failed", 1, 2)
    assert row["error"] == "2 failed: tests.t::test_a, tests.t::test_b"
