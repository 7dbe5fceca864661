"""The warm-start measurement's logic (modules/bench/warm_start.py) with a made-up launcher in
place of the cell processes: what each phase is given (cache folders, the carried bundle,
another home, tmp and checkout) and what the rows, the loss check and the targets say. The
real processes run in `scripts/measure_warm_start.py` (docs/benchmarks.md)."""
from __future__ import annotations

import json
from pathlib import Path

from modules.bench.warm_start import measure_setting, measure_warm_start, setting_config
from modules.bench.matrix import Cell
from modules.config import Config

LOSSES = [0.5, 0.25, 0.125]


class FakeLaunch:
    """Records each phase's config, env and cwd; (a) writes a bundle file as a run would."""

    def __init__(self, seconds: dict[str, float], losses: dict[str, list[float]] | None = None,
                 write_bundle: bool = True):
        self.seconds, self.losses, self.write_bundle = seconds, losses or {}, write_bundle
        self.calls: dict[str, tuple[Config, dict[str, str], Path | None]] = {}

    def __call__(self, config, folder, phase, env, cwd):
        self.calls[phase] = (config, env, cwd)
        written = None
        if phase == "cold" and self.write_bundle:
            bundles = Path(config.compile.cache_dir) / "bundles"
            bundles.mkdir(parents=True)
            written = bundles / "sd15-0123.tcb"
            written.write_bytes(b"bundle")
        return {"status": "ok", "first_step_seconds": self.seconds[phase] - 5,
                "first_step_end_after_launch_seconds": self.seconds[phase],
                "median_step_seconds": 0.04, "compile_seconds": 1.0, "recompiles": 0,
                "cache": "miss" if phase == "cold" else "hit", "bundle": "off",
                "record": {"losses": self.losses.get(phase, LOSSES),
                           "compile": {"unet": {"bundle": "hit", "cache_hits": 3,
                                                "cache_misses": 0}},
                           "compile_bundle": {"lookup": "miss", "loaded_entries": 0,
                                              "written": str(written) if written else None}}}


def _setting(tmp_path, launch, checkout=None):
    if checkout is None:
        checkout = tmp_path / "repo"
        (checkout / "modules").mkdir(parents=True)
        (checkout / "modules" / "engine.py").write_text("x = 1\n")
    config = setting_config(Config(), "builtin:tiny-sd15")
    return measure_setting(config, Cell("DEFAULT", "unet", "REGIONAL", "STATIC"),
                           tmp_path / "setting", launch, steps=3, warmup=1, checkout=checkout,
                           progress=lambda message: None)


def test_each_phase_starts_where_it_should(tmp_path):
    launch = FakeLaunch({"eager": 10, "cold": 100, "cache": 9, "bundle": 10, "ahead": 9.5})
    row = _setting(tmp_path, launch)
    eager, cold, cache, bundle, ahead = (launch.calls[p] for p in ("eager", "cold", "cache",
                                                                    "bundle", "ahead"))
    assert eager[0].compile.backend.value == "NONE"
    assert cold[0].compile.backend.value == "DEFAULT" and cold[0].compile.scope.value == "REGIONAL"
    # (b) reads (a)'s cache folder with bundles off; (c) an empty one of its own and the copy
    assert cache[0].compile.cache_dir == cold[0].compile.cache_dir
    assert cold[0].compile.bundles and not cache[0].compile.bundles
    assert bundle[0].compile.cache_dir != cold[0].compile.cache_dir
    assert not any(Path(bundle[0].compile.cache_dir).glob("*"))
    carried = Path(bundle[0].compile.bundle)
    assert carried.read_bytes() == b"bundle" and "carried" in carried.parts
    assert cold[1] == {} and cold[2] is None
    env, cwd = bundle[1], bundle[2]
    assert set(env) == {"HOME", "TMPDIR"} and all(Path(v).is_dir() for v in env.values())
    assert cwd is not None and (cwd / "modules" / "engine.py").read_text() == "x = 1\n"
    assert cwd != tmp_path / "repo"
    assert [p["phase"] for p in row["phases"]] == ["eager", "cold", "cache", "bundle", "ahead"]
    # (d) compiles ahead into an empty cache folder of its own, nothing carried to it
    assert ahead[0].compile.ahead and not cold[0].compile.ahead
    assert ahead[0].compile.cache_dir not in (cold[0].compile.cache_dir,
                                              bundle[0].compile.cache_dir)
    assert not ahead[0].compile.bundle and ahead[1] == {} and ahead[2] is None
    assert row["phases"][-1]["status"] == "ok"
    assert row["losses"] == {"identical": True, "steps_compared": 3,
                             "phases": ["cold", "cache", "bundle", "ahead"], "differ": []}
    # without an uncached dataset (d₀) is shown against (b), (d)'s target is not measured
    assert row["targets"] == {"cache_over_cold": 0.09, "cache_target_met": True,
                              "bundle_over_cache": 1.111, "bundle_target_met": True,
                              "ahead_cached_over_cache": 1.056, "ahead_over_cache": None,
                              "ahead_target_met": None}
    assert row["losses_uncached"]["identical"] is None


