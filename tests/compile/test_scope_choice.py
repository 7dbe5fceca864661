"""compile.scope=AUTO: the decision from injected measurements (no compile runs here), where it
is stored and reused, what happens when it cannot measure, and a bad decisions file reported
and set aside, never fatal."""
from __future__ import annotations

import dataclasses
import json
import time
import zipfile

import pytest

from modules.compile.scope_choice import (DECISIONS_FILE, ScopeMeasurement, choose,
                                          read_decisions, resolve_auto)
from modules.config import Config, apply_overrides, from_dict, to_dict
from modules.config.schema import CompileScope
from modules.train.recipe.compile_scope import (bundle_folder, decisions_path, planned_config,
                                                resolve_compile_scope)
from tests.compile.bundle_files import PRINT, fake_bundle

KEY = "cpu | SD15 | DEFAULT | batch 2 at 64 px"


def m(step_ms: float, first_s: float = 1.0) -> ScopeMeasurement:
    return ScopeMeasurement(step_ms / 1000, first_s)


class Measure:
    def __init__(self, numbers):
        self.numbers, self.calls = numbers, []

    def __call__(self, allowed, keep=None):
        self.calls.append(allowed)
        if isinstance(self.numbers, Exception):
            raise self.numbers
        return {name: self.numbers.get(name) for name in allowed}


def test_the_fastest_steady_step_wins_and_a_missing_one_falls_back():
    assert choose({"NONE": m(50), "REGIONAL": m(40, 70), "FULL": m(36, 90)})[0] == "FULL"
    assert choose({"NONE": m(30), "REGIONAL": m(40), "FULL": m(36)})[0] == "NONE"
    scope, why = choose({"NONE": m(30), "REGIONAL": m(40), "FULL": None})
    assert scope == "REGIONAL" and "FULL could not be measured" in why


def test_a_measured_decision_is_stored_and_reused_without_measuring(tmp_path):
    store = tmp_path / DECISIONS_FILE
    measure = Measure({"NONE": m(50), "REGIONAL": m(45, 70), "FULL": m(38, 90)})
    first = resolve_auto(KEY, store, measure)
    assert (first.chosen, first.source) == ("FULL", "measured")
    assert first.measurements["FULL"] == {"step_seconds": 0.038, "first_step_seconds": 90}
    assert "FULL 38.0 ms (cold first step 90.0 s)" in first.why and not first.problems
    assert "NONE 50.0 ms," in first.why  # eager compiles nothing: no cold cost to show
    again = resolve_auto(KEY, store, measure)
    assert (again.chosen, again.source) == ("FULL", "stored") and len(measure.calls) == 1
    other = resolve_auto("cuda | SD15 | DEFAULT | batch 2 at 64 px", store,
                         Measure({"NONE": m(50), "REGIONAL": m(30), "FULL": m(38)}))
    assert other.chosen == "REGIONAL"  # another setting is measured on its own
    assert set(read_decisions(store)[0]) == {KEY, other.key}


def test_no_measurement_falls_back_to_regional_and_says_why_and_stores_nothing(tmp_path):
    store = tmp_path / DECISIONS_FILE
    failed = resolve_auto(KEY, store, Measure(RuntimeError("cell died")))
    assert (failed.chosen, failed.source) == ("REGIONAL", "fallback")
    assert "cell died" in failed.why
    partial = resolve_auto(KEY, store, Measure({"NONE": m(10), "REGIONAL": m(20)}))
    assert partial.source == "fallback" and "FULL could not be measured" in partial.why
    told = resolve_auto(KEY, store, Measure({}), cannot_measure="a multi-process run")
    assert (told.chosen, told.why) == ("REGIONAL", "a multi-process run")
    assert not store.exists()


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "decisions": '
                                     '{"k": {"chosen": "SIDEWAYS"}}}', '[1, 2]'])
def test_a_bad_decisions_file_is_reported_set_aside_and_replaced(tmp_path, content):
    store = tmp_path / DECISIONS_FILE
    store.write_text(content)
    choice = resolve_auto(KEY, store, Measure({"NONE": m(50), "REGIONAL": m(40),
                                               "FULL": m(45)}))
    assert choice.chosen == "REGIONAL" and choice.source == "measured"
    assert len(choice.problems) == 1 and str(store) in choice.problems[0]
    assert (tmp_path / (DECISIONS_FILE + ".unreadable")).read_text() == content
    assert read_decisions(store) == ({KEY: read_decisions(store)[0][KEY]}, None)


def test_auto_round_trips_through_the_config_and_the_cli_override():
    config = apply_overrides(Config(), ["compile.scope=AUTO"])
    assert config.compile.scope == CompileScope.AUTO
    assert from_dict(json.loads(json.dumps(to_dict(config)))).compile.scope == CompileScope.AUTO


def _auto(tmp_path, *overrides):
    return apply_overrides(Config(), [f"compile.cache_dir={tmp_path / 'cache'}",
                                      "compile.scope=AUTO", "compile.backend=DEFAULT",
                                      "data.resolution=64", "training.batch_size=2",
                                      *overrides])


