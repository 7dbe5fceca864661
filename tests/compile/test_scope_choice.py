"""compile.scope=AUTO: the decision from injected measurements (no compile runs here), where it
is stored and reused, what happens when it cannot measure, and a bad decisions file reported
and set aside, never fatal."""
from __future__ import annotations

import json

import pytest

from modules.compile.scope_choice import (DECISIONS_FILE, ScopeMeasurement, choose,
                                          read_decisions, resolve_auto)
from modules.config import Config, apply_overrides, from_dict, to_dict
from modules.config.schema import CompileScope
from modules.train.recipe.compile_scope import (decisions_path, planned_config,
                                                resolve_compile_scope)

KEY = "cpu | SD15 | DEFAULT | batch 2 at 64 px"


def m(step_ms: float, first_s: float = 1.0) -> ScopeMeasurement:
    return ScopeMeasurement(step_ms / 1000, first_s)


class Measure:
    def __init__(self, numbers):
        self.numbers, self.calls = numbers, []

    def __call__(self, allowed):
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
