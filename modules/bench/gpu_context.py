"""Where a GPU validation phase runs and what its jobs have found so far (the runner,
gpu_validate.py, fills it; the outputs, gpu_outputs.py, read it)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.bench.gpu_machine import installed_versions

# The compiled backend the phases after the headline measure models, levers and bundles with: the
# presets' backend. Phase 1 on an H200 (SD 1.5 LoRA, docs/benchmarks.md): DEFAULT's cold start
# ended in 143 s (1.23x eager); INDUCTOR's max_autotune was still autotuning its fourth graph
# when killed, alone, at 176 s and again at 204 s. A cold start that does not end brings back no
# ratio, so each phase's one compiled cell is DEFAULT; phase 4 weighs max_autotune.
COMPILED = "DEFAULT"
COMPILED_NAME = COMPILED.lower()


@dataclass
class Context:
    """Where a phase runs and what its jobs have found so far."""
    phase: str
    device: str                      # "cuda" | "cpu"
    tiny: bool
    out: Path                        # what comes back ($OUT)
    work: Path                       # models, runs and caches; kept on a warm machine
    budget_s: float
    parallel: int
    backends: tuple[str, ...] | None = None   # only jobs of these backends (None: all)
    jobs: tuple[str, ...] | None = None       # only these jobs, by name (None: all)
    commit: str | None = None        # the source's commit: the GPU machine's copy has no .git
    overrides: tuple[str, ...] = ()  # --set: config overrides for every train and cell run
    started: float = field(default_factory=time.monotonic)
    rows: list[dict[str, Any]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)   # job names, as the phase lists them
    _machine: dict[str, Any] | None = None
    _versions: dict[str, str | None] | None = None

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def machine(self) -> dict[str, Any]:
        """This machine, looked at once, without a CUDA context (the env job names the GPU)."""
        if self._machine is None:
            from modules.bench.report import machine_info
            self._machine = machine_info(ask_cuda=False)
        return self._machine

    def versions(self) -> dict[str, str | None]:
        """The libraries' installed versions, read once (the env job imports them)."""
        if self._versions is None:
            self._versions = installed_versions()
        return self._versions

    def row(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["job"] == name), None)

    def jobs_root(self) -> Path:
        """This phase's job folders: what the runs archive holds."""
        return self.work / "jobs" / self.phase

    def job_dir(self, name: str) -> Path:
        return self.jobs_root() / name

    def compile_cache(self) -> Path:
        """The compile caches of a machine's phases: each job has its own subfolder (a cold
        start must not find another backend's); a warm cell starts from its cold one's."""
        return self.work / "compile-cache"
