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


def test_a_compile_bundle_for_the_settings_makes_a_new_machine_expect_a_warm_compile(tmp_path):
    """A machine these settings never ran on, with the bundle another made (issue 55): the
    compile is expected warm against the bundle's cold time, and the busy line says why."""
    from app.run_panel import compile_hint
    from modules import frontend
    from modules.compile import detect_capabilities
    from modules.compile.bundle import bundle_cold_seconds, find_bundle
    from modules.train.recipe.compile_guard import (bundle_folder, bundle_places,
                                                    compile_facts, compile_fingerprint)
    from tests.compile.bundle_files import fake_bundle

    import torch

    config = config_in(tmp_path, "compile.denoiser=true")
    assert frontend.expected_compile(config) is None   # nothing here yet
    fingerprint = compile_fingerprint(config, compile_facts(config, detect_capabilities("cpu")),
                                      torch.device("cpu"))
    path = fake_bundle(bundle_folder(config), fingerprint, cold_seconds=228.0)
    lookup = find_bundle(fingerprint, bundle_places(config))
    assert lookup.status == "hit" and bundle_cold_seconds(lookup) == 228.0
    expected = frontend.expected_compile(config)
    assert (expected.warm, expected.bundle, expected.cold_seconds) == (True, True, 228.0)
    assert "compile bundle loaded: well under the 3:48 of a cold compile" in \
        compile_hint(expected)
    # the history of a cold run here does not make it cold: the bundle is loaded first
    record_compile_time(config, "cpu", report(200.0, "miss", 12))
    expected = compile_expectation(config, "cpu", bundle_cold_seconds(lookup))
    assert expected.warm and expected.cold_seconds == 200.0
    path.unlink()
    assert not compile_expectation(config, "cpu", bundle_cold_seconds(
        find_bundle(fingerprint, bundle_places(config)))).warm
