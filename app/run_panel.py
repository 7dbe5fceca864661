"""The run controls (bottom bar) and the Run tab (loss curve, latest sample, log).

Every method that changes a widget is marked `tk_thread_only`: the window calls them while
draining the event queue on the Tk thread, and the guard records any call from elsewhere.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk
from PIL import Image

from app.loss_plot import LossPlot
from app.thread_guard import ThreadGuard, tk_thread_only
from app.tooltip import Tooltip
from app.widgets import ERROR_COLOR, elide, set_widget_enabled
from modules.events import Progress
from modules.frontend import ResumeOffer, format_duration

SAMPLE_SIZE = 320
# A sample's caption (up to three lines), the box's step line and paddings; the least side
SAMPLE_BOX_LINES, CAPTION_ROOM, MIN_SAMPLE = 44, 48, 48
RESUME_TEXTS = ("Resume", "Resume from step 999999", "Continue for 99999 more steps")


def fit_button_width(button: Any, texts: tuple[str, ...]) -> None:
    """Give a button whose text changes the width of the longest of `texts`, so the widgets
    after it stay where they are as its text changes (a button grows with a longer text)."""
    font = ctk.CTkFont()  # a button's default font, unscaled: widths are in unscaled pixels
    widest = max(font.measure(text) for text in texts)
    button.configure(width=widest + 2 * (button.cget("corner_radius") + 8))


def compile_hint(expected: Any) -> str:
    """What the busy bar says about the compile's length (`CompileExpectation` or None)."""
    if expected is None:
        return " · first compile with these settings: no estimate yet"
    if expected.measured and not expected.warm and not expected.seconds:
        return f" · first compile with these settings here; measured elsewhere: {expected.measured}"
    if expected.seconds:
        why = "compile cache warm" if expected.warm else "last run with these settings"
        return f" · expected about {format_duration(expected.seconds)} ({why})"
    warm = "compile bundle loaded" if expected.bundle else "compile cache warm"
    if expected.warm and expected.cold_seconds:
        return (f" · {warm}: well under the {format_duration(expected.cold_seconds)}"
                " of a cold compile")
    return f" · {warm}: no estimate yet" if expected.warm else ""


def with_graph_total(message: str, graph: int, component: str, expected: Any) -> str:
    """ "graph 3" becomes "graph 3 of 12" when the last run with these settings compiled 12
    graphs for this component (and no more than that so far)."""
    total = expected.graphs.get(component) if expected is not None else None
    if not total or graph > total:
        return message
    return re.sub(rf"\bgraph {graph}\b", f"graph {graph} of {total}", message, count=1)


