"""compile.ahead and compile bundles through the real trainer.

compile.ahead: the ahead process compiles the run's batch shapes while the data is cached and
writes the compile bundle the run loads (step 1 compiles nothing, its losses are those of a run
without it); a failed ahead process is reported and the run trains; a Stop during setup ends
it; what validation refuses.

Compile bundles: the first run writes one, a second process with another cache folder and home
starts from it alone (inductor's cache hits, not misses) and trains the same numbers, and a
damaged bundle is named and passed over without stopping a run. The bundle file format's
refusals are tests/compile/test_bundle.py's.

The compiled component is the frozen text encoder, FULL: its forward-only graph is the
cheapest real inductor compile a run makes (the UNet's forward and backward take minutes). The
runs share one module-scoped fixture, so the run without compile ahead is also the bundle's
first run: two cold compiles in all."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from modules.config import apply_overrides, save_config
from modules.config.schema import Config
from modules.compile.ahead_rules import ahead_problems
from modules.events import NullCallbacks, TrainerCommands
from modules.train.trainer import train

COMPILED = ["compile.backend=DEFAULT", "compile.scope=FULL", "compile.denoiser=false",
            "compile.text_encoder=true", "training.max_steps=2"]
AHEAD_PID = re.compile(r"compile ahead: compiling .* in process (\d+)")


class OnAhead(NullCallbacks):
    """Calls ``act(pid)`` when the run says it started its ahead process."""

    def __init__(self, act) -> None:
        self.act, self.pids, self.lines = act, [], []

    def on_status(self, text: str) -> None:
        self.lines.append(text)
        if found := AHEAD_PID.search(text):
            self.pids.append(int(found.group(1)))
            self.act(int(found.group(1)))


def _record(result) -> dict:
    return json.loads((result.output_dir / "run.json").read_text())


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def train_in_a_fresh_process(tempera_cache, tmp, name: str, *settings: str,
                             kill_ahead: bool = False) -> tuple[dict, str]:
    """A run of the compiled settings in a fresh process with its own home (what another
    machine is). The test process's own global state (what earlier tests in it left) is no part
    of a bundle's fingerprint, so bundles are made in fresh processes; CPU kernels are built for
    a thread count, which the child gets from this process. With ``kill_ahead``, its ahead
    process is killed once run.json names it. Its run.json and output."""
    import subprocess
    import sys
    import time

    import torch

    from tests.child_env import REPO, with_repo_on_pythonpath

    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={tmp / name}",
        "data.resolution=64", "training.batch_size=2", "training.learning_rate=1e-3",
        "sampling.prompts=[]", "logging.tensorboard=false", *COMPILED, *settings])
    save_config(config, tmp / f"{name}.json")
    env = with_repo_on_pythonpath()
    env["HOME"] = str(tmp / f"home-{name}")
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # CPU kernels are built for it
    process = subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), "--config",
                                str(tmp / f"{name}.json")], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    while kill_ahead and process.poll() is None:
        started = _run_json(tmp / name).get("compile_ahead") or {}
        if started.get("pid"):
            os.kill(started["pid"], 9)
            break
        time.sleep(0.1)
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-3000:]
    return _run_json(tmp / name), output


def _run_json(folder) -> dict:
    try:
        return json.loads((folder / "run.json").read_text())
    except (OSError, ValueError):  # not written yet
        return {}


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory):
    """Two runs of the compiled settings, each 2 steps in a fresh process: (ahead) compile
    ahead into an empty cache folder; (plain) no compile ahead, another empty cache folder (a
    cold step 1, which writes the bundle). The runs are built in three module fixtures, each
    paid by the first test that reads it, so no test's setup waits for all of them."""
    tmp = tmp_path_factory.mktemp("ahead")
    ahead, _ = train_in_a_fresh_process(tempera_cache, tmp, "ahead", "compile.ahead=true",
                                        f"compile.cache_dir={tmp / 'x'}")
    plain, _ = train_in_a_fresh_process(tempera_cache, tmp, "plain",
                                        f"compile.cache_dir={tmp / 'y'}")
    return {"tmp": tmp, "tempera_cache": tempera_cache, "ahead": ahead, "plain": plain}


