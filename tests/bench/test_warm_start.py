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
    assert row["targets"] == {"cache_over_cold": 0.09, "cache_target_met": True,
                              "bundle_over_cache": 1.111, "bundle_target_met": True,
                              "ahead_over_cache": 1.056, "ahead_target_met": True}


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
    assert "(c) bundle only, elsewhere" in table and "(d) compile ahead" in table
    assert "(c)/(b) = 1.33× (target within 15%: missed)" in table
    assert "(d)/(b) = 1.00× (target within 15%: met)" in table
    assert "identical in cold, cache, bundle, ahead" in table
    assert result.rows[0]["scope"] == "FULL"
