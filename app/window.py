"""The Tempera window: a composer of the preset bar, the tabs generated from the config schema,
the problems panel and the run controls.

Each part owns its widgets and state (`presets_bar.py`, `problems_panel.py`, `window_size.py`,
`run_panel.py`, `compile_panel.py`, `cloud_panel.py`, `benchmark_panel.py`); the window wires them
with callbacks. It holds one Config (in `ConfigBinding`). Training runs in a worker thread
(`app.runner`); its events arrive on a queue that `_poll` drains on the Tk thread via `after()`.
"""
from __future__ import annotations

import queue
import subprocess
from collections.abc import Callable
from pathlib import Path
from tkinter import messagebox
from typing import Any

import customtkinter as ctk

from app import external
from app.benchmark_panel import BenchFn, BenchmarkSection
from app.binding import ConfigBinding
from app.cloud_panel import TAB as CLOUD_TAB, CloudPanel
from app.compile_info import format_report
from app.compile_panel import PLACED, CompilePanel
from app.field_states import update_cache_hints, update_component_states
from app.form import FieldRegistry, build_fields, fields_of_group, groups_in_order, tab_title
from app.presets import BUILTIN_PRESETS_DIR
from app.presets_bar import PresetsBar
from app.problems_panel import ProblemsPanel
from app.run_panel import RunPanel
from app.runner import Event, TrainFn, TrainingWorker, run_in_thread
from app.settings import DEFAULT_SETTINGS_PATH, load_settings, save_settings
from app.thread_guard import ThreadGuard, tk_thread_only
from app.widgets import bind_select_all
from app.window_size import WindowSizing, apply_scaling, place_window
from modules import frontend
from modules.config import Config, ConfigError, Problem

RUN_TAB = "Run"
TENSORBOARD_URL = f"http://127.0.0.1:{external.TENSORBOARD_PORT}"
ENGINE_AFTER_MS = 100  # torch is imported this long after the window is shown (its first paint)


def ask_yes_no(title: str, message: str) -> bool:
    return messagebox.askyesno(title, message)


def ask_yes_no_cancel(title: str, message: str) -> bool | None:
    """Yes (True), No (False) or Cancel (None)."""
    return messagebox.askyesnocancel(title, message)