def test_a_run_resolves_auto_to_the_measured_scope_and_front_ends_plan_with_it(tmp_path):
    config = _auto(tmp_path)
    assert planned_config(config, "cpu").compile.scope == CompileScope.REGIONAL  # undecided
    measure = Measure({"NONE": m(50), "REGIONAL": m(45), "FULL": m(38)})
    resolved, choice = resolve_compile_scope(config, "cpu", measure=measure)
    assert resolved.compile.scope == CompileScope.FULL and choice is not None
    assert choice.record()["requested"] == "AUTO" and choice.record()["chosen"] == "FULL"
    assert decisions_path(config).is_file()
    assert decisions_path(config).parent.name == "bundles"
    assert planned_config(config, "cpu").compile.scope == CompileScope.FULL
    # eager fastest: the denoiser is not compiled, and the record says so
    eager, choice = resolve_compile_scope(_auto(tmp_path, "training.batch_size=4"), "cpu",
                                          measure=Measure({"NONE": m(10), "REGIONAL": m(45),
                                                           "FULL": m(38)}))
    assert not eager.compile.denoiser and choice is not None
    assert "eager" in choice.describe()
    unchanged, none = resolve_compile_scope(_auto(tmp_path, "compile.scope=FULL"), "cpu")
    assert unchanged.compile.scope == CompileScope.FULL and none is None


def test_block_offload_leaves_full_out_and_multi_process_runs_do_not_measure(tmp_path):
    measure = Measure({"NONE": m(50), "REGIONAL": m(45), "FULL": m(10)})
    resolved, choice = resolve_compile_scope(_auto(tmp_path, "model.offload_blocks=2"), "cpu",
                                             measure=measure)
    assert measure.calls == [("NONE", "REGIONAL")] and choice is not None
    assert resolved.compile.scope == CompileScope.REGIONAL
    resolved, choice = resolve_compile_scope(_auto(tmp_path, "training.batch_size=8"), "cpu",
                                             multi_process=True, measure=measure)
    assert choice is not None and choice.source == "fallback"
    assert "multi-process" in choice.why and len(measure.calls) == 1


class MeasureWithBundles(Measure):
    """Measures as `Measure` and leaves each compiled candidate's compile bundle in the folder
    the run gives, as the benchmark's cells do (`modules.bench.scope_measure`)."""
    def __init__(self, numbers, bundles):
        super().__init__(numbers)
        self.bundles, self.keeps = bundles, []

    def __call__(self, allowed, keep=None):
        self.keeps.append(keep)
        for name, fingerprint in self.bundles.items():
            fake_bundle(keep / name, fingerprint, artifacts=name.encode())
        return super().__call__(allowed, keep)


def _print(scope):
    return dataclasses.replace(PRINT, components=(f"unet: INDUCTOR {scope} abc",))


def test_the_winning_cells_bundle_is_kept_for_the_run_and_the_losers_is_not(tmp_path):
    config = _auto(tmp_path)
    folder = bundle_folder(config)
    measure = MeasureWithBundles({"NONE": m(50), "REGIONAL": m(45), "FULL": m(38)},
                                 {"REGIONAL": _print("REGIONAL"), "FULL": _print("FULL")})
    resolved, choice = resolve_compile_scope(config, "cpu", measure=measure)
    assert choice is not None and choice.chosen == "FULL" and not choice.problems
    assert [p.name for p in folder.glob("*.tcb")] == [_print("FULL").file_name()]
    assert "FULL cell's compile bundle" in choice.why and str(folder) in choice.why
    assert not measure.keeps[0].exists()  # the measurement's folder is gone
    assert [p.name for p in folder.iterdir()] == sorted(
        [_print("FULL").file_name(), DECISIONS_FILE])
    # the stored decision is the measurement's: a later run reads no claim about this one's bundle
    assert "bundle" not in read_decisions(decisions_path(config))[0][choice.key]["why"]


def test_a_bundle_already_there_is_kept_and_a_damaged_one_is_named(tmp_path):
    config = _auto(tmp_path)
    folder = bundle_folder(config)
    earlier = fake_bundle(folder, _print("FULL"), artifacts=b"more shapes")
    _, choice = resolve_compile_scope(config, "cpu", measure=MeasureWithBundles(
        {"NONE": m(50), "REGIONAL": m(45), "FULL": m(38)}, {"FULL": _print("FULL")}))
    assert choice is not None and not choice.problems
    assert zipfile.ZipFile(earlier).read("artifacts.bin") == b"more shapes"

    class Damaged(Measure):
        def __call__(self, allowed, keep=None):
            (keep / "REGIONAL").mkdir(parents=True)
            (keep / "REGIONAL" / "cut.tcb").write_bytes(b"PK\x03\x04 cut short")
            return super().__call__(allowed, keep)

    resolved, choice = resolve_compile_scope(
        _auto(tmp_path, "training.batch_size=4"), "cpu",
        measure=Damaged({"NONE": m(50), "REGIONAL": m(30), "FULL": m(38)}))
    assert choice is not None and choice.chosen == "REGIONAL" and choice.source == "measured"
    assert len(choice.problems) == 1 and "cut.tcb" in choice.problems[0]
    assert "bundle" not in choice.why
    assert resolved.compile.scope == CompileScope.REGIONAL  # the run goes on, compiling