class RunPanel:
    def __init__(self, bar_parent: Any, tab_parent: Any, guard: ThreadGuard,
                 actions: dict[str, Callable[[], None]]) -> None:
        self.guard = guard
        self._build_bar(bar_parent, actions)
        self._build_tab(tab_parent)
        self.sample_path: Path | None = None
        self.set_running(False)

    def _build_bar(self, parent: Any, actions: dict[str, Callable[[], None]]) -> None:
        self.bar = ctk.CTkFrame(parent)
        self.bar.grid_columnconfigure(0, weight=1)
        self.button_row = ctk.CTkFrame(self.bar, fg_color="transparent")
        self.button_row.grid(row=0, column=0, sticky="w", padx=8, pady=6)
        self.buttons: dict[str, Any] = {}
        # narrow enough to stay on a 1280 px window at 150% (a button grows with its text)
        for key, text, width in (("start", "Start training", 120), ("resume", "Resume", 80),
                                 ("stop", "Stop", 60),
                                 ("sample", "Sample now", 96), ("save", "Save now", 86),
                                 ("open_output", "Output folder", 110),
                                 ("tensorboard", "TensorBoard", 100)):
            button = ctk.CTkButton(self.button_row, text=text, width=width,
                                   command=actions[key])
            button.pack(side="left", padx=3)
            self.buttons[key] = button
        self.buttons["start"].configure(fg_color=("#2e7d32", "#2e7d32"),
                                        hover_color=("#1b5e20", "#1b5e20"))
        # Resume's text changes (Resume from step N, Continue for M more steps): its width is
        # that of its longest usual text, so the buttons after it do not move sideways.
        fit_button_width(self.buttons["resume"], RESUME_TEXTS)
        self.button_tips = {key: Tooltip(button, "") for key, button in self.buttons.items()}
        # the facts the buttons follow (`_update_buttons`)
        self.running, self.start_why_not = False, ""
        self.resume_why_not = "the output folder holds no backup"
        # One line across the window, cut to fit; the whole text on hover and in the log.
        self.status_font = ctk.CTkFont()
        self.status = ctk.CTkLabel(self.bar, text="Ready.", anchor="w", font=self.status_font)
        self.status.grid(row=1, column=0, sticky="ew", padx=12)
        self.status_tip = Tooltip(self.status, "", wraplength=720)
        self.status_text, self.status_error = "Ready.", False
        self.idle_text: Callable[[], str] = lambda: "Ready."  # the window says what is true
        self._shown_step = 0  # the newest step on the step bar
        self._status_step, self._status_of_run = 0, False  # the step bar when the status came
        self._last_progress: Progress | None = None
        self._ended = False
        self.tensorboard_url: str | None = None
        self.progress = ctk.CTkFrame(self.bar, fg_color="transparent")
        self.progress.grid(row=2, column=0, sticky="ew", padx=8, pady=(0, 6))
        self.step_caption = ctk.CTkLabel(self.progress, text="Step", width=48, anchor="w")
        self.step_bar = ctk.CTkProgressBar(self.progress)
        self.step_label = ctk.CTkLabel(self.progress, text="", width=380, anchor="w")
        self.epoch_caption = ctk.CTkLabel(self.progress, text="Epoch", width=48, anchor="w")
        self.epoch_bar = ctk.CTkProgressBar(self.progress)
        self.epoch_label = ctk.CTkLabel(self.progress, text="", width=380, anchor="w")
        self.compact: bool | None = None
        self.set_compact(False)
        self._status_color = self.status.cget("text_color")
        self.step_bar.set(0)
        self.epoch_bar.set(0)

    def set_compact(self, compact: bool) -> None:
        """A short window (a 768 px screen at 150 %) keeps its height for the form: the step
        and epoch bars share one line and the bar's paddings shrink (200 px of bar left three
        fields above it). Otherwise each bar has its own line."""
        if compact == self.compact:
            return
        self.compact = compact
        lines = ((self.step_caption, self.step_bar, self.step_label),
                 (self.epoch_caption, self.epoch_bar, self.epoch_label))
        for line, widgets in enumerate(lines):
            for column, widget in enumerate(widgets):
                widget.grid(row=0 if compact else line,
                            column=column + 3 * line if compact else column,
                            sticky="ew" if column == 1 else "w", padx=(0, 8) if column else 0)
        bars = (1, 4) if compact else (1,)
        for column in range(6):
            self.progress.grid_columnconfigure(column, weight=1 if column in bars else 0)
        self.step_label.configure(width=300 if compact else 380)
        self.epoch_label.configure(width=170 if compact else 380)
        self.button_row.grid_configure(pady=2 if compact else 6)
        self.progress.grid_configure(pady=(0, 2 if compact else 6))
        self.status.configure(height=22 if compact else 28)

    def _build_tab(self, parent: Any) -> None:
        # Shares of the tab, whatever the parts ask for: the loss curve kept shrinking as
        # samples (and their captions) arrived and asked for more room.
        parent.grid_columnconfigure(0, weight=3, uniform="run_columns")
        parent.grid_columnconfigure(1, weight=2, uniform="run_columns")
        parent.grid_rowconfigure(1, weight=3, uniform="run_rows")  # the curve and samples,
        parent.grid_rowconfigure(2, weight=2, uniform="run_rows")  # then the log
        # What the output folder holds to resume, across the top: in the samples' column it
        # was squeezed on a short window until only its middle line showed.
        self.backups_label = ctk.CTkLabel(parent, text="", justify="left", anchor="w",
                                          text_color=("gray30", "gray70"))
        self.backups_label.grid(row=0, column=0, columnspan=2, sticky="ew", padx=4, pady=(0, 6))
        self._note_wrap = 0
        parent.bind("<Configure>", lambda _e: self._fit_note(parent), add="+")
        self.plot = LossPlot(parent)
        self.plot.canvas.grid(row=1, column=0, sticky="nsew", padx=(0, 8), pady=(0, 8))
        sample_box = ctk.CTkFrame(parent)
        sample_box.grid(row=1, column=1, sticky="nsew", pady=(0, 8))
        sample_box.pack_propagate(False)  # its samples fit the box; they never resize it
        self.sample_box = sample_box
        # width/height 1: an empty frame would ask for 200x200 and push the caption out
        self.samples_row = ctk.CTkFrame(sample_box, fg_color="transparent", width=1, height=1)
        self.samples_row.pack(padx=8, pady=(8, 2))
        # the step of the samples shown (each prompt is under its own image)
        self.sample_caption = ctk.CTkLabel(sample_box, text="the latest samples appear here",
                                           wraplength=SAMPLE_SIZE + 40, justify="left")
        self.sample_caption.pack(padx=8, pady=(0, 4))
        self.sample_widgets: list[Any] = []   # the images
        self.sample_captions: list[Any] = []  # each image's prompt, under it
        self._sample_cells: list[Any] = []
        self.sample_step: int | None = None
        self.sample_paths: list[Path] = []
        self.log_box = ctk.CTkTextbox(parent, height=160, wrap="word")
        self.log_box.grid(row=2, column=0, columnspan=2, sticky="nsew")
        self.log_box.configure(state="disabled")

    def _fit_note(self, parent: Any) -> None:
        """Wrap the resume note to the tab's width (customtkinter scales `wraplength`)."""
        scale = self.bar._get_widget_scaling()
        wrap = max(200, int(parent.winfo_width() / scale) - 24)
        if wrap != self._note_wrap:
            self._note_wrap = wrap
            self.backups_label.configure(wraplength=wrap)

    # --- updates (Tk thread only) ----------------------------------------------------------
    @tk_thread_only
    def set_running(self, running: bool) -> None:
        self.running = running
        self._update_buttons()

    @tk_thread_only
    def set_start_allowed(self, allowed: bool, why_not: str = "") -> None:
        """Allow Start (and Resume) or not, for a reason outside the training (a benchmark)."""
        self.start_why_not = "" if allowed else why_not
        self._update_buttons()

    def _update_buttons(self) -> None:
        """Every run button's state from the facts now: whether a training runs, what keeps
        Start waiting (`start_why_not`: the engine loads, a benchmark or a check runs) and what
        the output folder offers to resume (`resume_why_not`). Each of those changes calls
        this, so no button keeps the reason of a state that has passed (Resume stayed greyed
        "while torch loads" after it had loaded, "while a benchmark runs" after it stopped)."""
        waiting = "training is running" if self.running else self.start_why_not
        self._enable("start", not waiting, waiting)
        resume_why_not = "training is running" if self.running else (self.resume_why_not
                                                                      or self.start_why_not)
        self._enable("resume", not resume_why_not, resume_why_not)
        for key in ("stop", "sample", "save"):
            self._enable(key, self.running, "" if self.running else "no training is running")

    def _enable(self, key: str, enabled: bool, why_not: str = "") -> None:
        set_widget_enabled(self.buttons[key], enabled)
        self.button_tips[key].text = "" if enabled or not why_not else f"Not now: {why_not}"

    @tk_thread_only
    def show_tensorboard(self, url: str) -> None:
        """TensorBoard runs: its button shows the address, and opens it when pressed again."""
        self.tensorboard_url = url
        self.buttons["tensorboard"].configure(text="Open " + url.split("//", 1)[-1])
        self.button_tips["tensorboard"].text = f"TensorBoard is serving at {url}"

    @tk_thread_only
    def show_backups(self, output: Path, steps: list[int], offer: ResumeOffer,
                     ended: str, final_step: int | None = None) -> None:
        """The output folder's backups, and Resume from the newest when the run ended early.
        A finished run shows no Resume: only Continue, when Max steps was raised past its end.
        `final_step`: the step of the weights in final/; later than the newest backup, they
        are a run's that got further (a finished run continued from an older backup, then
        stopped), and the note says so."""
        listed = (f"Backups in {output / 'backups'}: step " + ", ".join(str(s) for s in steps)
                  + ". ") if steps else ""
        if offer.finished_step is not None:
            n = offer.finished_step
            if offer.continues_finished and steps:
                self.buttons["resume"].configure(text=f"Continue for {offer.more_steps} more steps")
                self.resume_why_not = ""
                tail = (f"Continue trains from the newest backup (step {steps[-1]}) to step "
                        f"{offer.max_steps}; final/ is replaced only by weights of a later step.")
            else:
                self.buttons["resume"].configure(text="Resume")
                self.resume_why_not = (f"the run finished at step {n}; raise Max steps above "
                                       f"{n} to continue it")
                tail = (f"To train it further, raise Max steps above {n}; to train again from "
                        "the start, choose a new output folder." if steps else
                        "It left no backup to continue from.")
            self.backups_label.configure(text=f"The last run here finished at step {n} (its "
                                              f"weights are in final/). {listed}{tail}")
        elif steps:
            self.buttons["resume"].configure(text=f"Resume from step {steps[-1]}")
            self.resume_why_not = ""
            how = {"failed": "failed", "running": "was killed or crashed",
                   "interrupted": "was interrupted", "stopped": "was stopped"}.get(ended)
            lead = f"The last run here {how}. " if how else ""
            kept = (f" final/ still holds the weights of step {final_step}, where a run here "
                    f"had got to: Resume replaces them only with a later step's."
                    if final_step is not None and final_step > steps[-1] else "")
            self.backups_label.configure(text=f"{lead}{listed}Resume continues the newest."
                                              f"{kept}")
        else:
            self.buttons["resume"].configure(text="Resume")
            self.resume_why_not = "the output folder holds no backup"
            self.backups_label.configure(text="No backups in the output folder (nothing to "
                                              "resume).")
        self._update_buttons()

    @tk_thread_only
    def show_run_folder(self, output: Path, steps: list[int], final_step: int | None) -> None:
        """While a run trains: what its output folder holds now (read from the disk), not
        what the folder held before it started (a fresh start removed those backups)."""
        listed = ("Backups so far: step " + ", ".join(str(s) for s in steps) + "."
                  if steps else "No backup in it yet.")
        final = (f" final/ holds the weights of step {final_step} until this run saves a "
                 "later step's." if final_step is not None else "")
        self.backups_label.configure(text=f"Training into {output}. {listed}{final}")

    @tk_thread_only
    def show_compiling(self, message: str, expected: Any = None, graph: int = 0,
                       component: str = "") -> None:
        """While the first steps compile, the step bar cannot move: say it is busy, what is
        compiling ("graph N of M" once an earlier run with these settings counted them), and
        how long it should take (`expected`: a `CompileExpectation`; a warm compile cache takes
        seconds where a cold one took minutes)."""
        if self.step_bar.cget("mode") != "indeterminate":
            self.step_bar.configure(mode="indeterminate")
            self.step_bar.start()
        text = with_graph_total(message, graph, component, expected) if graph else message
        self.step_label.configure(text=text[:80] + compile_hint(expected))

    def _stop_busy(self) -> None:
        if self.step_bar.cget("mode") == "indeterminate":
            self.step_bar.stop()
            self.step_bar.configure(mode="determinate")

    @tk_thread_only
    def show_ended(self, outcome: str | None) -> None:
        """The run ended (`outcome`: finished, stopped, failed, crashed; None: its thread
        ended, the outcome said or not): the step line keeps where it got to, without the rate
        and ETA of a run that no longer runs, and a busy bar stops."""
        if outcome is None and self._ended:
            return
        self._ended = True
        self._stop_busy()
        p, said = self._last_progress, outcome or "ended"
        if p is not None:
            self.step_label.configure(text=f"{p.step}/{p.max_steps} · {said} · loss "
                                           f"{p.smoothed_loss:.4f}")
        elif self.step_label.cget("text"):  # "compiling UNet…" when it failed
            self.step_label.configure(text=said)
        if self._status_of_run:
            self._status_of_run = False
            if self.status_text == "Training…":
                self.set_status(self.idle_text())

    @tk_thread_only
    def reset(self, caption: str = "the samples of this run appear here") -> None:
        self._stop_busy()
        self._last_progress, self._shown_step, self._ended = None, 0, False
        self._clear_samples(caption)
        self.step_bar.set(0)
        self.epoch_bar.set(0)
        self.step_label.configure(text="")
        self.epoch_label.configure(text="")
        self.plot.clear()

    @tk_thread_only
    def set_status(self, text: str, error: bool = False, of_run: bool = False) -> None:
        """One line, cut to the window's width (the whole text on hover). An error stays
        until the next action or edit (`clear_notice`). `of_run`: what the running training
        does now ("sampling at step 20"), which goes once a later step is shown."""
        self.status_text, self.status_error = text, error
        self._status_of_run = of_run
        self._status_step = self._shown_step
        line = " ".join(text.split())
        scale = self.bar._get_widget_scaling()
        width = self.bar.winfo_width() / scale - 40 if self.bar.winfo_width() > 1 else 900
        self.status.configure(text=elide(line, self.status_font, max(width, 200)),
                              text_color=ERROR_COLOR if error else self._status_color)
        self.status_tip.text = text if len(line) > len(self.status.cget("text")) else ""

    @tk_thread_only
    def clear_notice(self) -> None:
        """The user acted: an error about an earlier action no longer applies."""
        if self.status_error:
            self.set_status(self.idle_text())

    @tk_thread_only
    def log(self, line: str) -> None:
        self.log_box.configure(state="normal")
        self.log_box.insert("end", time.strftime("%H:%M:%S ") + line.rstrip() + "\n")
        self.log_box.see("end")
        self.log_box.configure(state="disabled")

    def log_text(self) -> str:
        return self.log_box.get("1.0", "end-1c")

    @tk_thread_only
    def show_progress(self, p: Progress) -> None:
        self._stop_busy()
        self._last_progress, self._shown_step = p, p.step
        if self._status_of_run and p.step > self._status_step and not self.status_error:
            self.set_status("Training…", of_run=True)  # "sampling at step 20" is over
        self.step_bar.set(p.step / max(p.max_steps, 1))
        rate = f"{1 / p.seconds_per_step:.2f} it/s" if p.seconds_per_step > 0 else "– it/s"
        self.step_label.configure(text=f"{p.step}/{p.max_steps} · {rate} · ETA "
                                       f"{format_duration(p.eta_seconds)} · loss "
                                       f"{p.smoothed_loss:.4f}")
        self.epoch_bar.set(p.epoch / max(p.max_epochs, 1))
        self.epoch_label.configure(text=f"epoch {p.epoch}/{p.max_epochs} · lr {p.lr:.2e}")
        self.plot.add(p.step, p.loss, p.smoothed_loss)

    @tk_thread_only
    def show_validation(self, score: Any) -> None:
        """A validation pass (`ValidationScore`): a point on the plot's validation series."""
        self.plot.add_validation(score.step, score.loss, score.best_step)
        self.plot.redraw()

    @tk_thread_only
    def show_earlier_losses(self, points: list[Any]) -> None:
        """The loss curve of the run a resume continues (`LossPoint`s), before its new steps."""
        for point in points:
            self.plot.add(point.step, point.loss, point.smoothed)
        self.plot.redraw()

    @tk_thread_only
    def redraw_plot(self) -> None:
        self.plot.redraw()

    def _clear_samples(self, caption: str) -> None:
        for cell in self._sample_cells:
            cell.destroy()
        self.sample_widgets, self.sample_paths, self.sample_step = [], [], None
        self.sample_captions, self._sample_cells = [], []
        self._sample_images: list[Any] = []
        self.sample_caption.configure(text=caption)

    def _sample_side(self, count: int) -> int:
        """The side of each of `count` samples: SAMPLE_SIZE alone, half that two to a row, and
        smaller where the box (a share of the tab) is too short for their rows and captions."""
        side = SAMPLE_SIZE if count == 1 else SAMPLE_SIZE // 2
        height = self.sample_box.winfo_height() / self.bar._get_widget_scaling()
        if height <= 1:  # not laid out yet
            return side
        rows = 1 if count == 1 else (count + 1) // 2
        room = (height - SAMPLE_BOX_LINES) / rows - CAPTION_ROOM
        return max(MIN_SAMPLE, min(side, int(room)))

    @tk_thread_only
    def show_sample(self, path: Path, prompt: str, step: int) -> None:
        """Every prompt's sample of the newest step side by side (a new step replaces them)."""
        if step != self.sample_step:
            self._clear_samples("")
            self.sample_step = step
        with Image.open(path) as image:
            image.load()
            picture = ctk.CTkImage(light_image=image.copy(), size=image.size)
        count = len(self.sample_paths) + 1
        side = self._sample_side(count)  # all the same size
        cell = ctk.CTkFrame(self.samples_row, fg_color="transparent")
        cell.grid(row=(count - 1) // 2, column=(count - 1) % 2, padx=2, pady=2, sticky="n")
        label = ctk.CTkLabel(cell, image=picture, text="")
        label.pack()
        caption = ctk.CTkLabel(cell, text=prompt, justify="center", font=ctk.CTkFont(size=11))
        caption.pack(fill="x")
        self._sample_images.append(picture)
        self._sample_cells.append(cell)
        self.sample_captions.append(caption)
        for shown, under in zip(self._sample_images, self.sample_captions):
            width, height = shown.cget("light_image").size
            scale = side / max(width, height)
            shown.configure(size=(max(1, int(width * scale)), max(1, int(height * scale))))
            under.configure(wraplength=side)
        self.sample_widgets.append(label)
        self.sample_paths.append(Path(path))
        self.sample_caption.configure(text=f"step {step}")