class TemperaApp(ctk.CTk):
    def __init__(self, settings_path: Path | None = None, builtin_presets_dir: Path | None = None,
                 train_fn: TrainFn | None = None, confirm: Callable[[str, str], bool] | None = None,
                 ask_save_path: Callable[[Path], str | None] | None = None,
                 explain_fn: Callable[[Config], Any] | None = None, poll_ms: int = 50,
                 bench_fn: BenchFn | None = None,
                 initial_preset: Path | None = None,
                 ask_unsaved: Callable[[str, str], bool | None] | None = None) -> None:
        self.settings_path = Path(settings_path or DEFAULT_SETTINGS_PATH).expanduser()
        self.settings, settings_warning = load_settings(self.settings_path)
        apply_scaling(self.settings.scaling)
        super().__init__()
        self.withdraw()  # shown once every tab is built: no half-drawn first paint
        self.title("Tempera")
        place_window(self, self.settings)
        self.engine_ready = False  # the engine's heavy imports are done (`_import_engine`)
        self.train_fn, self.explain_fn, self.poll_ms = train_fn, explain_fn, poll_ms
        self.bench_fn = bench_fn
        self.confirm = confirm or ask_yes_no
        self.ask_unsaved = ask_unsaved or ask_yes_no_cancel  # save / discard / cancel
        self.guard = ThreadGuard()
        self.binding = ConfigBinding()
        self.registry = FieldRegistry()
        self.binding.subscribe(self.registry.on_change)
        self.events: "queue.Queue[Event]" = queue.Queue()
        self.worker: TrainingWorker | None = None
        self.tensorboard: subprocess.Popen | None = None
        self.closing = False
        self.last_result: Any = None
        # What keeps Start (and Resume) refused, by who asked: a benchmark, a compilation check
        self._start_blockers: dict[str, str] = {}

        self.grid_columnconfigure(0, weight=1)
        self.grid_rowconfigure(1, weight=1)
        self.tabview = ctk.CTkTabview(self)
        self.tabview.grid(row=1, column=0, sticky="nsew", padx=8)
        self._build_tabs()
        bar = ctk.CTkFrame(self)
        bar.grid(row=0, column=0, sticky="ew", padx=8, pady=(8, 0))
        self.sizing = WindowSizing(self, bar, self.tabview, self.registry, self.settings,
                                   self._save_settings)
        self.presets_bar = PresetsBar(
            bar, self.binding, self.settings, Path(builtin_presets_dir or BUILTIN_PRESETS_DIR),
            confirm=self.confirm, ask_save_path=ask_save_path,
            show_problems=lambda *args, **kw: self.problems_panel.show(*args, **kw),
            hide_problems=lambda: self.problems_panel.hide(),
            set_status=lambda text, error=False: self.run_panel.set_status(text, error),
            log=lambda line: self.run_panel.log(line), set_title=self.title,
            loaded=self.refresh_resume, action=self._action)
        self.problems_panel = ProblemsPanel(
            self, self.registry, self.jump_to,
            lambda: self.run_panel.set_status("Every listed problem is fixed."))
        self.run_panel = RunPanel(self, self.tabview.tab(RUN_TAB), self.guard, {
            key: self._action(fn) for key, fn in (
                ("start", self.start_training), ("resume", self.resume_training),
                ("stop", self.stop_training), ("sample", self.sample_now),
                ("save", self.save_now), ("open_output", self.open_output_folder),
                ("tensorboard", self.start_tensorboard))})
        self.run_panel.bar.grid(row=3, column=0, sticky="ew", padx=8, pady=(4, 8))
        self.binding.subscribe(self._on_config_change)
        self.expected_compile: Any = None  # a CompileExpectation while a run compiles
        self.protocol("WM_DELETE_WINDOW", self.on_close)
        bind_select_all(self)
        if settings_warning:
            self.run_panel.log(settings_warning)
        self.presets_bar.load_initial(initial_preset)
        update_component_states(self.registry, self.binding.config)
        update_cache_hints(self.registry, self.binding.config)
        self.refresh_resume()
        # Importing torch took seconds with nothing on screen: the window is built without it,
        # shown, and then imports it, saying so. On the Tk thread, not in a thread: a worker's
        # garbage collection can delete a Tk font, which waits for the Tk thread, while the Tk
        # thread waits for the worker's import lock (seen as a hang).
        self.compile_panel.cancel_pending()
        self._status_before_engine = self.run_panel.status_text
        self.run_panel.set_status(f"{self._status_before_engine} Loading the training engine "
                                  "(torch)…")
        self.update_idletasks()
        self.deiconify()
        self._engine_id = self.after(ENGINE_AFTER_MS, self._import_engine)
        self._poll_id = self.after(self.poll_ms, self._poll)

    def _action(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """A button's command: the status line's old error goes before the action runs."""
        def act() -> Any:
            self.run_panel.clear_notice()
            return fn()
        return act

    # --- layout ------------------------------------------------------------------------------
    def _build_tabs(self) -> None:
        self.scroll_frames: dict[str, Any] = {}
        for group in groups_in_order():
            title = tab_title(group)
            scroll = ctk.CTkScrollableFrame(self.tabview.add(title), fg_color="transparent")
            scroll.pack(fill="both", expand=True)
            self.scroll_frames[title] = scroll
            if group == "Advanced":
                self.compile_panel = CompilePanel(scroll, self.binding, self.registry,
                                                  self.check_compilation)
                self.benchmark = BenchmarkSection(
                    self.compile_panel.box, self.binding,
                    lambda problems, title: self.problems_panel.show(
                        problems, title, source=lambda: self.binding.problems(check_files=True)),
                    lambda: self.training, self.bench_fn, self._benchmark_running)
                more = build_fields(scroll, fields_of_group(group, skip=PLACED), self.binding,
                                    self.registry, title)
            else:
                more = build_fields(scroll, fields_of_group(group), self.binding, self.registry,
                                    title)
            if more is not None:  # a click that opens it shows what it opened
                more.on_open = lambda scroll=scroll, button=more.button: self.reveal(scroll,
                                                                                     button)
        self.tabview.add(RUN_TAB)
        self.cloud_panel = CloudPanel(
            self.tabview.add(CLOUD_TAB), self.binding, self.settings,
            lambda fn, kind: run_in_thread(fn, self.events, kind),
            lambda: self.presets_bar.current.stem if self.presets_bar.current else "run",
            self._save_settings)
        self.tabview.set(tab_title(groups_in_order()[0]))

    def _on_config_change(self, path: str | None, _source: object | None) -> None:
        self.run_panel.clear_notice()
        self.problems_panel.schedule_recheck()
        if path is None or path == "model.type":
            update_component_states(self.registry, self.binding.config)
        if path is not None and not self.presets_bar.dirty:
            self.presets_bar.set_dirty(True)
        if path is None or path in ("output.dir", "training.max_steps"):
            self.refresh_resume()
        if path is None or path.endswith("cache_dir"):
            update_cache_hints(self.registry, self.binding.config)

    # --- navigation ----------------------------------------------------------------------------
    def jump_to(self, path: str) -> bool:
        """Switch to the field's tab, open its More section, scroll to it and focus it."""
        view = self.registry.find(path)
        if view is None:
            self.run_panel.set_status(f"{path}: no field in this window shows it", error=True)
            return False
        top = self.registry.top_path(view.path)
        tab = self.registry.tab_of.get(top) or self.registry.tab_of.get(view.path)
        self.tabview.set(tab)
        more = self.registry.more_of.get(top)
        if more is not None:
            more.expand()
        scroll = self.scroll_frames.get(tab)
        if scroll is not None:
            self.scroll_to(scroll, view.frame)
        view.focus()
        self.jumped_to = view
        return True

    def scroll_to(self, scroll: Any, widget: Any, above: int = 40) -> None:
        """Scroll the page so `widget` sits `above` pixels below its top edge (as far as the
        page's length allows)."""
        self.update_idletasks()
        canvas = scroll._parent_canvas  # its scroll region follows the content on <Configure>,
        canvas.configure(scrollregion=canvas.bbox("all"))  # which has not come yet
        content_height = max(scroll.winfo_reqheight(), 1)
        offset = widget.winfo_rooty() - scroll.winfo_rooty()  # from the content's top
        if content_height > canvas.winfo_height():
            canvas.yview_moveto(max(0.0, (offset - above) / content_height))

    def reveal(self, scroll: Any, button: Any) -> None:
        """After "More options" opens: when the button sits in the lower half of the page, the
        new fields would open below the fold, so the button is scrolled up to the top."""
        self.update_idletasks()
        canvas = scroll._parent_canvas
        if button.winfo_rooty() - canvas.winfo_rooty() > canvas.winfo_height() / 2:
            self.scroll_to(scroll, button, above=8)

    # --- training ----------------------------------------------------------------------------
    @property
    def training(self) -> bool:
        return self.worker is not None and self.worker.running

    def start_training(self, resume: bool = False) -> bool:
        """Check what a start checks (config and inputs) and start the worker; problems are
        listed instead. `resume` continues the output folder's newest backup."""
        if self.worker is not None:
            return False
        if self.benchmark.running:
            self.run_panel.set_status("A benchmark is running (Advanced Options); stop it or "
                                      "wait, so the two do not share the machine.", error=True)
            return False
        if self.checking:
            self.run_panel.set_status("Check compilation is running (Advanced Options); wait "
                                      "for its report: it resets torch's compiler state, which "
                                      "the training's compiled code lives in.", error=True)
            return False
        problems = self.start_problems(resume)
        if problems:
            self.problems_panel.show(problems, source=lambda: self.start_problems(resume))
            self.run_panel.set_status(f"Cannot start: {len(problems)} problem(s).", error=True)
            return False
        config = self.binding.snapshot()
        if resume:
            config.training.resume_from = "latest"
        self.problems_panel.hide()
        self.run_panel.reset()
        if resume:
            self._show_earlier_run(config)
        self.set_running(True)
        self.expected_compile = frontend.expected_compile(config)
        self.run_panel.set_status("Resuming…" if resume else "Starting…")
        self.run_panel.log(("resuming" if resume else "starting") +
                           f" training into {config.output.dir}")
        self.tabview.set(RUN_TAB)
        self.last_result = None
        self.worker = TrainingWorker(config, self.events, self.train_fn)
        self.worker.start()
        return True

    def _show_earlier_run(self, config: Config) -> None:
        """A resumed run continues a curve and samples: show the earlier losses (run.json) up
        to the backup it resumes from, and the newest samples, before its first step."""
        output = Path(config.output.dir).expanduser()
        backups = frontend.list_backups(output)
        if not backups:
            return
        step = backups[-1][0]
        points = frontend.earlier_losses(output, step)
        self.run_panel.show_earlier_losses(points)
        sample_step, samples = frontend.latest_samples(output, step)
        prompts = config.sampling.prompts
        for index, path in samples:
            self._show_sample(path, prompts[index] if index < len(prompts) else "", sample_step)
        self.run_panel.log(f"the run so far: {len(points)} losses up to step {step}"
                           + (f", samples of step {sample_step}" if samples else ""))

    def start_problems(self, resume: bool = False) -> list[Problem]:
        """What a start checks: unparsable fields, the config, and the model, datasets and
        output folder it names (the CLI's --check runs the same)."""
        config = self.binding.snapshot()
        if resume:
            config.training.resume_from = "latest"
        problems = self.binding.field_problems() + frontend.check(config)
        if resume:  # the button is off for a finished run; this holds if it is pressed anyway
            finished = frontend.finished_run_problem(self.output_dir(), "latest",
                                            config.training.max_steps)
            problems += [finished] if finished else []
        return problems

    def resume_training(self) -> bool:
        return self.start_training(resume=True)

    def _block_start(self, key: str, why_not: str | None) -> None:
        """Refuse Start (and Resume) for `why_not` until the same `key` passes None; with
        several reasons at once, Start waits for all of them and shows the first."""
        if why_not is None:
            self._start_blockers.pop(key, None)
        else:
            self._start_blockers[key] = why_not
        reasons = list(self._start_blockers.values())
        self.run_panel.set_start_allowed(not reasons, reasons[0] if reasons else "")

    @property
    def checking(self) -> bool:
        """Check compilation is running (in a thread of this process)."""
        return "check" in self._start_blockers

    def _benchmark_running(self, running: bool) -> None:
        """A benchmark and a training must not share the machine: Start waits meanwhile."""
        self._block_start("benchmark", "a benchmark is running (Advanced Options): stop it or "
                                       "let it finish" if running else None)
        if not running:
            self.run_panel.clear_notice()

    def set_running(self, running: bool) -> None:
        """Run controls, and what must not run beside a training (Check compilation resets
        torch's compiler state process-wide and loads a second model)."""
        self.run_panel.set_running(running)
        self.compile_panel.set_check_enabled(not running, "not while training: it would reset "
                                             "the running training's compiled code")
        if not running:
            self.refresh_resume()

    def refresh_resume(self) -> None:
        """Offer Resume when the output folder holds backups of a run that ended early (and
        say how it ended); a finished run only offers to continue when Max steps was raised
        above its end (`modules/train/resume_offer.py` decides, as it does for the CLI)."""
        output = self.output_dir()
        found = frontend.list_backups(output)
        offer = frontend.resume_offer(output, self.binding.config.training.max_steps)
        self.run_panel.show_backups(output, [step for step, _ in found], offer,
                                    can_resume=offer.can_resume and not self.training,
                                    ended=frontend.read_run_status(output))

    def stop_training(self) -> None:
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

    def _poll(self) -> None:
        try:
            self._drain_events()
        finally:
            if not self.closed:
                self._poll_id = self.after(self.poll_ms, self._poll)

    @property
    def closed(self) -> bool:
        return getattr(self, "_tempera_closed", False)

    @tk_thread_only
    def _drain_events(self) -> None:
        redraw = False
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
            redraw |= event.kind == "progress"
            try:
                self._handle(event)
            except Exception:  # a display bug must not stop the queue: report it, go on
                import traceback
                self.run_panel.log(f"ERROR (window) could not show a {event.kind!r} event:\n"
                                   + traceback.format_exc())
                self.run_panel.set_status(f"Window error while showing {event.kind!r}; "
                                          "see the log in the Run tab.", error=True)
            if self.closed:
                return
        if redraw:
            self.run_panel.redraw_plot()

    def _handle(self, event: Event) -> None:
        panel, kind, data = self.run_panel, event.kind, event.payload
        if kind == "status":
            panel.set_status(data)
            panel.log(data)
        elif kind == "progress":
            panel.show_progress(data)
        elif kind == "sample":
            self._show_sample(*data)
        elif kind == "compile":
            seconds = f" ({data.seconds:.1f} s)" if data.seconds else ""
            text = f"compile {data.component}: {data.message}{seconds}"
            warn = data.kind in ("fallback", "degraded", "warning", "recompile")
            panel.set_status(text, error=warn)  # one short sentence
            panel.log(("WARNING " if warn else "") + text
                      + (f"\n{data.detail}" if data.detail else ""))  # the full text
            if data.kind == "progress":
                panel.show_compiling(data.message, self.expected_compile, data.graph,
                                     data.component)
        elif kind == "saved":
            panel.log(f"saved {data[0]} at step {data[1]}")
        elif kind == "error":
            panel.set_status(data, error=True)
            panel.log("ERROR " + data)
        elif kind == "done":
            self.last_result = data
            panel.set_status(f"{data.status}: {data.steps} steps; outputs in {data.output_dir}")
        elif kind == "config_error":
            self.problems_panel.show(data)
            panel.set_status(f"Cannot start: {len(data)} problem(s).", error=True)
        elif kind in ("failed", "crashed"):
            last = data.strip().splitlines()[-1] if data.strip() else kind
            panel.set_status(f"Training {kind}: {last}", error=True)
            panel.log(f"ERROR training {kind}: {data}")
        elif kind == "exit":
            self.worker = None
            self.set_running(False)
            if self.closing:
                self._finish_close()
        elif kind == "report":
            self._show_report(*data)
        elif kind == "cloud_push":
            self.cloud_panel.on_pushed(*data)
            self.run_panel.log("cloud: " + self.cloud_panel.status.cget("text"))
        elif kind == "cloud_status":
            self.cloud_panel.on_status(*data)

    def _import_engine(self) -> None:
        """torch and the compile engine, imported once the window is on screen."""
        self._engine_id = None
        try:
            frontend.load_engine()  # imports torch
        except Exception as exc:  # training would fail the same way: say so now
            import traceback
            self.run_panel.set_status(f"The training engine could not be loaded: {exc}",
                                      error=True)
            self.run_panel.log("ERROR the training engine could not be loaded:\n"
                               + traceback.format_exc())
            return
        self.engine_ready = True
        self.compile_panel.load_summaries()
        if self.run_panel.status_text.endswith("Loading the training engine (torch)…"):
            self.run_panel.set_status(self._status_before_engine)  # nothing newer was said

    def _show_sample(self, path: Path, prompt: str, step: int) -> None:
        try:
            self.run_panel.show_sample(path, prompt, step)
        except OSError as exc:
            self.run_panel.log(f"ERROR could not show sample {path}: {exc}")
            return
        self.run_panel.log(f"sample at step {step}: {path}")

    # --- compile check -----------------------------------------------------------------------
    def check_compilation(self) -> None:
        explain = self.explain_fn or frontend.explain
        panel = self.compile_panel
        if self.binding.errors:
            self.problems_panel.show(self.binding.field_problems(), "Fix these fields first",
                               source=self.binding.field_problems)
            return
        if self.training or self.checking:
            return
        config = self.binding.snapshot()
        panel.set_check_enabled(False, "checking…")
        # Both would share dynamo's process-wide state: the check resets it and compiles
        self._block_start("check", "Check compilation is running (Advanced Options): wait for "
                                   "its report")
        panel.show_report(f"Checking {config.compile.backend.value}… (this traces the model "
                          "once; it can take a while)")
        run_in_thread(lambda: explain(config), self.events, "report")

    def _show_report(self, ok: bool, value: Any) -> None:
        self._block_start("check", None)
        self.compile_panel.set_check_enabled(not self.training)
        if not ok and isinstance(value, ConfigError):
            self.problems_panel.show(value.problems)
            text = f"Cannot check: {len(value.problems)} problem(s), listed below the tabs."
        elif not ok:
            text = f"The check failed:\n{getattr(value, 'formatted_traceback', value)}"
        else:
            text = format_report(value)
        self.compile_panel.show_report(text, result=True)
        self.run_panel.log("compilation check " + ("done" if ok else "failed"))

    # --- outputs -----------------------------------------------------------------------------
    def output_dir(self) -> Path:
        return Path(self.binding.config.output.dir).expanduser()

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

    # --- closing -----------------------------------------------------------------------------
    def _save_settings(self) -> None:
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as exc:
            self.run_panel.log(f"could not save GUI settings {self.settings_path}: {exc}")

    def on_close(self) -> None:
        """Unsaved edits are saved, discarded or keep the window open, as the user answers;
        closing while training asks, requests stop and waits for the clean save first."""
        if self.closing:
            return
        presets = self.presets_bar
        if presets.dirty:
            name = presets.current.name if presets.current else "the settings"
            answer = self.ask_unsaved(
                "Save your changes?", f"The settings were changed since {name} was loaded or "
                "saved. Save them before closing? (No closes without saving.)")
            if answer is None:
                return
            if answer and presets.save() is None:  # Save as… cancelled, or the save failed
                return
        if self.training:
            if not self.confirm("Training is running",
                                "Stop training, save a checkpoint and close the window?"):
                return
            self.closing = True
            self.stop_training()
            self.run_panel.set_status("Stopping and saving before the window closes…")
            return
        self._finish_close()

    def _finish_close(self) -> None:
        self.settings.geometry = self.geometry()
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as exc:
            print(f"[tempera] could not save GUI settings {self.settings_path}: {exc}")
        if self.tensorboard is not None and self.tensorboard.poll() is None:
            self.tensorboard.terminate()
        self.compile_panel.cancel_pending()
        if self._engine_id is not None:
            self.after_cancel(self._engine_id)
        self.benchmark.stop()
        self._tempera_closed = True
        self.sizing.close()
        self.destroy()


__all__ = ["TemperaApp", "apply_scaling"]