@pytest.fixture(scope="module")
def bundle_runs(runs):
    """(elsewhere) a fresh process with a third empty cache folder and home, told to start
    from plain's bundle; (damaged) in this process, in plain's cache folder, told to start
    from a truncated bundle."""
    tmp, tempera_cache = runs["tmp"], runs["tempera_cache"]
    written = runs["plain"]["compile_bundle"]["written"]
    elsewhere, _ = train_in_a_fresh_process(tempera_cache, tmp, "elsewhere",
                                            f"compile.cache_dir={tmp / 'z'}",
                                            f"compile.bundle={written}")
    cut = tmp / "cut.tcb"
    cut.write_bytes((tmp / "y" / "bundles" / written.rsplit("/", 1)[1]).read_bytes()[:100])
    damaged = train(apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={tmp / 'damaged'}",
        "data.resolution=64", "training.batch_size=2", "training.learning_rate=1e-3",
        "sampling.prompts=[]", "logging.tensorboard=false", *COMPILED,
        f"compile.cache_dir={tmp / 'y'}", f"compile.bundle={cut}"]))
    return {**runs, "elsewhere": elsewhere, "damaged": damaged, "cut": cut}


@pytest.fixture(scope="module")
def failed_run(bundle_runs):
    """(failed) compile ahead in plain's folder without its bundle (after the bundle runs,
    which read it), a fresh process, the ahead process killed as it starts (its step 1 is
    served by the local cache, so this costs no compile)."""
    tmp = bundle_runs["tmp"]
    shutil.rmtree(tmp / "y" / "bundles")
    failed, said = train_in_a_fresh_process(bundle_runs["tempera_cache"], tmp, "failed",
                                            "compile.ahead=true",
                                            f"compile.cache_dir={tmp / 'y'}", kill_ahead=True)
    return {**bundle_runs, "failed": failed, "failed_output": said}


@pytest.mark.inductor
def test_the_bundle_compiled_ahead_is_loaded_and_step_1_compiles_nothing(runs):
    """Over 10 s (the module's runs): two cold inductor compiles of the text encoder, one in
    the ahead process and one in the plain run, which nothing cheaper can stand in for."""
    record = runs["ahead"]
    assert record["status"] == "finished"
    ahead = record["compile_ahead"]
    assert ahead["status"] == "done" and ahead["shapes"] == ["2x64x64"], ahead
    bundle = record["compile_bundle"]
    assert bundle["lookup"] == "hit" and bundle["from_ahead"], bundle
    assert bundle["found"] == ahead["bundle"] and bundle["loaded_entries"] > 0
    encoder = record["compile"]["text_encoder"]
    assert encoder["bundle"].startswith("hit (compiled ahead"), encoder
    # every graph of step 1 came from the bundle: none was compiled in the run
    assert encoder["cache_misses"] == 0 and encoder["cache_hits"] > 0, encoder
    assert encoder["compiled_code_ran"]
    assert record["losses"] == runs["plain"]["losses"] and len(record["losses"]) == 2


