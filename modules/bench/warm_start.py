"""How warm a fresh process starts, side by side in one run (issue 55, item 7).

For each setting (a tiny model and a compile scope), first an eager process (no compile: it
builds the model and caches the latents, so no later process pays for that, and it is the
start the compiled ones are measured against), then four ways of reaching the end of the first
compiled step, each in a fresh process (`modules.bench.cell`):

- **(a) cold**: an empty compile cache folder. Its process writes a compile bundle.
- **(b) cache**: the cache folder (a) filled; bundles off, so only the local cache serves.
- **(c) bundle**: only the bundle (a) wrote, copied to another place, with an empty cache folder
  of its own, another HOME and TMPDIR, and the process started from a copy of the checkout's
  ``modules/`` at another path: what another machine with the same software meets.
- **(d₀) ahead, data cached**: ``compile.ahead`` with an empty cache folder of its own: the
  run's shapes compiled in a second process while the data is cached, and the bundle it writes
  loaded before step 1. The eager process cached the latents already, so nothing overlaps:
  this is what compile ahead costs when it has nothing to hide behind.

With ``images`` (a dataset of that many generated images, cached by no one yet), two more:

- **(b′) local cache, uncached data**: (b) on that dataset, with a latent cache of its own:
  launch, caching, then a warm first step.
- **(d) ahead, uncached data**: (d₀) on that dataset, with a latent cache of its own: the
  compile hides behind the caching, which is what compile ahead is for. The target compares
  (d) with (b′); run.json's ``compile_ahead.waited_seconds`` says how much of the compile the
  caching did not hide.

Each row reports the trainer's first step, the time from launching the process to the end of
its first step (imports, model load, bundle load, compile), the steady step time, recompiles,
the cache and bundle status, and the losses step for step, which must be identical in (a)-(c).
`measure_warm_start` is the one entry point (`scripts/measure_warm_start.py`).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.bench.cell import step_cap
from modules.bench.matrix import Cell, cell_config, model_config, set_precision
from modules.config import Config
from modules.config.schema import DatasetConfig, TrainingMethod
from modules.model_types import MODEL_TYPES
from modules.models.tiny import BUILTIN_MODELS

PHASES = ("eager", "cold", "cache", "bundle", "ahead", "cache-data", "ahead-data")
PHASE_LABELS = {"eager": "eager (no compile)", "cold": "(a) empty cache",
                "cache": "(b) local cache", "bundle": "(c) bundle only, elsewhere",
                "ahead": "(d₀) compile ahead, data cached",
                "cache-data": "(b′) local cache, uncached data",
                "ahead-data": "(d) compile ahead, uncached data"}
DATA_PHASES = ("cache-data", "ahead-data")  # another dataset: compared with each other only
MODELS = ("builtin:tiny-sd15", "builtin:tiny-zimage")
SCOPES = ("REGIONAL", "FULL")
# The targets issue 55 sets for these numbers (first step: launch to the end of step 1).
BUNDLE_WITHIN = 0.15   # (c) within 15 % of (b)
CACHE_AT_MOST = 0.10   # (b) at most 10 % of (a)
# The files a cell process needs from the checkout: the engine; scripts/ and app/ are not run.
CHECKOUT_PARTS = ("modules",)

# One cell process: (config, folder, phase, env, cwd) -> its result with "record" (run.json).
Launch = Callable[[Config, Path, str, dict[str, str], Path | None], dict[str, Any]]


@dataclass
class WarmStartResult:
    machine: dict[str, Any]
    settings: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "settings": self.settings, "rows": self.rows}

    def markdown(self) -> str:
        return markdown_table(self)

    def write(self, out_dir: Path) -> dict[str, Path]:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"json": out_dir / "warm_start.json", "md": out_dir / "warm_start.md"}
        paths["json"].write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        paths["md"].write_text(self.markdown() + "\n", encoding="utf-8")
        return paths


def setting_config(base: Config, model: str, *, resolution: int = 64, batch: int = 2) -> Config:
    """A short fp32 LoRA run of built-in model ``model`` on the shapes dataset."""
    config = model_config(base, model_path=model, model_type=BUILTIN_MODELS[model],
                          resolution=resolution, batch=batch, method=TrainingMethod.LORA,
                          precision=None)
    set_precision(config, "fp32")
    return config


def phase_configs(base: Config, cell: Cell, folder: Path, max_steps: int,
                  bundle: Path | None, dataset: Path | None = None) -> dict[str, Config]:
    """Each phase's config: (a) and (b) share ``folder/cache-a``; (c) has ``folder/cache-c``
    and names the carried ``bundle`` (None: (a) wrote none); (d₀) compiles ahead into
    ``folder/cache-d``. With ``dataset``, (b′) and (d) train on it, each with a general cache
    folder of its own (``folder/general-<phase>``, so each caches its latents itself); (b′)
    reads ``cache-a``, (d) compiles ahead into ``folder/cache-d-data``."""
    def one(phase: str, cache: str) -> Config:
        return cell_config(base, cell, max_steps=max_steps, output_dir=folder / f"run-{phase}",
                           compile_cache_dir=folder / cache)

    cold, cache, carried = one("cold", "cache-a"), one("cache", "cache-a"), one("bundle",
                                                                                 "cache-c")
    cache.compile.bundles = False  # (b) measures the local cache alone
    ahead = one("ahead", "cache-d")
    ahead.compile.ahead = True
    carried.compile.bundle = str(bundle) if bundle else ""
    eager = cell_config(base, Cell("NONE", cell.components, cell.scope, cell.dynamic),
                        max_steps=max_steps, output_dir=folder / "run-eager",
                        compile_cache_dir=folder / "cache-eager")
    configs = {"eager": eager, "cold": cold, "cache": cache, "bundle": carried, "ahead": ahead}
    if dataset is not None:
        for phase, compile_cache in zip(DATA_PHASES, ("cache-a", "cache-d-data")):
            config = one(phase, compile_cache)
            config.data.datasets = [DatasetConfig(path=str(dataset), repeats=1)]
            # what a user with a large dataset turns on, and what compile ahead hides behind
            config.data.cache_latents = config.data.cache_text_encoder_outputs = True
            config.general.cache_dir = str(folder / f"general-{phase}")
            configs[phase] = config
        configs["cache-data"].compile.bundles = False
        configs["ahead-data"].compile.ahead = True
    return configs


def uncached_dataset(out_dir: Path, images: int, batch: int, size: int = 64) -> Path:
    """A generated dataset of ``images`` images of ``size`` px (rounded up to whole batches: a
    smaller last batch would be one more shape to compile ahead), made once in ``out_dir``."""
    from modules.data.shapes import ensure_shapes_dataset

    whole = -(-images // batch) * batch
    return ensure_shapes_dataset(Path(out_dir), count=whole, size=size)


def seed_general_cache(base: Config, target: Path) -> None:
    """Put the built-in model ``base`` names into the general cache folder ``target`` (a copy
    of the one the eager process built), so a data phase builds no model and caches no data
    but its own."""
    from modules.models.tiny import builtin_model_dir
    from modules.paths import cache_dir_for

    source = builtin_model_dir(base.model.path, cache_dir_for(base.general.cache_dir))
    shutil.copytree(source, builtin_model_dir(base.model.path, target))


def copy_checkout(source: Path, target: Path) -> Path:
    """The checkout's importable code at another path (compiled code must not depend on where
    the source lies)."""
    for part in CHECKOUT_PARTS:
        shutil.copytree(source / part, target / part,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


def phase_row(phase: str, result: dict[str, Any]) -> dict[str, Any]:
    """One phase's numbers from its cell result (and the run record it carries)."""
    record = result.get("record") or {}
    unet = (record.get("compile") or {}).get("unet") or {}
    bundle = record.get("compile_bundle") or {}
    return {
        "phase": phase, "label": PHASE_LABELS[phase], "status": result.get("status"),
        "error": result.get("error"),
        "first_step_seconds": result.get("first_step_seconds"),
        "to_first_step_end_seconds": result.get("first_step_end_after_launch_seconds"),
        "median_step_seconds": result.get("median_step_seconds"),
        "compile_seconds": result.get("compile_seconds"),
        "recompiles": result.get("recompiles"),
        "graphs_after_warmup": result.get("graphs_after_warmup"),
        "cache": result.get("cache"), "bundle": unet.get("bundle", result.get("bundle")),
        "cache_hits": unet.get("cache_hits"), "cache_misses": unet.get("cache_misses"),
        "bundle_lookup": bundle.get("lookup"), "bundle_from_ahead": bundle.get("from_ahead"),
        "ahead": record.get("compile_ahead"),
        "ahead_waited_seconds": (record.get("compile_ahead") or {}).get("waited_seconds"),
        "images": (record.get("dataset") or {}).get("images"), "bundle_loaded_entries":
            bundle.get("loaded_entries"), "bundle_written": bundle.get("written"),
        "losses": record.get("losses"),
    }


