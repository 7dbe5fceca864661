"""What the run controls do: Start, Resume, Stop, Sample now, Save now, Output folder and
TensorBoard.

It owns the training's worker thread (`app.runner.TrainingWorker`), what a start checks, what
keeps Start refused meanwhile (a benchmark, a compilation check: `block_start`) and the
TensorBoard process. The window
hands it the training's events (`exited`, `show_sample`) and asks it whether a run is going.
"""
from __future__ import annotations

import copy
import queue
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app import external
from app.binding import ConfigBinding
from app.problems_panel import ProblemsPanel
from app.readable import readable
from app.replace_dialog import NEW_FOLDER, REPLACE, AskReplace
from app.run_panel import RunPanel
from app.runner import Event, TrainFn, TrainingWorker
from modules import frontend
from modules.config import Config, Problem

TENSORBOARD_URL = f"http://127.0.0.1:{external.TENSORBOARD_PORT}"
# The events a training's worker sends (app.runner.QueueCallbacks and TrainingWorker)
TRAINING_EVENTS = frozenset({"status", "progress", "sample", "compile", "saved", "validation",
                             "error", "done", "config_error", "failed", "crashed", "exit"})


class RunControl:
    def __init__(self, binding: ConfigBinding, events: "queue.Queue[Event]",
                 train_fn: TrainFn | None, run_panel: RunPanel, problems: ProblemsPanel, *,
                 benchmark_running: Callable[[], bool],
                 set_check_enabled: Callable[[bool, str], None],
                 show_run_tab: Callable[[], None], ask_replace: AskReplace) -> None:
        self.binding, self.events, self.train_fn = binding, events, train_fn
        self.ask_replace = ask_replace  # before a fresh start replaces the folder's run
        self.run_panel, self.problems = run_panel, problems
        self.benchmark_running, self.set_check_enabled = benchmark_running, set_check_enabled
        self.show_run_tab = show_run_tab
        self.worker: TrainingWorker | None = None
        self.last_result: Any = None
        self.expected_compile: Any = None  # a CompileExpectation while a run compiles
        # What keeps Start (and Resume) refused, by who asked: a benchmark, a compilation check
        self._blockers: dict[str, str] = {}
        self.tensorboard: subprocess.Popen | None = None

    @property
    def training(self) -> bool:
        return self.worker is not None and self.worker.running

    def output_dir(self) -> Path:
        return Path(self.binding.config.output.dir).expanduser()

    def start(self, resume: bool = False) -> bool:
        """Check what a start checks (config and inputs) and start the worker; problems are
        listed instead. `resume` continues the output folder's newest backup."""
        if self.worker is not None:
            return False
        if self.benchmark_running():
            self.run_panel.set_status("A benchmark is running (Advanced Options); stop it or "
                                      "wait, so the two do not share the machine.", error=True)
            return False
        if self.checking:
            self.run_panel.set_status("Check compilation is running (Advanced Options); wait "
                                      "for its report: it resets torch's compiler state, which "
                                      "the training's compiled code lives in.", error=True)
            return False
        if "engine" in self._blockers:  # the button is greyed; a click that got through
            self.run_panel.set_status(f"Not yet: {self._blockers['engine']}.", error=True)
            return False
        problems = self.start_problems(resume)
        if problems:
            self.problems.show(problems, source=lambda: self.start_problems(resume))
            self.run_panel.set_status(f"Cannot start: {len(problems)} problem(s).", error=True)
            return False
        config = self.binding.snapshot()
        if resume:
            config.training.resume_from = "latest"
        elif not self._may_start_anew(config):
            return False
        self.problems.hide()
        self.run_panel.reset()
        if resume:
            self._show_earlier_run(config)
        self.set_running(True)
        self.expected_compile = frontend.expected_compile(config)
        self.run_panel.set_status("Resuming…" if resume else "Starting…")
        self.run_panel.log(("resuming" if resume else "starting") +
                           f" training into {config.output.dir}")
        self.show_run_tab()
        self.last_result = None
        self.worker = TrainingWorker(config, self.events, self.train_fn)
        self.worker.start()
        self.refresh_resume()  # the Run tab's note now says what this run's folder holds
        return True

    def _may_start_anew(self, config: Config) -> bool:
        """With overwrite on, a fresh start removes the run in the output folder (without it,
        the start check refuses such a folder): ask first, naming what would go, and offer a
        numbered folder beside it. Answered "new folder", `config` and the form get it."""
        output = Path(config.output.dir).expanduser()
        earlier = frontend.previous_run(output) if config.output.overwrite else None
        if earlier is None:
            return True
        sibling = frontend.free_sibling(output)
        answer = self.ask_replace(readable(earlier.describe()), sibling)
        if answer == REPLACE:
            self.run_panel.log(f"replacing the run in {output}: " + "; ".join(earlier.removed()))
            return True
        if answer == NEW_FOLDER:
            config.output.dir = str(sibling)
            self.binding.set_value("output.dir", str(sibling))
            self.run_panel.log(f"starting in {sibling}: the run in {output} is kept")
            return True
        self.run_panel.set_status(f"Not started: the run in {output} is kept.")
        return False

    def resume(self) -> bool:
        return self.start(resume=True)

    def _show_earlier_run(self, config: Config) -> None:
        """A resumed run continues a curve and samples: show the earlier losses (run.json) up
        to the backup it resumes from, and the newest samples, before its first step."""
        output = Path(config.output.dir).expanduser()
        # where the engine resumes: the step the run so far is shown up to (one decision)
        step = frontend.resume_offer(output, config.training.max_steps).backup_step
        if step is None:
            return
        points = frontend.earlier_losses(output, step)
        self.run_panel.show_earlier_losses(points)
        for score in frontend.earlier_validation(output, step):
            self.run_panel.show_validation(score)
        sample_step, samples = frontend.latest_samples(output, step)
        prompts = config.sampling.prompts
        for index, path in samples:
            self.show_sample(path, prompts[index] if index < len(prompts) else "", sample_step)
        self.run_panel.log(f"the run so far: {len(points)} losses up to step {step}"
                           + (f", samples of step {sample_step}" if samples else ""))

    def show_event(self, kind: str, data: Any) -> None:
        """Show one of the training's events (`TRAINING_EVENTS`) on the Run tab and bar."""
        panel = self.run_panel
        if kind == "status":  # what the run does now: stale once a later step is shown
            text = readable(data)
            panel.set_status(text, of_run=True)
            panel.log(text)
            self.refresh_resume()  # e.g. "removed the previous run's ...": read the disk again
        elif kind == "progress":
            panel.show_progress(data)
            self.refresh_resume()  # a backup the step before wrote
        elif kind == "sample":
            self.show_sample(*data)
        elif kind == "compile":
            self.show_compile(data)
        elif kind == "saved":
            panel.log(f"saved {data[0]} at step {data[1]}")
            self.refresh_resume()  # a backup or final/ more on the disk
        elif kind == "validation":  # the status line about it came as a status event
            panel.show_validation(data)
        elif kind == "error":
            panel.set_status(readable(data), error=True)
            panel.log("ERROR " + readable(data))
        elif kind == "done":
            self.last_result = data
            panel.set_status(f"{data.status}: {data.steps} steps; outputs in {data.output_dir}")
            panel.show_ended(data.status)
        elif kind == "config_error":
            self.problems.show(data)
            panel.set_status(f"Cannot start: {len(data)} problem(s).", error=True)
        elif kind in ("failed", "crashed"):
            last = data.strip().splitlines()[-1] if data.strip() else kind
            panel.set_status(f"Training {kind}: {readable(last)}", error=True)
            panel.log(f"ERROR training {kind}: {readable(data) if kind == 'failed' else data}")
            panel.show_ended(kind)
        elif kind == "exit":
            self.exited()

    def show_compile(self, event: Any) -> None:
        """A compile event (`CompileEvent`): one short sentence in the status line, the full
        text in the log. Its message names the component and says its seconds already."""
        panel = self.run_panel
        text = readable(event.message)
        warn = event.kind in ("fallback", "degraded", "warning", "recompile")
        panel.set_status(text, error=warn, of_run=not warn)
        panel.log(("WARNING " if warn else "") + "compile: " + text
                  + (f"\n{event.detail}" if event.detail else ""))
        if event.kind == "progress":
            panel.show_compiling(text, self.expected_compile, event.graph, event.component)

    def show_sample(self, path: Path, prompt: str, step: int) -> None:
        try:
            self.run_panel.show_sample(path, prompt, step)
        except OSError as exc:
            self.run_panel.log(f"ERROR could not show sample {path}: {exc}")
            return
        self.run_panel.log(f"sample at step {step}: {path}")

    def start_problems(self, resume: bool = False) -> list[Problem]:
        """What a start checks: unparsable fields, the config, and the model, datasets and
        output folder it names (the CLI's --check runs the same)."""
        config = copy.deepcopy(self.binding.config)  # a snapshot raises on a refused value
        if resume:
            config.training.resume_from = "latest"
        problems = self.binding.problems(config=config)
        if resume:  # the button is off for a finished run; this holds if it is pressed anyway
            finished = frontend.finished_run_problem(self.output_dir(), "latest",
                                                     config.training.max_steps)
            problems += [finished] if finished else []
        return problems

    def block_start(self, key: str, why_not: str | None) -> None:
        """Refuse Start (and Resume) for `why_not` until the same `key` passes None; with
        several reasons at once, Start waits for all of them and shows the first."""
        if why_not is None:
            self._blockers.pop(key, None)
        else:
            self._blockers[key] = why_not
        self._update_buttons()

    def _update_buttons(self) -> None:
        """Start's, Resume's and Check compilation's states from the facts now (what blocks
        Start, whether a training runs); every change of those facts comes through here."""
        reasons = list(self._blockers.values())
        self.run_panel.set_start_allowed(not reasons, reasons[0] if reasons else "")
        # Check compilation resets torch's compiler state process-wide and loads a second model
        check_why_not = ("not while training: it would reset the running training's compiled "
                         "code" if self.run_panel.running else self._blockers.get("engine")
                         or ("checking…" if self.checking else ""))
        self.set_check_enabled(not check_why_not, check_why_not)

    @property
    def checking(self) -> bool:
        """Check compilation is running (in a thread of this process)."""
        return "check" in self._blockers

    def benchmark_changed(self, running: bool) -> None:
        """A benchmark and a training must not share the machine: Start waits meanwhile."""
        self.block_start("benchmark", "a benchmark is running (Advanced Options): stop it or "
                                      "let it finish" if running else None)
        if not running:
            self.run_panel.clear_notice()

    def set_running(self, running: bool) -> None:
        """Run controls, and what must not run beside a training (Check compilation resets
        torch's compiler state process-wide and loads a second model)."""
        self.run_panel.set_running(running)
        self._update_buttons()
        if not running:
            self.refresh_resume()

    def exited(self) -> None:
        """The worker's thread ended (its last event)."""
        self.worker = None
        self.run_panel.show_ended(None)  # no ETA, no busy bar: nothing runs any more
        self.set_running(False)

    def refresh_resume(self) -> None:
        """The Run tab's note and Resume, read from the disk now. While a run trains, what
        its folder holds (the backups written so far: a fresh start removed the earlier
        run's). Otherwise Resume is offered when the output folder holds backups of a run
        that ended early (and the note says how it ended); a finished run only offers to
        continue when Max steps was raised above its end (`modules/train/state/resume_offer.py`
        decides, as it does for the CLI)."""
        running = self.worker is not None
        output = (Path(self.worker.config.output.dir).expanduser() if self.worker is not None
                  else self.output_dir())
        steps = [step for step, _ in frontend.list_backups(output)]
        try:
            final = frontend.final_weights_step(output)
        except ValueError as exc:  # an unreadable marker: the run would refuse to replace it
            final = None
            if not running:  # not at every step of a run
                self.run_panel.log(f"final/: {exc}")
        if running:
            self.run_panel.show_run_folder(output, steps, final)
            return
        offer = frontend.resume_offer(output, self.binding.config.training.max_steps)
        self.run_panel.show_backups(output, steps, offer,
                                    ended=frontend.read_run_status(output), final_step=final)

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.commands.request_stop()
            self.run_panel.set_status("Stopping: finishing the step and saving…")

    def sample_now(self) -> None:
        if self.worker is not None:
            self.worker.commands.request_sample()
            self.run_panel.log("sample requested")

    def save_now(self) -> None:
        if self.worker is not None:
            self.worker.commands.request_save()
            self.run_panel.log("checkpoint requested")

    def open_output_folder(self) -> bool:
        try:
            external.open_folder(self.output_dir())
        except OSError as exc:
            self.run_panel.set_status(f"Could not open the output folder: {exc}", error=True)
            self.run_panel.log(f"could not open output folder: {exc}")
            return False
        self.run_panel.log(f"opened {self.output_dir()}")
        return True

    def start_tensorboard(self) -> bool:
        """Start TensorBoard on the output folder's logs; its button then shows the address
        and a second press opens it in the browser."""
        if self.tensorboard is not None and self.tensorboard.poll() is None:
            external.open_url(TENSORBOARD_URL)
            self.run_panel.log(f"opened {TENSORBOARD_URL} (TensorBoard)")
            return True
        logdir = self.output_dir() / "tensorboard"
        try:
            self.tensorboard = external.start_tensorboard(logdir)
        except OSError as exc:
            self.run_panel.set_status(f"Could not start TensorBoard: {exc}", error=True)
            self.run_panel.log(f"could not start TensorBoard: {exc}")
            return False
        self.run_panel.show_tensorboard(TENSORBOARD_URL)
        self.run_panel.log(f"TensorBoard started for {logdir}: {TENSORBOARD_URL}")
        self.run_panel.set_status(f"TensorBoard serves the logs of {logdir} at "
                                  f"{TENSORBOARD_URL} (press its button to open it)")
        return True

    def close(self) -> None:
        """The window closes: TensorBoard goes with it."""
        if self.tensorboard is not None and self.tensorboard.poll() is None:
            self.tensorboard.terminate()