@pytest.mark.inductor
def test_a_bundle_warms_a_fresh_cache_folder_in_another_process_and_changes_no_number(
        bundle_runs):
    """Over 10 s (the module's runs): plain's cold inductor compile of the text encoder wrote
    a bundle, and another process with another cache folder and home must not compile it cold
    (it loads the bundle): what a new machine or a cloud run meets."""
    record = bundle_runs["plain"]
    written = record["compile_bundle"]["written"]
    assert record["compile_bundle"]["lookup"] == "miss" and written, record["compile_bundle"]
    assert record["compile"]["text_encoder"]["cache"] == "miss"
    assert record["compile"]["text_encoder"]["bundle"].startswith("miss")
    assert record["compile"]["unet"]["bundle"] == "off"  # not compiled

    second = bundle_runs["elsewhere"]
    assert second["compile_bundle"]["lookup"] == "hit", second["compile_bundle"]
    assert second["compile_bundle"]["found"] == written
    assert second["compile_bundle"]["loaded_entries"] > 0
    cold = record["compile"]["text_encoder"]["compile_seconds"]
    assert second["compile_bundle"]["cold_compile_seconds"] == pytest.approx(cold, abs=0.1)
    assert second["compile_bundle"]["seconds_saved"] == pytest.approx(
        cold - second["compile"]["text_encoder"]["compile_seconds"], abs=0.2)
    encoder = second["compile"]["text_encoder"]
    # every graph the first run compiled cold came from the bundle, none compiled again
    compiled_cold = record["compile"]["text_encoder"]["cache_misses"]
    assert compiled_cold > 0 and encoder["cache_hits"] == compiled_cold, encoder
    assert encoder["bundle"] == "hit" and encoder["cache"] == "hit", encoder
    assert encoder["compiled_code_ran"]
    assert second["losses"] == record["losses"]


@pytest.mark.inductor
def test_a_damaged_bundle_is_named_and_passed_over(bundle_runs):
    """A run in the first cache folder, told to start from a truncated bundle, finds the cache
    folder's own and names the damaged one."""
    damaged = bundle_runs["damaged"]
    bundle = _record(damaged)["compile_bundle"]
    assert damaged.status == "finished"
    written = bundle_runs["plain"]["compile_bundle"]["written"]
    assert bundle["lookup"] == "hit" and bundle["found"] == written
    assert len(bundle["skipped"]) == 1 and str(bundle_runs["cut"]) in bundle["skipped"][0]


@pytest.mark.inductor
def test_a_failed_ahead_process_is_reported_and_the_run_trains(failed_run):
    record = failed_run["failed"]
    assert record["status"] == "finished"
    assert record["compile_ahead"]["status"] == "failed"
    assert "signal 9" in record["compile_ahead"]["why"]
    assert re.search(r"compile ahead failed \(ended by signal 9.*compiling at step 1",
                     failed_run["failed_output"]), failed_run["failed_output"][-3000:]
    assert record["compile_bundle"]["from_ahead"] is False
    assert record["losses"] == failed_run["plain"]["losses"]


def test_stop_during_setup_ends_the_ahead_process(tiny_config, tmp_path):
    commands = TrainerCommands()
    seen = OnAhead(lambda pid: commands.request_stop())
    result = train(tiny_config(*COMPILED, "compile.ahead=true",
                               f"compile.cache_dir={tmp_path / 'cache'}"), seen, commands)
    assert result.status == "stopped"
    record = _record(result)
    assert record["status"] == "stopped"
    assert record["stopped_during"] in ("latent caching", "compile ahead"), record
    assert record["compile_ahead"]["status"] == "stopped"
    assert seen.pids and gone(seen.pids[0])


@pytest.mark.parametrize("settings, expected", [
    (["compile.backend=NONE"], "nothing is compiled"),
    (["compile.backend=AOT_EAGER"], "only inductor writes the cache artifacts"),
    (["compile.backend=INDUCTOR", "compile.denoiser=false"], "are all off"),
    (["compile.backend=INDUCTOR", "compile.bundles=false"], "turn compile.bundles on"),
    (["compile.backend=INDUCTOR", "general.device=CUDA"], "second copy of the weights"),
])
def test_refusals(settings, expected):
    config = apply_overrides(Config(), ["compile.ahead=true", *settings])
    problems = [p for p in ahead_problems(config) if p.path == "compile.ahead"]
    assert len(problems) == 1 and expected in str(problems[0]), problems
    config.compile.ahead = False
    assert not [p for p in ahead_problems(config) if p.path == "compile.ahead"]


