"""The Tempera window: a composer of the preset bar, the tabs generated from the config schema,
the problems panel and the run controls.

Each part owns its widgets and state (`presets_bar.py`, `problems_panel.py`, `window_size.py`,
`run_panel.py`, `compile_panel.py`, `cloud_panel.py`, `benchmark_panel.py`, the Data tab's
`caption_editor.py`); the window wires them with callbacks. It holds one Config (in
`ConfigBinding`). Training runs in a worker thread (`app.runner`); its events arrive on a
queue that `_poll` drains on the Tk thread via `after()`.
"""
from __future__ import annotations

import functools
import queue
from collections.abc import Callable
from pathlib import Path
from tkinter import messagebox
from typing import Any

import customtkinter as ctk

from app.benchmark_panel import BenchFn, BenchmarkSection
from app.binding import ConfigBinding
from app.caption_editor import CaptionEditor
from app.cloud_panel import TAB as CLOUD_TAB, CloudPanel
from app.lora_tools_panel import TAB as LORA_TOOLS_TAB, LoraToolsPanel
from app.compile_check import CompileCheck
from app.compile_panel import PLACED, CompilePanel
from app.curtain import Curtain
from app.engine_loader import EVENT as ENGINE_EVENT, LOADING, EngineLoader
from app.field_states import (LEVER_PATHS, take_only_values, update_cache_hints,
                              update_component_states, update_storage_hint,
                              update_unused_fields)
from app.form import (FieldRegistry, build_fields, fields_of_group, groups_in_order, reveal,
                      scroll_to, tab_title)
from app.presets import BUILTIN_PRESETS_DIR
from app.presets_bar import PresetsBar
from app.problems_panel import ProblemsPanel
from app.replace_dialog import AskReplace, ask_replace as replace_dialog
from app.run_panel import RunPanel
from app.run_control import TRAINING_EVENTS, RunControl
from app.schedule_preview import SchedulePreview
from app.runner import Event, TrainFn, run_in_thread
from app.settings import default_settings_path, load_settings, save_settings
from app.thread_guard import ThreadGuard, tk_thread_only
from app.text_boxes import bind_select_all
from app.window_size import WindowSizing, apply_scaling, place_window
from modules import frontend
from modules.config import Config, ConfigError

RUN_TAB = "Run"
LOADING_STATUS = "Loading the training engine (torch)…"
STARTING = "Tempera is starting: building the {} tab…"


def ask_yes_no(title: str, message: str) -> bool:
    return messagebox.askyesno(title, message)


def ask_yes_no_cancel(title: str, message: str) -> bool | None:
    """Yes (True), No (False) or Cancel (None)."""
    return messagebox.askyesnocancel(title, message)


