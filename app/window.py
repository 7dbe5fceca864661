"""The Tempera window: preset bar, tabs generated from the config schema, run controls.

The window holds one Config (in `ConfigBinding`). Training runs in a worker thread
(`app.runner`); its events arrive on a queue that `_poll` drains on the Tk thread via `after()`.
"""
from __future__ import annotations

import queue
import re
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
from app.dialogs import ask_save_file
from app.fields import container_labels
from app.form import FieldRegistry, build_fields, fields_of_group, groups_in_order, tab_title
from app.presets import (BUILTIN_PRESETS_DIR, BuiltinPresetError, PresetEntry, is_builtin,
                         list_presets, save_preset)
from app.run_panel import RunPanel
from app.runner import Event, TrainFn, TrainingWorker, run_in_thread
from app.settings import DEFAULT_SETTINGS_PATH, SCALES, load_settings, save_settings
from app.thread_guard import ThreadGuard, tk_thread_only
from app.widgets import bind_select_all, grid_hide, set_label_enabled
from modules.config import Config, ConfigError, Problem, load_config, validate
from modules.model_types import MODEL_TYPES
from modules.train.inputs import check_inputs

RUN_TAB = "Run"
FIT_MS = 120  # the columns are fitted this long after the window's size settles
TENSORBOARD_URL = f"http://127.0.0.1:{external.TENSORBOARD_PORT}"
RECHECK_MS = 400  # a listed problem is checked again this long after the last edit
NO_PRESET = "(no presets found)"
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
        self.geometry(fit_geometry(self.settings.geometry, (self.winfo_screenwidth(),
                                   self.winfo_screenheight()), self.settings.scaling))
        self.fit_minsize(self.settings.scaling)
        self.engine_ready = False  # the engine's heavy imports are done (`_import_engine`)
        self.builtin_dir = Path(builtin_presets_dir or BUILTIN_PRESETS_DIR)
        self.train_fn, self.explain_fn, self.poll_ms = train_fn, explain_fn, poll_ms
        self.bench_fn = bench_fn
        self.confirm = confirm or ask_yes_no
        self.ask_unsaved = ask_unsaved or ask_yes_no_cancel  # save / discard / cancel
        self.ask_save_path = ask_save_path or self._ask_save_path
        self.guard = ThreadGuard()
        self.binding = ConfigBinding()
        self.registry = FieldRegistry()
        self.binding.subscribe(self.registry.on_change)
        self.events: "queue.Queue[Event]" = queue.Queue()
        self.worker: TrainingWorker | None = None
        self.current_preset: Path | None = None
        self.tensorboard: subprocess.Popen | None = None
        self.problem_buttons: list[Any] = []
        self.problems: list[Problem] = []
        self._problem_source: Callable[[], list[Problem]] | None = None
        self._problem_marks: list[Any] = []  # views showing a listed problem
        self._recheck_id: str | None = None
        self.closing = False
        self.last_result: Any = None
        # What keeps Start (and Resume) refused, by who asked: a benchmark, a compilation check
        self._start_blockers: dict[str, str] = {}

        self.grid_columnconfigure(0, weight=1)
        self.grid_rowconfigure(1, weight=1)
        self.tabview = ctk.CTkTabview(self)
        self.tabview.grid(row=1, column=0, sticky="nsew", padx=8)
        self._build_tabs()
        self._build_top_bar()
        self._build_problems_panel()
        self.run_panel = RunPanel(self, self.tabview.tab(RUN_TAB), self.guard, {
            key: self._action(fn) for key, fn in (
                ("start", self.start_training), ("resume", self.resume_training),
                ("stop", self.stop_training), ("sample", self.sample_now),
                ("save", self.save_now), ("open_output", self.open_output_folder),
                ("tensorboard", self.start_tensorboard))})
        self.run_panel.bar.grid(row=3, column=0, sticky="ew", padx=8, pady=(4, 8))
        self.binding.subscribe(self._on_config_change)
        self.dirty = False  # edits since the preset was loaded or saved
        self.expected_compile: Any = None  # a CompileExpectation while a run compiles
        self.protocol("WM_DELETE_WINDOW", self.on_close)
        bind_select_all(self)
        self._fit_id: str | None = None
        self.bind("<Configure>", self._resized, add="+")
        if settings_warning:
            self.run_panel.log(settings_warning)
        self._load_initial(initial_preset)
        self._update_component_states()
        self._update_cache_hints()
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
                    lambda problems, title: self.show_problems(
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
            lambda: self.current_preset.stem if self.current_preset else "run",
            self._save_settings)
        self.tabview.set(tab_title(groups_in_order()[0]))

    def _build_top_bar(self) -> None:
        bar = ctk.CTkFrame(self)
        bar.grid(row=0, column=0, sticky="ew", padx=8, pady=(8, 0))
        # Packed first, so a narrow window clips the preset controls, never the way back
        # from a too-large scale.
        self.scale_menu = ctk.CTkOptionMenu(bar, values=[f"{int(s * 100)}%" for s in SCALES],
                                            width=90, command=self._scale_chosen)
        self.scale_menu.set(f"{int(self.settings.scaling * 100)}%")
        self.scale_menu.pack(side="right", padx=(4, 10))
        ctk.CTkLabel(bar, text="UI scale").pack(side="right")
        ctk.CTkLabel(bar, text="Preset").pack(side="left", padx=(10, 6), pady=6)
        self.preset_menu = ctk.CTkOptionMenu(bar, values=[NO_PRESET], width=300,
                                             dynamic_resizing=False)
        self.preset_menu.pack(side="left")
        for text, command in (("Load", self.load_selected_preset), ("Save", self.save),
                              ("Save as…", self.save_as)):
            ctk.CTkButton(bar, text=text, width=80, command=self._action(command)).pack(
                side="left", padx=3)
        self.refresh_presets()

    def _build_problems_panel(self) -> None:
        self.problems_frame = ctk.CTkFrame(self, border_width=2, border_color=("#c62828", "#ef5350"))
        head = ctk.CTkFrame(self.problems_frame, fg_color="transparent")
        head.pack(fill="x", padx=8, pady=(6, 0))
        self.problems_title = ctk.CTkLabel(head, text="", anchor="w",
                                           font=ctk.CTkFont(weight="bold"))
        self.problems_title.pack(side="left")
        ctk.CTkButton(head, text="✕", width=28, command=self.hide_problems).pack(side="right")
        self.problems_list = ctk.CTkScrollableFrame(self.problems_frame, height=110,
                                                    fg_color="transparent")
        self.problems_list.pack(fill="x", padx=4, pady=(0, 6))

    # --- presets -----------------------------------------------------------------------------
    def refresh_presets(self) -> None:
        self.presets: list[PresetEntry] = list_presets(self.builtin_dir,
                                                       self.settings.user_presets_path)
        labels = [p.label for p in self.presets] or [NO_PRESET]
        self.preset_menu.configure(values=labels)
        current = next((p.label for p in self.presets if self.current_preset
                        and p.path.resolve() == self.current_preset.resolve()), None)
        if current is None and self.current_preset is not None:
            current = self.current_preset.name  # a file from elsewhere (--config): its name
        self.preset_menu.set(current or labels[0])

    def _load_initial(self, initial: Path | None) -> None:
        candidates = [initial, Path(self.settings.last_preset) if self.settings.last_preset
                      else None, self.builtin_dir / "demo.json"]
        for path in candidates:
            if path is not None and Path(path).is_file():
                self.load_preset(Path(path))
                return
        self.run_panel.set_status("Ready: default settings (no preset loaded).")

    def load_selected_preset(self) -> bool:
        entry = next((p for p in self.presets if p.label == self.preset_menu.get()), None)
        if entry is None:
            return False
        if self.dirty and not self.confirm(
                "Discard your changes?", "The settings were changed since the preset was loaded "
                f"or saved. Load {entry.label} and lose those changes?"):
            self.refresh_presets()  # the menu shows what is still loaded, not the declined one
            return False
        return self.load_preset(entry.path)

    def set_dirty(self, dirty: bool) -> None:
        """Mark unsaved edits in the title ("*"), as editors do."""
        self.dirty = dirty
        name = self.current_preset.name if self.current_preset else "unsaved settings"
        self.title(f"Tempera — {name}{' *' if dirty else ''}")

    def load_preset(self, path: Path) -> bool:
        """Load a preset file into the window; its problems are listed, nothing crashes."""
        try:
            config = load_config(path)
        except ConfigError as exc:
            self.show_problems(exc.problems, f"{path} could not be loaded", keys=True)
            self.run_panel.set_status(f"Could not load {path}: {len(exc.problems)} problem(s).",
                                      error=True)
            return False
        self.binding.replace(config)
        self.current_preset = Path(path)
        self.settings.last_preset = str(Path(path).resolve())
        self.set_dirty(False)
        self.refresh_resume()
        self.refresh_presets()
        self.hide_problems()
        self.run_panel.set_status(f"Loaded {path}.")
        return True

    def save(self) -> Path | None:
        """Save onto the current preset; a built-in (or no) preset goes through Save as…."""
        if self.current_preset is None or is_builtin(self.current_preset, self.builtin_dir):
            return self.save_as()
        return self._write_preset(self.current_preset)

    def save_as(self, target: Path | None = None) -> Path | None:
        if target is None:
            chosen = self.ask_save_path(self.settings.user_presets_path)
            if not chosen:
                return None
            target = Path(chosen)
        allow_new_builtin = False
        if is_builtin(target, self.builtin_dir) and not target.with_suffix(".json").exists():
            allow_new_builtin = self.confirm(
                "Add a built-in preset?", f"{target} is inside the built-in presets folder. "
                "Add it there (for Tempera's developers)?")
            if not allow_new_builtin:
                return None
        return self._write_preset(target, allow_new_builtin)

    def _write_preset(self, target: Path, allow_new_builtin: bool = False) -> Path | None:
        if self.binding.errors:
            self.show_problems(self.binding.field_problems(), "Fix these fields before saving",
                               source=self.binding.field_problems)
            return None
        try:
            written = save_preset(self.binding.config, target, self.builtin_dir, allow_new_builtin)
        except (BuiltinPresetError, OSError) as exc:
            self.run_panel.set_status(f"Not saved: {exc}", error=True)
            self.run_panel.log(f"not saved: {exc}")
            return None
        self.current_preset = written
        self.settings.last_preset = str(written.resolve())
        self.set_dirty(False)
        self.refresh_presets()
        self.run_panel.set_status(f"Saved {written}.")
        self.run_panel.log(f"saved preset {written}")
        return written

    def _ask_save_path(self, initial_dir: Path) -> str | None:
        initial_dir.mkdir(parents=True, exist_ok=True)
        return ask_save_file(self, "Save preset as", initial_dir,
                             ("Tempera preset", ("*.json",)), ".json")

    # --- config-dependent widget states ------------------------------------------------------
    def _on_config_change(self, path: str | None, _source: object | None) -> None:
        self.run_panel.clear_notice()
        self._schedule_recheck()
        if path is None or path == "model.type":
            self._update_component_states()
        if path is not None and not self.dirty:
            self.set_dirty(True)
        if path is None or path in ("output.dir", "training.max_steps"):
            self.refresh_resume()
        if path is None or path.endswith("cache_dir"):
            self._update_cache_hints()

    def _update_cache_hints(self) -> None:
        """Where the two cache folders are when left empty (one lies inside the other)."""
        from modules.paths import cache_dir_for, compile_cache_folder
        config = self.binding.config
        general = self.registry.find("general.cache_dir")
        compile_view = self.registry.find("compile.cache_dir")
        general.set_hint("" if config.general.cache_dir else
                         f"empty: {cache_dir_for('')}")
        compile_view.set_hint("" if config.compile.cache_dir else
                              f"empty: {compile_cache_folder('', config.general.cache_dir)} "
                              "(inside General's cache folder)")

    def _update_component_states(self) -> None:
        """Grey the settings of components the model type does not have, and say which types
        have them (e.g. "Text encoder 2 (Stable Diffusion XL only)")."""
        model_type = MODEL_TYPES[self.binding.config.model.type]
        for container, label in container_labels(Config).items():
            if not container.startswith("components."):
                continue
            component = container.split(".", 1)[1]
            enabled = component in model_type.config_keys
            having = [spec.label for spec in MODEL_TYPES.values() if component in spec.config_keys]
            why = f"{model_type.label} models have no {label.lower()}"
            for view in self.registry.all_views():
                if view.path.startswith(container + "."):
                    view.set_enabled(enabled, why)
            title = self.registry.section_titles.get(container)
            if title is not None:
                title.configure(text=label if enabled else f"{label} ({' / '.join(having)} only)")
                set_label_enabled(title, enabled)

    # --- problems ----------------------------------------------------------------------------
    def show_problems(self, problems: list[Problem], title: str | None = None,
                      source: Callable[[], list[Problem]] | None = None,
                      keys: bool = False) -> None:
        """List every problem by the labels on screen (`keys`: with the file's key first, for a
        preset file's problems); clicking one jumps to its field, and fields show theirs in
        red too. With `source` (what found them) the list follows the edits: fixed problems
        leave it, and it closes when none is left."""
        for button in self.problem_buttons:
            button.destroy()
        for view in self._problem_marks:
            view.show_own_error()
        self.problem_buttons, self._problem_marks = [], []
        self.problems, self._problem_source = list(problems), source
        self._problem_heading, self._problem_keys = title, keys  # kept for the re-check
        self.problems_title.configure(
            text=title or f"Cannot start: {len(problems)} problem(s). Click one to go to its field.")
        for problem in problems:
            button = ctk.CTkButton(self.problems_list, text=f"• {self.describe(problem, keys)}",
                                   anchor="w", fg_color="transparent",
                                   text_color=("#b71c1c", "#ef9a9a"),
                                   hover_color=("gray85", "gray25"),
                                   command=lambda p=problem: self.jump_to(p.path))
            button.pack(fill="x")
            self.problem_buttons.append(button)
            view = self.registry.find(problem.path)
            if view is not None and not view.error:
                view.show_error(problem.detail())
                self._problem_marks.append(view)
        if not self.problems_frame.winfo_manager():
            # Sized when it opens and kept while it is open (a longer list scrolls): a panel
            # that shrank as problems were fixed moved the fields under the pointer.
            height = min(max(len(problems), 1), 4) * 30
            self.problems_list.configure(height=height)
            self.problems_list._scrollbar.configure(height=height)  # its own minimum is 200 px
        self.problems_frame.grid(row=2, column=0, sticky="ew", padx=8, pady=(4, 0))

    def describe(self, problem: Problem, keys: bool = False) -> str:
        """A problem as the window names it: "Training › Batch size: expected …, got …"
        (`keys`: "training.batch_size (Training › Batch size): …")."""
        where = self.registry.where(problem.path)
        if keys and where != problem.path:
            where = f"{problem.path} ({where})"
        return f"{where}: {problem.detail()}"

    def _schedule_recheck(self) -> None:
        if self._problem_source is None or not self.problems_frame.winfo_manager():
            return
        if self._recheck_id is not None:
            self.after_cancel(self._recheck_id)
        self._recheck_id = self.after(RECHECK_MS, self._recheck_problems)

    def _recheck_problems(self) -> None:
        self._recheck_id = None
        if self._problem_source is None or self.closed:
            return
        problems = self._problem_source()
        if problems:
            self.show_problems(problems, self._problem_heading, self._problem_source,
                               self._problem_keys)
        else:
            self.hide_problems()
            self.run_panel.set_status("Every listed problem is fixed.")

    def hide_problems(self) -> None:
        grid_hide(self.problems_frame)
        self._problem_source = None
        for view in self._problem_marks:
            view.show_own_error()
        self._problem_marks = []

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
            self.show_problems(problems, source=lambda: self.start_problems(resume))
            self.run_panel.set_status(f"Cannot start: {len(problems)} problem(s).", error=True)
            return False
        config = self.binding.snapshot()
        if resume:
            config.training.resume_from = "latest"
        self.hide_problems()
        self.run_panel.reset()
        if resume:
            self._show_earlier_run(config)
        self.set_running(True)
        self.expected_compile = expected_compile(config)
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
        from modules.train.backup_files import list_backups
        from modules.train.earlier_run import earlier_losses, latest_samples
        output = Path(config.output.dir).expanduser()
        backups = list_backups(output)
        if not backups:
            return
        step = backups[-1][0]
        points = earlier_losses(output, step)
        self.run_panel.show_earlier_losses(points)
        sample_step, samples = latest_samples(output, step)
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
        problems = self.binding.field_problems() + validate(config) + check_inputs(config)
        if resume:  # the button is off for a finished run; this holds if it is pressed anyway
            from modules.train.resume_offer import finished_run_problem
            finished = finished_run_problem(self.output_dir(), "latest",
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
        from modules.train.backup_files import list_backups
        from modules.train.record import read_run_status
        from modules.train.resume_offer import resume_offer
        output = self.output_dir()
        found = list_backups(output)
        offer = resume_offer(output, self.binding.config.training.max_steps)
        self.run_panel.show_backups(output, [step for step, _ in found], offer,
                                    can_resume=offer.can_resume and not self.training,
                                    ended=read_run_status(output))

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
            self.show_problems(data)
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
            import modules.compile  # noqa: F401  (imports torch)
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
        from modules.train.explain_run import explain_text
        explain = self.explain_fn or explain_text
        panel = self.compile_panel
        if self.binding.errors:
            self.show_problems(self.binding.field_problems(), "Fix these fields first",
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
            self.show_problems(value.problems)
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

    # --- scaling and closing -----------------------------------------------------------------
    def _scale_chosen(self, text: str) -> None:
        """Scale the widgets, not the window: it keeps its size on screen (customtkinter would
        grow it with the scale, past the screen's edge), and the minimum size stays on screen."""
        width, height = self.winfo_width(), self.winfo_height()
        scale = int(text.rstrip("%")) / 100
        self.settings.scaling = scale
        apply_scaling(scale)
        self.fit_minsize(scale)
        screen_w, screen_h = self.winfo_screenwidth(), self.winfo_screenheight()
        self.geometry(f"{int(min(width, screen_w) / scale)}x{int(min(height, screen_h) / scale)}")
        self.fit_columns()
        self._save_settings()

    def _resized(self, event: Any) -> None:
        if event.widget is self and not self.closed:
            if self._fit_id is not None:
                self.after_cancel(self._fit_id)
            self._fit_id = self.after(FIT_MS, self.fit_columns)

    def fit_columns(self) -> None:
        """Stack each tab's columns when they do not fit its width (ColumnLayout). Driven by
        the window's own size, which the layout does not change, so it cannot loop."""
        self._fit_id = None
        self.update_idletasks()
        width = self.tabview.winfo_width() - 40 * self.tabview._get_widget_scaling()
        if width > 1:
            for layout in self.registry.layouts:
                layout.arrange(stacked=layout.needed_width() > width)

    def fit_minsize(self, scale: float) -> None:
        """960x640 on screen at most (customtkinter scales the minimum with the UI scale),
        and never more than the screen holds."""
        screen_w, screen_h = self.winfo_screenwidth(), self.winfo_screenheight()
        self.minsize(int(min(960, screen_w * 0.9) / scale), int(min(640, screen_h * 0.9) / scale))

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
        if self.dirty:
            name = self.current_preset.name if self.current_preset else "the settings"
            answer = self.ask_unsaved(
                "Save your changes?", f"The settings were changed since {name} was loaded or "
                "saved. Save them before closing? (No closes without saving.)")
            if answer is None:
                return
            if answer and self.save() is None:  # Save as… cancelled, or the save failed
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
        if self._fit_id is not None:
            self.after_cancel(self._fit_id)
        forget_scaling_registration(self)
        self.destroy()


def fit_geometry(geometry: str, screen: tuple[int, int], scale: float) -> str:
    """A saved window geometry ("WxH" or "WxH+X+Y", customtkinter's unscaled units) shrunk and
    moved so that the window fits `screen` (a smaller screen, a larger UI scale)."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:\+(-?\d+)\+(-?\d+))?", geometry.strip())
    if match is None:
        return geometry
    screen_w, screen_h = screen
    width = min(int(match[1]), int(screen_w * 0.96 / scale))
    height = min(int(match[2]), int(screen_h * 0.92 / scale))
    if match[3] is None:
        return f"{width}x{height}"
    x = min(max(int(match[3]), 0), max(screen_w - int(width * scale), 0))
    y = min(max(int(match[4]), 0), max(screen_h - int(height * scale), 0))
    return f"{width}x{height}+{x}+{y}"


def expected_compile(config: Config) -> Any:
    """What earlier runs with these settings here say about this compile (a
    `CompileExpectation`; None: no record, or nothing compiles)."""
    if config.compile.backend.value == "NONE":
        return None
    from modules.train.builders import pick_device
    from modules.train.history import compile_expectation
    return compile_expectation(config, pick_device(config.general.device).type)


def apply_scaling(scale: float) -> None:
    """HiDPI: scale widgets and window sizes together (customtkinter's two factors)."""
    from customtkinter import ScalingTracker
    if ScalingTracker.widget_scaling != scale or ScalingTracker.window_scaling != scale:
        ctk.set_widget_scaling(scale)
        ctk.set_window_scaling(scale)


def forget_scaling_registration(window: Any) -> None:
    """Drop a closing window from customtkinter's scaling registry.

    customtkinter keeps every window it has seen in class-level dicts and calls their widgets
    on each scale change; a destroyed window's widgets would then raise TclError when a later
    window (the next session in one process, e.g. tests) changes the scale.
    """
    from customtkinter import ScalingTracker
    ScalingTracker.window_widgets_dict.pop(window, None)
    ScalingTracker.window_dpi_scaling_dict.pop(window, None)


__all__ = ["TemperaApp", "apply_scaling"]