def compare_losses(rows: Sequence[dict[str, Any]], data: bool = False) -> dict[str, Any]:
    """Whether the measured phases' losses are identical step for step (over the steps all of
    them ran; each cell stops once it has its clean steps): the phases on the shared dataset,
    or with ``data`` the two on the uncached one."""
    runs = {r["phase"]: r["losses"] for r in rows
            if r.get("losses") and r["phase"] != "eager" and (r["phase"] in DATA_PHASES) == data}
    if len(runs) < 2:
        return {"identical": None, "steps_compared": 0,
                "why": "fewer than two phases recorded losses"}
    common = min(len(v) for v in runs.values())
    first = next(iter(runs.values()))[:common]
    differ = [p for p, v in runs.items() if v[:common] != first]
    return {"identical": not differ and common > 0, "steps_compared": common,
            "phases": list(runs), "differ": differ}


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets on launch-to-first-step-end: (b)/(a), (c)/(b) and (d)/(b′) (compile
    ahead against the local cache, both starting on uncached data); (d₀)/(b) is shown, not a
    target (with the data cached there is nothing for the compile to hide behind)."""
    by = {r["phase"]: r.get("to_first_step_end_seconds") for r in rows
          if r.get("status") == "ok"}
    out: dict[str, Any] = {"cache_over_cold": None, "cache_target_met": None,
                           "bundle_over_cache": None, "bundle_target_met": None,
                           "ahead_over_cache": None, "ahead_target_met": None,
                           "ahead_cached_over_cache": None}
    cold, cache, bundle = by.get("cold"), by.get("cache"), by.get("bundle")
    ahead, data_cache, data_ahead = by.get("ahead"), by.get("cache-data"), by.get("ahead-data")
    if cold and cache:
        out["cache_over_cold"] = round(cache / cold, 3)
        out["cache_target_met"] = out["cache_over_cold"] <= CACHE_AT_MOST
    if cache and bundle:
        out["bundle_over_cache"] = round(bundle / cache, 3)
        out["bundle_target_met"] = abs(out["bundle_over_cache"] - 1) <= BUNDLE_WITHIN
    if cache and ahead:
        out["ahead_cached_over_cache"] = round(ahead / cache, 3)
    if data_cache and data_ahead:
        out["ahead_over_cache"] = round(data_ahead / data_cache, 3)
        out["ahead_target_met"] = abs(out["ahead_over_cache"] - 1) <= BUNDLE_WITHIN
    return out


def measure_setting(base: Config, cell: Cell, folder: Path, launch: Launch, *,
                    steps: int, warmup: int, checkout: Path,
                    progress: Callable[[str], None],
                    dataset: Path | None = None) -> dict[str, Any]:
    """(a), (b), (c), (d₀), then with ``dataset`` (b′) and (d), in that order; the setting's
    row."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in ("cache-eager", "cache-a", "cache-c", "cache-d", "cache-d-data", "carried",
                  "checkout-c", "home-c", "tmp-c", *(f"general-{p}" for p in DATA_PHASES)):
        shutil.rmtree(folder / stale, ignore_errors=True)  # every run starts from nothing
    max_steps = step_cap(warmup, steps)
    phases: list[dict[str, Any]] = []
    configs = phase_configs(base, cell, folder, max_steps, None, dataset)
    for phase in ("eager", "cold", "cache"):
        progress(f"{cell.label} {base.model.path}: {PHASE_LABELS[phase]}")
        phases.append(phase_row(phase, launch(configs[phase], folder, phase, {}, None)))
    written = phases[1].get("bundle_written")
    if written and Path(written).is_file():
        carried = folder / "carried" / Path(written).name
        carried.parent.mkdir(parents=True)
        shutil.copyfile(written, carried)
        config = phase_configs(base, cell, folder, max_steps, carried)["bundle"]
        env = {"HOME": str(folder / "home-c"), "TMPDIR": str(folder / "tmp-c")}
        for place in env.values():
            Path(place).mkdir(parents=True)
        cwd = copy_checkout(checkout, folder / "checkout-c")
        progress(f"{cell.label} {base.model.path}: {PHASE_LABELS['bundle']}")
        phases.append(phase_row("bundle", launch(config, folder, "bundle", env, cwd)))
    else:
        phases.append({"phase": "bundle", "label": PHASE_LABELS["bundle"], "status": "skipped",
                       "error": "(a) wrote no bundle"})
    progress(f"{cell.label} {base.model.path}: {PHASE_LABELS['ahead']}")
    phases.append(phase_row("ahead", launch(configs["ahead"], folder, "ahead", {}, None)))
    if dataset is not None:
        for phase in DATA_PHASES:
            seed_general_cache(base, Path(configs[phase].general.cache_dir))
            progress(f"{cell.label} {base.model.path}: {PHASE_LABELS[phase]}")
            phases.append(phase_row(phase, launch(configs[phase], folder, phase, {}, None)))
    return {"model": base.model.path, "family": base.model.type.value,
            "backend": cell.backend, "scope": cell.scope, "phases": phases,
            "losses": compare_losses(phases), "losses_uncached": compare_losses(phases, data=True),
            "targets": targets(phases)}


