"""``compile.ahead``: the run's batch shapes compiled in a process of its own while the main
process caches the captions and latents, handed over as the compile bundle the run loads, so
the first step does not compile.

The ahead process (`ahead_process.py`) is the run's own recipe on a copy of its config
(`ahead_config`): the same model, trained components, adapters and compile settings, so the
graphs it compiles are the run's, keyed the same in inductor's caches. It reads the images itself (no latent cache: the
VAE encodes its few batches), takes one batch of each shape the run's epoch batches hold
(`shape_batches`), trains one step on each in a throwaway output folder, and the compile engine
writes the bundle into the cache folder's ``bundles/`` as a run's would. Then it exits and the
main process's compile engine finds that bundle (run.json: ``compile_bundle.from_ahead``).

Where torch allows it the ahead process would hold no weights at all: it does not. Under
FakeTensorMode dynamo and inductor compile, but the compiled kernels then run on tensors without
storage and the process crashes; on the meta device inductor generates no code (and code for
meta is not what a CPU or GPU run looks up). So the ahead process loads its own copy of the
weights, on the CPU, and compile ahead runs only where the run trains on the CPU: on a GPU it
would need a second copy of the weights on the device (validation refuses general.device=CUDA;
AUTO on a GPU machine says so and compiles at step 1).

The main process's side: `start_compile_ahead` (a setup step of the recipe, before the caching)
and `finish_compile_ahead` (before compile). A Stop while it runs ends it; its failure is
reported, recorded in run.json's ``compile_ahead`` and the run compiles at step 1.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from modules.config import save_config
from modules.config.schema import Config
from modules.events import StopRequested, TrainerCallbacks
from modules.train.outputs.record import RunRecord
from modules.util.process import with_repo_on_pythonpath
from modules.util.cores import usable_cores

AHEAD_MODULE = "modules.train.recipe.ahead_process"  # the process's own module
POLL_SECONDS = 0.2
TERMINATE_SECONDS = 10.0  # how long an ended ahead process may take to exit before SIGKILL
REPO = Path(__file__).resolve().parents[3]


@dataclass
class AheadRecord:
    """run.json's ``compile_ahead``: started, done, failed, stopped or not started (why)."""
    status: str
    why: str | None = None
    pid: int | None = None
    seconds: float | None = None          # from start to exit
    compile_seconds: float | None = None  # the ahead run's own compile time
    shapes: list[str] = field(default_factory=list)
    bundle: str | None = None             # the bundle it wrote
    # How long the run waited for it once its own caching was done (0: it was done first,
    # so its whole compile was hidden behind the caching)
    waited_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ahead_blocker(config: Config, device: torch.device, multi_process: bool) -> str | None:
    """Why this run does not compile ahead although compile.ahead is on (None: it does).
    Validation has refused what the config alone rules out (docs/compilation.md)."""
    from modules.train.recipe.compile_guard import matching_bundle

    if device.type != "cpu":
        return (f"the run trains on {device.type}: compiling ahead for it would need a second "
                "copy of the weights on that device; compiling at step 1")
    if multi_process:
        return "a multi-process run does not compile ahead; compiling at step 1"
    found = matching_bundle(config)
    if found is not None and found.status == "hit":
        return f"the compile bundle for these settings is there already ({found.path})"
    return None


def shared_cores_warning(threads: int, cores: int | None) -> str | None:
    """What to tell a run whose ahead process will share the cores its caching uses (None:
    there are enough for both). Measured on 2 cores with 2 threads each, the caching took 1.7-3.5
    times as long beside the ahead process and step 1 ended later than compiling at step 1
    would have (docs/benchmarks.md, "Warm starts side by side")."""
    if cores is None or cores >= 2 * threads:
        return None
    return (f"warning: the ahead process and the caching will share this machine's {cores} "
            f"cores (the run uses {threads} threads, and so will it): both go slower, and the "
            "first step may come later than compiling at step 1 would; compile ahead pays "
            f"with {2 * threads} cores or more")