class TemperaApp(ctk.CTk):
    # made in __init__ after the callbacks that use them (which run later)
    run_panel: RunPanel
    runs: RunControl
    caption_editor: CaptionEditor  # made with the Data tab

    def __init__(self, settings_path: Path | None = None, builtin_presets_dir: Path | None = None,
                 train_fn: TrainFn | None = None, confirm: Callable[[str, str], bool] | None = None,
                 ask_save_path: Callable[[Path], str | None] | None = None,
                 explain_fn: Callable[[Config], Any] | None = None, poll_ms: int = 50,
                 bench_fn: BenchFn | None = None,
                 initial_preset: Path | None = None,
                 ask_unsaved: Callable[[str, str], bool | None] | None = None,
                 load_engine: Callable[[], None] | None = None,
                 ask_replace: AskReplace | None = None) -> None:
        """`load_engine` imports the training engine (default `frontend.load_engine`, which
        imports torch); the window calls it once, in a thread, after it is shown.
        `ask_replace`: what Start asks before it replaces the output folder's run (default
        the dialog of `app.replace_dialog`)."""
        self.settings_path = Path(settings_path or default_settings_path()).expanduser()
        self.settings, settings_warning = load_settings(self.settings_path)
        apply_scaling(self.settings.scaling)
        super().__init__()
        self.title("Tempera")
        place_window(self, self.settings)
        # On screen at once, at its size, covered by a line saying what is being built; the
        # form is laid out behind it and uncovered once complete (`app.curtain` says why).
        self.curtain = Curtain(self)
        self.curtain.show(STARTING.format(tab_title(groups_in_order()[0])), self.settings.scaling)
        self.poll_ms = poll_ms
        self.bench_fn = bench_fn
        self.confirm = confirm or ask_yes_no
        self.ask_unsaved = ask_unsaved or ask_yes_no_cancel  # save / discard / cancel
        self.guard = ThreadGuard()
        self.binding = ConfigBinding()
        self.registry = FieldRegistry()
        self.binding.subscribe(self.registry.on_change)
        self.events: "queue.Queue[Event]" = queue.Queue()
        self.engine = EngineLoader(load_engine or frontend.load_engine, self.events)
        self._engine_id: str | None = None
        self.closing = False

        self.grid_columnconfigure(0, weight=1)
        self.grid_rowconfigure(1, weight=1)
        self.tabview = ctk.CTkTabview(self)
        self.tabview.grid(row=1, column=0, sticky="nsew", padx=8)
        self.curtain.lift()
        self._build_tabs()
        bar = ctk.CTkFrame(self)
        bar.grid(row=0, column=0, sticky="ew", padx=8, pady=(8, 0))
        self.curtain.lift()
        self.sizing = WindowSizing(self, bar, self.tabview, self.registry, self.settings,
                                   self._save_settings)
        self.presets_bar = PresetsBar(
            bar, self.binding, self.settings, Path(builtin_presets_dir or BUILTIN_PRESETS_DIR),
            confirm=self.confirm, ask_save_path=ask_save_path,
            show_problems=lambda *args, **kw: self.problems_panel.show(*args, **kw),
            hide_problems=lambda: self.problems_panel.hide(),
            set_status=lambda text, error=False: self.run_panel.set_status(text, error),
            log=lambda line: self.run_panel.log(line), set_title=self.title,
            loaded=lambda: self._preset_loaded(), action=self._action)
        self.problems_panel = ProblemsPanel(
            self, self.registry, self.jump_to,
            lambda: self.run_panel.set_status("Every listed problem is fixed."))
        self.run_panel = RunPanel(self, self.tabview.tab(RUN_TAB), self.guard, {
            key: self._action(functools.partial(self._run_control, name)) for key, name in (
                ("start", "start"), ("resume", "resume"), ("stop", "stop"),
                ("sample", "sample_now"), ("save", "save_now"),
                ("open_output", "open_output_folder"), ("tensorboard", "start_tensorboard"))})
        self.run_panel.bar.grid(row=3, column=0, sticky="ew", padx=8, pady=(4, 8))
        self.curtain.lift()
        self.run_panel.idle_text = self._idle_status
        self.sizing.set_compact = self.run_panel.set_compact
        self.sizing.pages = list(self.scroll_frames.values())
        self.runs = RunControl(
            self.binding, self.events, train_fn, self.run_panel, self.problems_panel,
            benchmark_running=lambda: self.benchmark.running,
            set_check_enabled=self.compile_panel.set_check_enabled,
            show_run_tab=lambda: self.tabview.set(RUN_TAB),
            ask_replace=ask_replace or functools.partial(replace_dialog, self))
        self.compile_check = CompileCheck(self.binding, self.compile_panel, self.problems_panel,
                                          self.runs, self.run_panel, self.events, explain_fn)
        self.binding.subscribe(self._on_config_change)
        self.protocol("WM_DELETE_WINDOW", self.on_close)
        bind_select_all(self)
        if settings_warning:
            self.run_panel.log(settings_warning)
        self.presets_bar.load_initial(initial_preset)
        update_component_states(self.registry, self.binding.config)
        update_unused_fields(self.registry, self.binding.config)
        update_cache_hints(self.registry, self.binding.config)
        self.runs.refresh_resume()
        # Importing torch took seconds with nothing on screen, then seconds of a frozen grey
        # window: the window is built without it, shown, and imports it in a thread
        # (`app.engine_loader`) while it stays drawn and editable. What needs the engine
        # waits for it, saying why: Start, Resume, Check compilation, the plan's line.
        self.compile_panel.cancel_pending()
        self.runs.block_start("engine", LOADING)
        self._status_before_engine = self.run_panel.status_text
        self.run_panel.set_status(f"{self._status_before_engine} {LOADING_STATUS}")
        self.sizing.fit_columns()  # the columns fitted to the window's width, still covered
        self.curtain.hide()  # and painted: the engine's import cannot slow the first paint
        self._engine_id = self.after_idle(self._load_engine)
        self._poll_id = self.after(self.poll_ms, self._poll)

    def _run_control(self, name: str) -> Any:
        """Call the run control's `name` (a Run tab button; `runs` is made after the buttons)."""
        return getattr(self.runs, name)()

    def _idle_status(self) -> str:
        """The status line when nothing newer is to be said: what is true now."""
        if self.runs.training:
            return "Training is running."
        if self.problems_panel.is_open and self.problems_panel.problems:
            return (f"{len(self.problems_panel.problems)} problem(s) listed below the tabs: "
                    "click one to go to its field.")
        if self.engine.loading:
            return LOADING_STATUS
        return "Ready."

    def _preset_loaded(self) -> None:
        """Another preset: the Run tab's steps, ETA, curve and samples were another run's."""
        if not self.runs.training:
            self.run_panel.reset("the latest samples appear here")
        self.runs.refresh_resume()

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
            self.curtain.say(STARTING.format(title), self.settings.scaling)
            scroll = ctk.CTkScrollableFrame(self.tabview.add(title), fg_color="transparent")
            scroll.pack(fill="both", expand=True)
            self.scroll_frames[title] = scroll
            if group == "Advanced":
                self.compile_panel = CompilePanel(scroll, self.binding, self.registry,
                                                  lambda: self.compile_check.start())
                self.benchmark = BenchmarkSection(
                    self.compile_panel.box, self.binding,
                    lambda problems, title: self.problems_panel.show(
                        problems, title, source=lambda: self.binding.problems(check_files=True)),
                    lambda: self.runs.training, self.bench_fn,
                    lambda running: self.runs.benchmark_changed(running))
                more = build_fields(scroll, fields_of_group(group, skip=PLACED), self.binding,
                                    self.registry, title)
            else:
                more = build_fields(scroll, fields_of_group(group), self.binding, self.registry,
                                    title)
            if group == "Data":  # below the dataset settings: their captions, image by image
                self.caption_editor = CaptionEditor(scroll, self.binding, self.guard,
                                                    lambda *ask: self.ask_unsaved(*ask),
                                                    self.prep_busy)
                self.caption_editor.frame.pack(fill="x", anchor="nw", padx=4, pady=(12, 4))
            if more is not None:  # a click that opens it shows what it opened
                more.on_open = lambda scroll=scroll, button=more.button: reveal(scroll, button)
        self.schedule_preview = SchedulePreview(self.registry.find("training.lr_scheduler"),
                                                self.binding)
        self.tabview.add(RUN_TAB)
        self.cloud_panel = CloudPanel(
            self.tabview.add(CLOUD_TAB), self.binding, self.settings,
            lambda fn, kind: run_in_thread(fn, self.events, kind),
            lambda: self.presets_bar.current.stem if self.presets_bar.current else "run",
            self._save_settings)
        self.lora_tools = LoraToolsPanel(self.tabview.add(LORA_TOOLS_TAB),
                                         cache_dir=lambda: self.binding.config.general.cache_dir)
        self.tabview.set(tab_title(groups_in_order()[0]))

    def _on_config_change(self, path: str | None, _source: object | None) -> None:
        self.run_panel.clear_notice()
        self.problems_panel.schedule_recheck()
        if path is None or path == "model.type":
            update_component_states(self.registry, self.binding.config)
        if path == "model.type":  # chosen here (a preset is loaded as it is, and checked)
            self._take_only_values()
        update_unused_fields(self.registry, self.binding.config)  # cheap: states that change
        if path is not None and not self.presets_bar.dirty:
            self.presets_bar.set_dirty(True)
        if path is None or path in ("output.dir", "training.max_steps"):
            self.runs.refresh_resume()
        if path is None or path.endswith("cache_dir"):
            update_cache_hints(self.registry, self.binding.config)
        if path in LEVER_PATHS and self.engine_ready:
            update_storage_hint(self.registry, self.binding.config)

    def _take_only_values(self) -> None:
        """The settings the new model type allows one value of take it, and the status line
        says which (they may sit on another tab)."""
        changed = take_only_values(self.binding, self.registry)
        if changed:
            label = frontend.MODEL_TYPES[self.binding.config.model.type].label
            text = f"{label} allows one value of these, now set: {'; '.join(changed)}."
            self.run_panel.set_status(text)
            self.run_panel.log(text)

    # --- navigation ----------------------------------------------------------------------------
    def jump_to(self, path: str) -> bool:
        """Switch to the field's tab, open its More section, scroll to it and focus it."""
        view = self.registry.find(path)
        if view is None:
            self.run_panel.set_status(f"{path}: no field in this window shows it", error=True)
            return False
        top = self.registry.top_path(view.path)
        tab = self.registry.tab_of.get(top) or self.registry.tab_of[view.path]
        self.tabview.set(tab)
        more = self.registry.more_of.get(top)
        if more is not None:
            more.expand()
        scroll = self.scroll_frames.get(tab)
        if scroll is not None:
            scroll_to(scroll, view.frame)
        view.focus()
        self.jumped_to = view
        return True

    # --- events ------------------------------------------------------------------------------
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

    def report_callback_exception(self, exc: type[BaseException], value: BaseException,
                                  tb: Any) -> None:
        """A button's command or an `after()` raised (Tk's default printed it on the terminal
        only, and the window said "Ready."): a config refusal, whichever check raised it, is
        listed below the tabs and marked at its fields; anything else is said in the status
        line and the log. The terminal still gets the traceback."""
        super().report_callback_exception(exc, value, tb)
        if isinstance(value, ConfigError):
            self.problems_panel.show(value.problems, f"Refused: {len(value.problems)} "
                                     "problem(s). Click one to go to its field.")
            self.run_panel.set_status(f"Refused: {len(value.problems)} problem(s), listed "
                                      "below the tabs.", error=True)
            return
        import traceback
        self.run_panel.log("ERROR (window) " + "".join(traceback.format_exception(exc, value, tb)))
        self.run_panel.set_status(f"Window error: {exc.__name__}: {value}; see the log in the "
                                  "Run tab.", error=True)

    def _handle(self, event: Event) -> None:
        kind, data = event.kind, event.payload
        if kind in TRAINING_EVENTS:
            self.runs.show_event(kind, data)
            if kind == "exit" and self.closing:
                self._finish_close()
        elif kind == ENGINE_EVENT:
            self._engine_loaded(*data)
        elif kind == "report":
            self.compile_check.show_report(*data)
        elif kind == "cloud_push":
            self.cloud_panel.on_pushed(*data)
            self.run_panel.log("cloud: " + self.cloud_panel.status.cget("text"))
        elif kind == "cloud_status":
            self.cloud_panel.on_status(*data)

    def _load_engine(self) -> None:
        if self.engine.thread is not None or self.closed:
            return
        if self._engine_id is not None:
            self.after_cancel(self._engine_id)
        self._engine_id = None
        config = self.binding.snapshot()
        # what the configured device can compile with: triton and the trainer's modules load too
        self.engine.start(lambda: self.compile_panel.detect(config))

    @property
    def engine_ready(self) -> bool:
        """The training engine (torch) is imported: what needs it can run."""
        return self.engine.ready

    def _engine_loaded(self, ok: bool, value: Any) -> None:
        """The engine's import ended (`app.engine_loader`): on success Start and Check
        compilation are free and the plan's torch.compile(...) line is shown."""
        self.engine.finished(ok)
        loading = self.run_panel.status_text.endswith(LOADING_STATUS)
        if not ok:  # training would fail the same way: say so now, and keep Start refused
            why = f"the training engine could not be loaded: {value}"
            self.runs.block_start("engine", why)
            self.run_panel.set_status(why[0].upper() + why[1:], error=True)
            self.run_panel.log("ERROR the training engine could not be loaded:\n"
                               + getattr(value, "formatted_traceback", str(value)))
            return
        self.runs.block_start("engine", None)
        self.compile_panel.load_summaries(value)
        update_storage_hint(self.registry, self.binding.config)
        if loading:  # nothing newer was said than what the load was added to
            status = self.run_panel.status_text
            self.run_panel.set_status(self._idle_status() if status == LOADING_STATUS
                                      else self._status_before_engine)

    def prep_busy(self) -> str | None:
        """Why a caption or mask job may not start now: its model would share the device
        with a training run or a benchmark (None: it may)."""
        if self.runs.training:
            return "a training run is running; a caption or mask model would share the " \
                   "device with it: start the job when the run has ended"
        if self.benchmark.running:
            return "a benchmark is running; start the job when it has ended"
        return None

    # --- closing -----------------------------------------------------------------------------
    def _save_settings(self) -> None:
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as exc:
            self.run_panel.log(f"could not save GUI settings {self.settings_path}: {exc}")

    def on_close(self) -> None:
        """Unsaved edits are saved, discarded or keep the window open, as the user answers;
        closing while training asks, requests stop and waits for the clean save first."""
        if self.closing or not self.caption_editor.leave():  # its unsaved caption first
            return
        presets = self.presets_bar
        if presets.dirty:
            name = presets.display_name() if presets.current else "the settings"
            answer = self.ask_unsaved(
                "Save your changes?", f"The settings were changed since {name} was loaded or "
                "saved. Save them before closing? (No closes without saving.)")
            if answer is None:
                return
            if answer and presets.save() is None:  # Save as… cancelled, or the save failed
                return
        if self.runs.training:
            if not self.confirm("Training is running",
                                "Stop training, save a checkpoint and close the window?"):
                return
            self.closing = True
            self.runs.stop()
            self.run_panel.set_status("Stopping and saving before the window closes…")
            return
        self._finish_close()

    def _finish_close(self) -> None:
        self.settings.geometry = self.geometry()
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as exc:
            print(f"[tempera] could not save GUI settings {self.settings_path}: {exc}")
        self.runs.close()
        self.compile_panel.cancel_pending()
        if self._engine_id is not None:
            self.after_cancel(self._engine_id)
        self.engine.close()
        self.benchmark.stop()
        self._tempera_closed = True
        self.sizing.close()
        self.withdraw()  # off the screen now: destroying its widgets takes a second
        self.update_idletasks()
        self.destroy()


__all__ = ["TemperaApp"]