def process_launch(steps: int, warmup: int, timeout: float) -> Launch:
    """Run each phase as a benchmark cell process (`modules.bench.runner.run_cell_process`),
    with its run record attached."""
    from modules.bench.runner import run_cell_process

    def launch(config: Config, folder: Path, phase: str, env: dict[str, str],
               cwd: Path | None) -> dict[str, Any]:
        extra = {"cwd": cwd} if cwd is not None else {}
        result = run_cell_process(config, folder, phase, steps, warmup,
                           (timeout, "the time per process given"),
                           Path(config.compile.cache_dir), lambda: False, env=env, **extra)
        record = folder / f"run-{phase}.json"
        if record.is_file():
            result["record"] = json.loads(record.read_text(encoding="utf-8"))
        return result
    return launch


def measure_warm_start(out_dir: Path, *, backend: str = "DEFAULT",
                       models: Sequence[str] = MODELS, scopes: Sequence[str] = SCOPES,
                       steps: int = 4, warmup: int = 1, timeout: float = 1800.0,
                       cache_dir: str | None = None, images: int = 0,
                       launch: Launch | None = None,
                       progress: Callable[[str], None] = print) -> WarmStartResult:
    """Every (model, scope) setting's rows; writes warm_start.json/.md in ``out_dir``.
    ``images`` > 0 adds (b′) and (d) on a dataset of that many uncached images. ``launch``
    replaces the cell processes (tests)."""
    from modules.bench.report import machine_info
    from modules.bench.runner import REPO_ROOT

    base = Config()
    if cache_dir:
        base.general.cache_dir = cache_dir
    result = WarmStartResult(machine_info(), {
        "backend": backend, "models": list(models), "scopes": list(scopes), "steps": steps,
        "warmup": warmup, "resolution": 64, "batch": 2, "method": "LORA", "precision": "fp32",
        "dynamic": "STATIC", "uncached_images": None})
    dataset = None
    if images > 0:
        progress(f"generating a dataset of {images} images")
        dataset = uncached_dataset(Path(out_dir), images, batch=2)
        result.settings["uncached_images"] = sum(1 for _ in dataset.glob("*.png"))
    run = launch or process_launch(steps, warmup, timeout)
    for model in models:
        config = setting_config(base, model)
        for scope in scopes:
            cell = Cell(backend, "unet", scope, "STATIC")
            folder = Path(out_dir) / f"{model.split(':')[-1]}-{scope.lower()}"
            result.rows.append(measure_setting(config, cell, folder, run, steps=steps,
                                               warmup=warmup, checkout=REPO_ROOT,
                                               progress=progress, dataset=dataset))
            result.write(Path(out_dir))  # after each setting: a run cut short keeps them
    return result


