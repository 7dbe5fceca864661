"""The expected compile time tells a warm compile cache from a cold one, and knows how many
graphs the last run with the same settings compiled (issue 33 item 8 f): a 12 s warm-cache
compile was announced as 3:48."""
from __future__ import annotations

from modules.config import apply_overrides
from modules.config.schema import Config
from modules.train.state.history import (compile_expectation, compile_key, history_path,
                                         record_compile_time)


def config_in(tmp_path, *more: str) -> Config:
    return apply_overrides(Config(), [f"compile.cache_dir={tmp_path / 'compile'}",
                                      "compile.backend=INDUCTOR", *more])


def report(seconds: float, cache: str, compiles: int) -> dict:
    return {"unet": {"compile_seconds": seconds, "cache": cache, "compiles": compiles}}


def test_a_cold_compile_is_expected_cold_until_the_cache_holds_its_graphs(tmp_path):
    config = config_in(tmp_path)
    assert compile_expectation(config, "cpu") is None
    record_compile_time(config, "cpu", report(228.0, "miss", 12))
    # the history file alone is no cache: a run that wrote nothing else is expected cold
    assert history_path(config).parent == tmp_path / "compile"
    cold = compile_expectation(config, "cpu")
    assert (cold.seconds, cold.warm, cold.graphs) == (228.0, False, {"unet": 12})
    (tmp_path / "compile" / "fxgraph").mkdir()        # what the cold run left in the cache
    warm = compile_expectation(config, "cpu")
    assert warm.warm and warm.seconds is None and warm.cold_seconds == 228.0
    record_compile_time(config, "cpu", report(12.0, "hit", 12))
    warm = compile_expectation(config, "cpu")
    assert (warm.seconds, warm.warm, warm.cold_seconds) == (12.0, True, 228.0)


def test_without_the_cache_every_run_is_expected_as_long_as_the_last(tmp_path):
    config = config_in(tmp_path)
    (tmp_path / "compile" / "fxgraph").mkdir(parents=True)
    record_compile_time(config, "cpu", report(40.0, "off", 5))
    expected = compile_expectation(config, "cpu")
    assert (expected.seconds, expected.warm, expected.graphs) == (40.0, False, {"unet": 5})
    other = config_in(tmp_path, "data.resolution=1024")   # other shapes: other compile work
    assert compile_expectation(other, "cpu") is None


def test_several_resolutions_have_their_own_entry_and_one_listed_keeps_the_old_one():
    def key(*overrides: str) -> str:
        return compile_key(apply_overrides(Config(), ["data.resolution=64", *overrides]), "cpu")

    assert key("data.resolutions=64") == key()  # the same compile work as before the list
    assert key("data.resolutions=64,128") != key()
    assert key('data.datasets=[{"path": "a", "resolutions": [128]}]') != key()