def test_bundles_off_keeps_nothing_and_a_stored_decision_makes_no_folder(tmp_path):
    config = _auto(tmp_path, "compile.bundles=false")
    measure = MeasureWithBundles({"NONE": m(50), "REGIONAL": m(45), "FULL": m(38)},
                                 {"FULL": _print("FULL")})
    _, choice = resolve_compile_scope(config, "cpu", measure=measure)
    assert choice is not None and choice.chosen == "FULL" and "bundle" not in choice.why
    assert not list(bundle_folder(config).glob("*.tcb"))
    again = MeasureWithBundles({}, {})
    _, stored = resolve_compile_scope(config, "cpu", measure=again)
    assert stored is not None and stored.source == "stored" and again.keeps == []
    assert sorted(p.name for p in bundle_folder(config).iterdir()) == [DECISIONS_FILE]


def test_a_cells_config_compiles_for_the_bundle_the_decided_run_looks_for(tmp_path):
    """The winner's bundle is only worth keeping if the run would load it: a benchmark cell
    of the run's config under the chosen scope has the run's own compile fingerprint."""
    from modules.bench.matrix import Cell, cell_config
    from modules.compile.capabilities import detect_capabilities
    from modules.train.recipe.compile_guard import compile_facts, compile_fingerprint
    from modules.train.recipe.compile_scope import with_scope

    config = _auto(tmp_path, "compile.backend=INDUCTOR", "data.resolution=64")
    caps = detect_capabilities("cpu")
    for scope in ("REGIONAL", "FULL"):
        cell = cell_config(with_scope(config, "REGIONAL"),
                           Cell("INDUCTOR", "unet", scope, config.compile.dynamic.value),
                           max_steps=4, output_dir=tmp_path / "cell",
                           compile_cache_dir=tmp_path / "cell-cache")
        run = with_scope(config, scope)
        assert (compile_fingerprint(cell, compile_facts(cell, caps), "cpu")
                == compile_fingerprint(run, compile_facts(run, caps), "cpu"))


def test_the_measurement_keeps_each_measured_candidates_bundles_by_name(tmp_path, monkeypatch):
    """modules.bench.scope_measure: the bundles the benchmark kept per cell end up under the
    candidate's name; a cell that fell back to another backend is not a candidate, and its
    bundle is deleted with the rest."""
    from modules.bench import runner, scope_measure
    from modules.bench.runner import BenchmarkResult, keep_cell_bundles

    def cell(backend, scope, folder, ok=True):
        kept = keep_cell_bundles(fake_bundle(tmp_path / folder / "bundles", _print(scope)
                                             ).parent.parent, tmp_path / "keep" / "cells" / folder)
        return {"backend": backend, "scope": scope, "status": "ok",
                "median_step_seconds": 0.1, "first_step_seconds": 9.0,
                "bundles": [str(p) for p in kept], "compiled_code_ran": ok, "effective": {
                    "unet": backend if ok else "AOT_EAGER"}}

    def run_benchmark(config, **kwargs):
        assert kwargs["keep_bundles"] == tmp_path / "keep" / "cells"
        return BenchmarkResult({}, {}, [
            {"backend": "NONE", "scope": "-", "status": "ok", "median_step_seconds": 0.2,
             "first_step_seconds": 0.3},
            cell("INDUCTOR", "REGIONAL", "c1"), cell("INDUCTOR", "FULL", "c2", ok=False)])

    monkeypatch.setattr(runner, "run_benchmark", run_benchmark)
    config = _auto(tmp_path, "compile.backend=INDUCTOR")
    measured = scope_measure.measure_scopes(config, ["NONE", "REGIONAL", "FULL"],
                                            tmp_path / "keep")
    assert measured["FULL"] is None and measured["REGIONAL"] == {
        "step_seconds": 0.1, "first_step_seconds": 9.0}
    assert sorted(p.relative_to(tmp_path / "keep").as_posix()
                  for p in (tmp_path / "keep").rglob("*.tcb")) == [
        f"REGIONAL/{_print('REGIONAL').file_name()}"]


def test_the_measurement_is_announced_and_stop_ends_it_and_its_processes(tmp_path):
    """It takes minutes: the run says so before it starts, and Stop during it ends the
    measurement's process group at once (the run stops; nothing is decided or stored)."""
    from modules.events import StopRequested

    config = _auto(tmp_path)
    said: list[str] = []
    polls: list[float] = []

    def stop() -> bool:
        polls.append(time.monotonic())
        return len(polls) > 2  # once the process is running

    started = time.monotonic()
    with pytest.raises(StopRequested, match="measuring"):
        resolve_compile_scope(config, "cpu", notify=said.append, should_stop=stop)
    assert time.monotonic() - started < 30
    assert len(said) == 1 and "measuring eager, REGIONAL, FULL" in said[0]
    assert "minutes" in said[0]
    assert not decisions_path(config).exists()
    assert list(bundle_folder(config).iterdir()) == []  # the measurement's folder is gone