def _s(value: Any, fmt: str = ".1f") -> str:
    return "—" if value is None else format(value, fmt)


def markdown_table(result: WarmStartResult) -> str:
    """One line per (setting, phase), then the targets and the loss check per setting."""
    lines = ["| model | scope | start | first step s | launch to step 1 end s | step ms "
             "| recompiles | cache (hits/misses) | bundle |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in result.rows:
        family = MODEL_TYPES[_model_type(row["family"])].label
        for p in row["phases"]:
            if p["status"] != "ok":
                said = f"{p['status']}: {p.get('error') or ''}"
                lines.append(f"| {family} | {row['scope']} | {p['label']} | {said} | | | | | |")
                continue
            step = p.get("median_step_seconds")
            lines.append(
                f"| {family} | {row['scope']} | {p['label']} | {_s(p['first_step_seconds'])} "
                f"| {_s(p['to_first_step_end_seconds'])} "
                f"| {_s(step * 1000 if step is not None else None)} | {p['recompiles']} "
                f"| {p['cache']} ({p.get('cache_hits')}/{p.get('cache_misses')}) "
                f"| {p['bundle']} |")
        t, losses = row["targets"], row["losses"]
        waited = next((f"; the run waited {p['ahead_waited_seconds']} s for the ahead process"
                       for p in row["phases"] if p["phase"] == "ahead-data"
                       and p.get("ahead_waited_seconds") is not None), "")
        notes.append(
            f"- {family} {row['scope']}: (b)/(a) = {_pct(t['cache_over_cold'])} "
            f"(target ≤ {CACHE_AT_MOST:.0%}: {_met(t['cache_target_met'])}); (c)/(b) = "
            f"{_ratio(t['bundle_over_cache'])} (target within {BUNDLE_WITHIN:.0%}: "
            f"{_met(t['bundle_target_met'])}); (d)/(b′) = {_ratio(t['ahead_over_cache'])} "
            f"(target within {BUNDLE_WITHIN:.0%}: {_met(t['ahead_target_met'])}{waited}); "
            f"(d₀)/(b) = {_ratio(t['ahead_cached_over_cache'])} (nothing to hide behind); "
            f"losses over {losses['steps_compared']} steps "
            f"{_identical(losses)}" + _uncached_losses(row.get("losses_uncached")) + ".")
    return "\n".join(lines + [""] + notes)


def _model_type(value: str) -> Any:
    from modules.model_types import ModelType
    return ModelType(value)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _met(value: bool | None) -> str:
    return "not measured" if value is None else ("met" if value else "missed")


def _uncached_losses(losses: dict[str, Any] | None) -> str:
    if not losses or losses["identical"] is None:
        return ""
    return f"; on the uncached data over {losses['steps_compared']} steps {_identical(losses)}"


def _identical(losses: dict[str, Any]) -> str:
    if losses["identical"] is None:
        return "not compared"
    if losses["identical"]:
        return f"identical in {', '.join(losses['phases'])}"
    return f"differ in {', '.join(losses['differ'])}"