def test_differing_losses_missed_targets_and_no_bundle_are_said(tmp_path):
    launch = FakeLaunch({"eager": 10, "cold": 100, "cache": 20, "bundle": 30, "ahead": 30},
                        losses={"cache": [0.5, 0.25, 0.126]}, write_bundle=False)
    row = _setting(tmp_path, launch)
    assert "bundle" not in launch.calls
    bundle = row["phases"][3]
    assert bundle["status"] == "skipped" and "no bundle" in bundle["error"]
    assert row["losses"]["identical"] is False and row["losses"]["differ"] == ["cache"]
    assert row["targets"]["cache_target_met"] is False
    assert row["targets"]["bundle_target_met"] is None


def test_the_script_writes_json_and_a_table_per_setting(tmp_path):
    launch = FakeLaunch({"eager": 10, "cold": 100, "cache": 9, "bundle": 12, "ahead": 9})
    result = measure_warm_start(tmp_path / "out", models=["builtin:tiny-sd15"],
                                scopes=["FULL"], launch=launch, progress=lambda m: None)
    saved = json.loads((tmp_path / "out" / "warm_start.json").read_text())
    assert saved["settings"]["backend"] == "DEFAULT" and len(saved["rows"]) == 1
    table = (tmp_path / "out" / "warm_start.md").read_text()
    assert "(c) bundle only, elsewhere" in table and "(d₀) compile ahead, data cached" in table
    assert "(c)/(b) = 1.33× (target within 15%: missed)" in table
    assert "(d)/(b′) = — (target within 15%: not measured)" in table
    assert "(d₀)/(b) = 1.00× (nothing to hide behind)" in table
    assert "identical in cold, cache, bundle, ahead" in table
    assert result.rows[0]["scope"] == "FULL"


def test_with_uncached_images_b_prime_and_d_start_on_them_each_caching_its_own(tmp_path):
    """(b′) and (d): the generated dataset (whole batches), a general cache folder each with
    only the built model in it, (b′) on (a)'s compile cache with bundles off, (d) compiling
    ahead into an empty one; (d) is held against (b′) and the two runs' losses against each
    other (another dataset than the other phases')."""
    from modules.models.tiny import builtin_model_dir

    general = tmp_path / "general"
    model = builtin_model_dir("builtin:tiny-sd15", general)
    model.mkdir(parents=True)
    (model / "model_index.json").write_text("{}")
    other = [0.7, 0.6, 0.5]
    launch = FakeLaunch({"eager": 10, "cold": 100, "cache": 9, "bundle": 10, "ahead": 60,
                         "cache-data": 200, "ahead-data": 220},
                        losses={"cache-data": other, "ahead-data": other})
    result = measure_warm_start(tmp_path / "out", models=["builtin:tiny-sd15"],
                                scopes=["REGIONAL"], cache_dir=str(general), images=5,
                                launch=launch, progress=lambda m: None)
    assert result.settings["uncached_images"] == 6  # rounded up to whole batches of 2
    cold, data_cache, data_ahead = (launch.calls[p][0] for p in ("cold", "cache-data",
                                                                  "ahead-data"))
    dataset = Path(data_cache.data.datasets[0].path)
    assert dataset.is_dir() and len(list(dataset.glob("*.png"))) == 6
    assert data_ahead.data.datasets[0].path == str(dataset)
    assert data_cache.data.datasets[0].repeats == 1
    assert all(c.data.cache_latents and c.data.cache_text_encoder_outputs
               for c in (data_cache, data_ahead))
    assert not cold.data.cache_latents  # the other phases as before
    assert data_cache.compile.cache_dir == cold.compile.cache_dir
    assert not data_cache.compile.bundles and not data_cache.compile.ahead
    assert data_ahead.compile.ahead and data_ahead.compile.cache_dir not in (
        cold.compile.cache_dir, launch.calls["ahead"][0].compile.cache_dir)
    caches = {Path(c.general.cache_dir) for c in (data_cache, data_ahead)}
    assert len(caches) == 2 and general not in caches
    for cache in caches:  # the model and nothing else: each caches its own latents
        assert [p.name for p in cache.iterdir()] == ["models"]
        assert (builtin_model_dir("builtin:tiny-sd15", cache) / "model_index.json").is_file()
    row = result.rows[0]
    assert row["targets"]["ahead_over_cache"] == 1.1 and row["targets"]["ahead_target_met"]
    assert row["losses"]["phases"] == ["cold", "cache", "bundle", "ahead"]
    assert row["losses_uncached"] == {"identical": True, "steps_compared": 3,
                                      "phases": ["cache-data", "ahead-data"], "differ": []}
    table = (tmp_path / "out" / "warm_start.md").read_text()
    assert "(b′) local cache, uncached data" in table and "(d)/(b′) = 1.10× (target" in table
    assert "on the uncached data over 3 steps identical in cache-data, ahead-data" in table
