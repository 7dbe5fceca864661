"""``compile.scope=AUTO``: the scope chosen by measuring it once per machine and setting.

Regional compilation is not always faster (a peer measured a 21 % slower step on one DiT, and
on this project's CPU neither scope reliably beats eager on the small UNet). So AUTO measures:
the first time a (device, family, backend, batch and resolution) is met, a short benchmark
times the eager step, the REGIONAL step and the FULL step, each in a fresh process, and keeps
the fastest steady step (its cold cost is recorded beside it). The decision is stored in the
compile cache folder's ``bundles/scope_decisions.json``, where later runs find it.

Where nothing can be measured (a multi-process run, a cell that failed or ran out of time) AUTO
compiles REGIONAL, the default, and says why; a stored file that cannot be read is reported,
kept aside and replaced. This module is the decision and its storage; the measurement is
injected (`modules.train.recipe.compile_guard.measure_scopes` runs the benchmark).
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from modules.events import StopRequested
from modules.util.atomic import atomic_write_text

DECISIONS_FILE = "scope_decisions.json"
DECISIONS_FORMAT = 1
EAGER = "NONE"              # eager: the denoiser not compiled
CANDIDATES = (EAGER, "REGIONAL", "FULL")
FALLBACK = "REGIONAL"


@dataclass(frozen=True)
class ScopeMeasurement:
    """One candidate's numbers: the steady step (median) and the first step, which for a
    compiled scope holds its cold compile."""
    step_seconds: float
    first_step_seconds: float


@dataclass
class ScopeChoice:
    """What AUTO decided for a run, for run.json's ``compile_scope`` and the compile report."""
    key: str
    chosen: str                          # NONE (eager), REGIONAL or FULL
    source: str                          # stored | measured | fallback
    why: str
    measurements: dict[str, dict[str, float] | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # a bad decisions file, a failed cell

    def record(self) -> dict[str, Any]:
        return {"requested": "AUTO", **asdict(self)}

    def describe(self) -> str:
        chosen = "eager (denoiser not compiled)" if self.chosen == EAGER else self.chosen
        return f"compile.scope AUTO: {chosen} ({self.source}: {self.why})"


def scope_key(device: str, family: str, backend: str, batch: int, resolution: int) -> str:
    """The setting a decision holds for: the device, the family, the backend, and the preset's
    batch and resolution (what the step time depends on most)."""
    return f"{device} | {family} | {backend} | batch {batch} at {resolution} px"


def choose(measured: Mapping[str, ScopeMeasurement | None],
           allowed: tuple[str, ...] = CANDIDATES) -> tuple[str, str]:
    """(scope, why): the allowed candidate with the fastest steady step; REGIONAL with the
    reason when a candidate was not measured (a faster one might be among them)."""
    missing = [name for name in allowed if measured.get(name) is None]
    if missing:
        return FALLBACK, (f"{', '.join(missing)} could not be measured; compiling "
                          f"{FALLBACK}, the default")
    found = {name: m for name in allowed if (m := measured[name]) is not None}
    best = min(found, key=lambda name: found[name].step_seconds)
    def numbers(name: str) -> str:
        m = found[name]
        cold = "" if name == EAGER else f" (cold first step {m.first_step_seconds:.1f} s)"
        return f"{name} {m.step_seconds * 1000:.1f} ms{cold}"
    shown = ", ".join(numbers(name) for name in allowed)
    return best, f"fastest steady step of {shown}"


def read_decisions(path: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The stored decisions, and what is wrong with the file (None if nothing): a file that
    cannot be read gives no decisions, never an exception."""
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != DECISIONS_FORMAT:
            raise ValueError(f"not a format-{DECISIONS_FORMAT} decisions file")
        decisions = data["decisions"]
        if not isinstance(decisions, dict) or not all(
                isinstance(d, dict) and d.get("chosen") in CANDIDATES
                for d in decisions.values()):
            raise ValueError("a decision names no known scope")
        return decisions, None
    except (OSError, ValueError, KeyError) as err:
        return {}, f"{path} cannot be used ({err}); measuring again"


def write_decision(path: Path, key: str, choice: ScopeChoice) -> str | None:
    """Store ``choice`` under ``key`` (atomically); a file that could not be read is kept as
    ``<name>.unreadable`` first. Returns what went wrong, or None."""
    decisions, problem = read_decisions(path)
    try:
        if problem is not None:
            shutil.move(path, path.with_name(path.name + ".unreadable"))
        decisions[key] = {"chosen": choice.chosen, "why": choice.why,
                          "measurements": choice.measurements, "decided_at": time.time()}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": DECISIONS_FORMAT,
                                            "decisions": decisions}, indent=1) + "\n")
    except OSError as err:
        return f"{path}: the decision was not stored ({err.strerror or err})"
    return None


Measure = Callable[[tuple[str, ...]], Mapping[str, ScopeMeasurement | None]]


def resolve_auto(key: str, store: Path, measure: Measure | None,
                 allowed: tuple[str, ...] = CANDIDATES,
                 cannot_measure: str | None = None) -> ScopeChoice:
    """AUTO's scope for ``key``: the stored decision, else a new measurement (stored), else
    REGIONAL with the reason. ``cannot_measure`` says why this run does not measure (None: it
    may); ``measure`` runs the benchmark for the candidates it is given."""
    decisions, problem = read_decisions(store)
    problems = [problem] if problem else []
    stored = decisions.get(key)
    if stored is not None and stored["chosen"] in allowed:
        return ScopeChoice(key, stored["chosen"], "stored", f"measured before: {stored['why']}",
                           stored.get("measurements") or {}, problems)
    if cannot_measure is not None or measure is None:
        return ScopeChoice(key, FALLBACK, "fallback", cannot_measure or "no measurement",
                           {}, problems)
    try:
        measured = dict(measure(allowed))
    except StopRequested:  # the user's Stop is not a failed measurement: the run ends
        raise
    except Exception as err:  # a measurement that breaks never stops the run: REGIONAL, said
        return ScopeChoice(key, FALLBACK, "fallback", f"the measurement failed: {err}", {},
                           problems)
    chosen, why = choose(measured, allowed)
    numbers = {name: (asdict(m) if m is not None else None) for name, m in measured.items()}
    if chosen == FALLBACK and any(m is None for m in measured.values()):
        return ScopeChoice(key, chosen, "fallback", why, numbers, problems)
    choice = ScopeChoice(key, chosen, "measured", why, numbers, problems)
    stored_problem = write_decision(store, key, choice)
    if stored_problem:
        choice.problems.append(stored_problem)
    return choice