def test_one_batch_of_each_shape_the_epoch_meets():
    """The ahead process's shapes are the run's batches': each bucket's full batch and its
    short last one (5 items of 64x96 in batches of 2 make 2x64x96 and 1x64x96)."""
    from types import SimpleNamespace

    from modules.data.dataset import BucketBatchSampler
    from modules.train.recipe.ahead_process import shape_batches

    sizes = [(64, 64)] * 4 + [(64, 96)] * 5
    batches = BucketBatchSampler(sizes, batch_size=2, seed=3)
    found = shape_batches(batches, SimpleNamespace(target_sizes=sizes))
    assert sorted(shape for shape, _ in found) == ["1x64x96", "2x64x64", "2x64x96"]
    for shape, keys in found:
        count, height, width = map(int, shape.split("x"))
        assert len(keys) == count and all(sizes[index] == (height, width)
                                           for _, index in keys)


def test_what_the_run_does_not_compile_ahead_for_is_said(tiny_config):
    """Where validation cannot know (AUTO on a GPU machine; a launch of several processes) the
    run says why it compiles at step 1 instead."""
    import torch

    from modules.train.recipe.compile_ahead import ahead_blocker

    config = tiny_config(*COMPILED, "compile.ahead=true")
    assert "second copy of the weights" in ahead_blocker(config, torch.device("cuda"), False)
    assert "multi-process" in ahead_blocker(config, torch.device("cpu"), True)


@pytest.mark.parametrize("code, said", [
    ("raise SystemExit('out of memory')", "exit 1: out of memory"),
    ("print('finished but wrote nothing')", "no readable result: finished but wrote nothing"),
])
def test_an_ahead_process_that_fails_or_says_nothing_is_a_reported_failure(tmp_path, code, said):
    import subprocess
    import sys

    from modules.train.recipe.compile_ahead import CompileAhead

    log = open(tmp_path / "ahead.log", "w", encoding="utf-8")  # end() closes it
    ahead = CompileAhead(subprocess.Popen([sys.executable, "-c", code], stdout=log,
                                          stderr=subprocess.STDOUT), tmp_path, log)
    outcome = ahead.wait(lambda: False)
    ahead.end()
    assert outcome.status == "failed" and outcome.why == said, outcome


def test_how_long_the_run_waited_for_the_ahead_process_is_recorded(tmp_path):
    """`waited_seconds`: the part of the ahead compile that caching did not hide (the warm-start
    measurement's (d) reads it). Waited on while it runs: about its remaining time; waited on
    after it ended: 0."""
    import subprocess
    import sys

    from modules.train.recipe.compile_ahead import CompileAhead

    write = ("import json, pathlib, sys, time; time.sleep(float(sys.argv[1])); "
             "pathlib.Path(sys.argv[2]).write_text(json.dumps({'shapes': ['2x64x64'], "
             "'bundle': 'b.tcb', 'compile_seconds': 1.0}))")
    outcomes = []
    for sleep, before_wait in ((1.5, 0.0), (0.0, 1.0)):
        work = tmp_path / f"work-{sleep}"
        work.mkdir()
        log = open(work / "ahead.log", "w", encoding="utf-8")  # end() closes it
        ahead = CompileAhead(subprocess.Popen(
            [sys.executable, "-c", write, str(sleep), str(work / "result.json")], stdout=log,
            stderr=subprocess.STDOUT), work, log)
        if before_wait:
            ahead.process.wait()  # the caching took longer than the ahead process
        outcomes.append(ahead.wait(lambda: False))
        ahead.end()
    still_running, done_first = outcomes
    assert still_running.status == "done" and still_running.bundle == "b.tcb"
    assert 1.0 <= still_running.waited_seconds <= still_running.seconds
    assert done_first.status == "done" and done_first.waited_seconds == 0.0


def test_an_ahead_process_that_will_share_the_cores_is_warned_about():
    """Measured on 2 cores, 2 threads each: the caching took 1.7-3.5 times as long beside
    the ahead process and step 1 came later than without it (docs/benchmarks.md)."""
    from modules.train.recipe.compile_ahead import shared_cores_warning

    said = shared_cores_warning(2, 2)
    assert said is not None and "share this machine's 2 cores" in said and "4 cores" in said
    assert shared_cores_warning(4, 6) is not None
    assert shared_cores_warning(2, 4) is None and shared_cores_warning(1, 2) is None
    assert shared_cores_warning(8, None) is None  # the count unknown: nothing said