class CompileAhead:
    """The running ahead process, owned by the main process's setup: `end` always reaps it."""

    def __init__(self, process: subprocess.Popen, work: Path, log: Any) -> None:
        self.process, self.work, self._log = process, work, log
        self.started = time.monotonic()

    @classmethod
    def start(cls, config: Config) -> "CompileAhead":
        """Start the ahead process on ``config`` with this process's torch thread count
        (inductor's CPU code is generated for it: part of the bundle's fingerprint)."""
        work = Path(tempfile.mkdtemp(prefix="tempera-ahead-"))
        save_config(config, work / "config.json")
        log = open(work / "ahead.log", "w", encoding="utf-8")  # closed by end()
        env = with_repo_on_pythonpath()
        process = subprocess.Popen(
            [sys.executable, "-m", AHEAD_MODULE, "--config", str(work / "config.json"),
             "--threads", str(torch.get_num_threads()), "--out", str(work / "result.json")],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            # its own process group: inductor's compile workers end with it (`end`)
            start_new_session=True)
        return cls(process, work, log)

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def end(self) -> None:
        """End the process (and its compile workers) if it still runs; remove its folder."""
        if self.running():
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(TERMINATE_SECONDS)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        if not self._log.closed:
            self._log.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:  # it exited between the poll and the signal
            pass

    def wait(self, should_stop: Callable[[], bool]) -> AheadRecord:
        """Wait for the process to finish: done (with what it wrote) or failed (why). Raises
        StopRequested, with the process ended, when ``should_stop`` says so first."""
        waiting_since = time.monotonic()
        while self.running():
            if should_stop():
                self.end()
                raise StopRequested("stopped while compiling ahead")
            time.sleep(POLL_SECONDS)
        ended = time.monotonic()
        seconds, waited = round(ended - self.started, 1), round(ended - waiting_since, 1)
        result_file = self.work / "result.json"
        code = self.process.returncode
        result = read_result(result_file) if code == 0 else None
        if result is not None:
            return AheadRecord("done", pid=self.pid, seconds=seconds,
                               compile_seconds=result.get("compile_seconds"),
                               shapes=result.get("shapes", []), bundle=result.get("bundle"),
                               waited_seconds=waited, why=None if result.get("bundle") else
                               "it compiled nothing that a bundle carries")
        self._log.flush()
        lines = (self.work / "ahead.log").read_text(encoding="utf-8", errors="replace")
        tail = next((line for line in reversed(lines.strip().splitlines()) if line.strip()),
                    "no output")
        how = (f"ended by signal {-code}" if code is not None and code < 0
               else f"exit {code}" if code else "no readable result")
        return AheadRecord("failed", why=f"{how}: {tail.strip()}", pid=self.pid,
                           seconds=seconds, waited_seconds=waited)


def read_result(path: Path) -> dict[str, Any] | None:
    """What a finished ahead process wrote about itself; None when it wrote nothing readable
    (the run then reports a failure, it does not fail)."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


# ------------------------------------------------------------- the recipe's two setup steps
def start_compile_ahead(config: Config, device: torch.device, multi_process: bool,
                        callbacks: TrainerCallbacks, record: RunRecord) -> CompileAhead | None:
    """Setup step: start compiling ahead (compile.ahead), before the captions and latents
    are cached; None when off or when this run cannot (said and recorded)."""
    if not config.compile.ahead:
        return None
    blocker = ahead_blocker(config, device, multi_process)
    if blocker is not None:
        callbacks.on_status(f"compile ahead: not started ({blocker})")
        record.write(compile_ahead=AheadRecord("not started", why=blocker).to_dict())
        return None
    try:
        ahead = CompileAhead.start(config)
    except OSError as err:  # no temporary folder, no process: the run compiles at step 1
        why = f"it could not be started ({err.strerror or err})"
        callbacks.on_status(f"warning: compile ahead failed ({why}); compiling at step 1")
        record.write(compile_ahead=AheadRecord("failed", why=why).to_dict())
        return None
    callbacks.on_status(f"compile ahead: compiling the run's batch shapes in process "
                        f"{ahead.pid} while the data is cached")
    shared = shared_cores_warning(torch.get_num_threads(), usable_cores())
    if shared:
        callbacks.on_status(f"compile ahead: {shared}")
    record.write(compile_ahead=AheadRecord("started", pid=ahead.pid).to_dict())
    return ahead


def finish_compile_ahead(ahead: CompileAhead | None, callbacks: TrainerCallbacks,
                         record: RunRecord, should_stop: Callable[[], bool]) -> Path | None:
    """Setup step, before compile: wait for the ahead process; the bundle it wrote (the run
    loads it), or None. A failure is said and recorded and the run compiles at step 1; a
    Stop ends the process and raises StopRequested."""
    if ahead is None:
        return None
    if ahead.running():
        callbacks.on_status(f"compile ahead: waiting for process {ahead.pid} to finish")
    try:
        outcome = ahead.wait(should_stop)
    except StopRequested:
        record.write(compile_ahead=AheadRecord("stopped", why="Stop while it ran",
                                               pid=ahead.pid).to_dict())
        raise
    finally:
        ahead.end()
    record.write(compile_ahead=outcome.to_dict())
    if outcome.status == "failed":
        callbacks.on_status(f"warning: compile ahead failed ({outcome.why}); compiling at "
                            "step 1")
        return None
    shapes = ", ".join(outcome.shapes) or "no shape"
    callbacks.on_status(f"compile ahead: done in {outcome.seconds} s ({shapes}); "
                        + (f"the run waited {outcome.waited_seconds} s for it"
                           if outcome.waited_seconds else "all of it while the data was cached")
                        + (f"; bundle {outcome.bundle}" if outcome.bundle else
                           f"; {outcome.why}"))
    return Path(outcome.bundle) if outcome.bundle else None


def stop_compile_ahead(ahead: CompileAhead, record: RunRecord) -> None:
    """The setup's undo for a started ahead process: a Stop or a failure before
    `finish_compile_ahead` ends it (and says so in run.json)."""
    if ahead.running():
        ahead.end()
        record.write(compile_ahead=AheadRecord("stopped", why="the run's setup ended first",
                                               pid=ahead.pid).to_dict())
    else:
        ahead.end()


# ------------------------------------------------------------------- the ahead process itself
