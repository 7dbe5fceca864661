"""``--apply PRESET``: write the fastest working compile settings into a preset file.

Only ``compile.backend / unet / text_encoder / vae / scope / dynamic`` change. The file is read
with the strict loader *without* resolving its relative paths (``load_config`` would make them
absolute and the saved file would then differ in keys we must not touch) and written back
sparse, so every other value the preset sets stays exactly what it was.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from modules.bench.matrix import COMPONENT_SETS
from modules.config import from_dict, save_config
from modules.config.loader import read_json
from modules.config.schema import CompileBackend, CompileScope, DynamicShapes

BUILTIN_PRESETS_DIR = Path(__file__).resolve().parent.parent.parent / "training_presets"


class ApplyError(Exception):
    """The preset cannot be written (built-in preset without --force, nothing worked)."""


def is_builtin_preset(path: Path | str) -> bool:
    return Path(path).resolve().is_relative_to(BUILTIN_PRESETS_DIR.resolve())


UNFINISHED = ("timeout", "skipped")


def recommended_settings(result) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(compile.* values to set, a note saying why, the cell they came from) for ``result``.

    The fastest working compiled cell when it beats eager; eager (only ``compile.backend``
    changes, so the component switches stay for a later backend) when nothing compiled was
    faster. Raises ApplyError when the comparison is incomplete: a cell that timed out or was
    skipped may be the fastest (an SD-size autotuned compile can outlast its limit), so no
    finished cell is recommended over it; nor is anything without a finished eager baseline.
    """
    unfinished = [c for c in result.cells if c["status"] in UNFINISHED]
    if unfinished:
        names = ", ".join(f"{c['label']} ({c['status']})" for c in unfinished)
        raise ApplyError(f"not every cell finished: {names}; one of them may be the fastest. "
                         "Run the benchmark again (with more time per cell for a "
                         "timeout), or without those backends, before applying")
    best = result.fastest()
    base = result.baseline()
    if base is None or base["status"] != "ok":
        why = "it is missing" if base is None else f"{base['status']}: {base.get('error')}"
        raise ApplyError(f"the eager baseline did not finish ({why}); without it no speedup "
                         "is known, so nothing is applied")
    if best is None or not best.get("speedup") or best["speedup"] <= 1.0:
        why = ("no compiled cell ran its requested backend cleanly" if best is None else
               f"the fastest compiled cell, {best['label']}, ran at {best['speedup']}× eager")
        return {"compile.backend": CompileBackend.NONE}, f"eager: {why}", base
    values: dict[str, Any] = {"compile.backend": CompileBackend(best["backend"])}
    for name, on in COMPONENT_SETS[best["components"]].items():
        values[f"compile.{name}"] = on
    values["compile.scope"] = CompileScope(best["scope"])
    values["compile.dynamic"] = DynamicShapes(best["dynamic"])
    return values, f"{best['speedup']:.2f}× eager", best


def apply_fastest(result, preset: Path | str, force: bool = False) -> dict[str, Any]:
    """Write the recommended compile settings of ``result`` into ``preset``; return them."""
    preset = Path(preset)
    if is_builtin_preset(preset) and not force:
        raise ApplyError(f"{preset} is a preset that ships with Tempera "
                         f"(under {BUILTIN_PRESETS_DIR}); copy it and apply to the copy, "
                         "or pass --force to change it anyway")
    values, note, cell = recommended_settings(result)
    if preset.exists():
        config = from_dict(read_json(preset), source=str(preset))
    else:
        from modules.config import Config
        config = Config()
    for path, value in values.items():
        setattr(config.compile, path.removeprefix("compile."), value)
    save_config(config, preset, sparse=True)
    return {"backend": values["compile.backend"].value, "components": cell["components"],
            "scope": cell["scope"], "dynamic": cell["dynamic"], "note": note,
            "preset": str(preset)}
