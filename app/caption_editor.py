"""The caption editor at the foot of the Data tab: step through a dataset's images with each
caption beside its picture, edit and save it in place, find and replace across the dataset,
and list the images with no caption or an empty mask (docs/gui.md, docs/datasets.md).

The engine decides everything (modules/data/caption_edit.py, caption_replace.py, through
`modules.frontend`): what the captions are, what may be written, what a replace changes.
Reading a folder (every image and mask decoded once), drawing an image's picture and writing
a replace run in threads; their results come back through queues the Tk thread polls with
`after()`. One caption's save and a replace's preview are quick and run on the Tk thread.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk
from PIL import Image

from app.binding import ConfigBinding
from app.readable import readable
from app.text_boxes import pass_wheel_at_ends, set_readonly_text
from app.thread_guard import ThreadGuard, tk_thread_only
from app.widgets import set_widget_enabled
from modules import frontend

POLL_MS = 50
THUMBNAIL = 256  # pixels: the picture beside the caption
RELOAD_ON = ("data.datasets", "data.caption_extension", "data.recursive")
UNSAVED = "● Unsaved changes"
AskUnsaved = Callable[[str, str], "bool | None"]  # save (True) / discard (False) / cancel (None)


class CaptionEditor:
    """The editor's widgets, the listing it shows (`listing`), the image shown (`position` in
    the filtered `order`) and whether its caption has unsaved edits (`dirty`)."""

    def __init__(self, parent: Any, binding: ConfigBinding, guard: ThreadGuard,
                 ask_unsaved: AskUnsaved,
                 busy_reason: Callable[[], str | None] = lambda: None) -> None:
        self.binding, self.guard, self.ask_unsaved = binding, guard, ask_unsaved
        self.busy_reason = busy_reason  # why a preparation job may not start now (a run)
        self.prep_windows: dict[str, Any] = {}  # the open preparation windows, by tool
        self.listing: Any = None
        self.order: list[int] = []   # the listing's indices the filter shows
        self.position = 0
        self.dirty = False
        self.busy = False
        self.plan: Any = None        # the previewed replace, until it is written or stale
        self.last_backup: Path | None = None
        self.results: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.pictures: "queue.Queue[tuple[tuple[int, int | None], Any]]" = queue.Queue()
        self.status_text = self.image_text = ""
        self.thumbnail: Any = None   # the PIL picture shown
        self._picture: Any = None    # its CTkImage (kept: the label does not hold it)
        self.frame = ctk.CTkFrame(parent, border_width=1, corner_radius=6)
        self.frame.grid_columnconfigure(1, weight=1)
        self.built = False  # the rest is built on the first Open: every window pays for it
        self._build_top()
        binding.subscribe(self._on_change)

    # --- layout --------------------------------------------------------------------------
    def _build_top(self) -> None:
        top = ctk.CTkFrame(self.frame, fg_color="transparent")
        top.grid(row=0, column=0, columnspan=2, sticky="ew", padx=8, pady=(8, 4))
        ctk.CTkLabel(top, text="Caption editor", font=ctk.CTkFont(weight="bold")).pack(
            side="left", padx=(0, 10))
        self.dataset = ctk.CTkOptionMenu(top, values=self._dataset_names(), width=200,
                                         dynamic_resizing=False)
        self.dataset.pack(side="left")
        self.open_button = ctk.CTkButton(top, text="Open", width=80, command=self.open)
        self.open_button.pack(side="left", padx=(6, 0))
        # The preparation tools (captions, masks) for the chosen dataset's folder: a window each
        self.prep_buttons = {
            key: ctk.CTkButton(top, text=action, width=130,
                               command=lambda key=key: self.open_prep(key))
            for key, action in frontend.prep_actions().items()}
        for button in self.prep_buttons.values():
            button.pack(side="left", padx=(6, 0))
        self.top = top
        self.status = ctk.CTkLabel(self.frame, text="", anchor="w", justify="left",
                                   wraplength=760)
        self.status.grid(row=1, column=0, columnspan=2, sticky="w", padx=8)
        self._say("Choose a dataset and press Open to edit its captions.")

    def _build_rest(self) -> None:
        """The filter, the picture, the caption box and find and replace (first Open)."""
        self.built = True
        self.filter = ctk.CTkOptionMenu(self.top, values=list(frontend.FILTERS), width=190,
                                        command=lambda _: self._apply_filter())
        self.filter.pack(side="left", padx=(16, 0))
        self._build_body()
        self._build_replace()

    def _build_body(self) -> None:
        self.picture = ctk.CTkLabel(self.frame, text="", width=THUMBNAIL, height=THUMBNAIL)
        self.picture.grid(row=2, column=0, sticky="nw", padx=8, pady=4)
        side = ctk.CTkFrame(self.frame, fg_color="transparent")
        side.grid(row=2, column=1, sticky="nsew", padx=(0, 8), pady=4)
        side.grid_columnconfigure(0, weight=1)
        self.name = ctk.CTkLabel(side, text="", anchor="w", font=ctk.CTkFont(weight="bold"))
        self.name.grid(row=0, column=0, sticky="w")
        self.text = ctk.CTkTextbox(side, height=120, wrap="word")
        self.text.grid(row=1, column=0, sticky="ew")
        pass_wheel_at_ends(self.text)
        self.text.bind("<KeyRelease>", lambda _: self._edited(), add="+")
        self.text.bind("<ButtonRelease-2>", lambda _: self._edited(), add="+")  # X11's paste
        self.text.bind("<Control-s>", lambda _: (self.save(), "break")[1], add="+")
        self.state = ctk.CTkLabel(side, text="", anchor="w", justify="left", wraplength=600,
                                  font=ctk.CTkFont(size=12))
        self.state.grid(row=2, column=0, sticky="w")
        buttons = ctk.CTkFrame(side, fg_color="transparent")
        buttons.grid(row=3, column=0, sticky="w", pady=(4, 0))
        self.previous = ctk.CTkButton(buttons, text="◀ Previous", width=100,
                                      command=lambda: self.step(-1))
        self.next = ctk.CTkButton(buttons, text="Next ▶", width=100, command=lambda: self.step(1))
        self.save_button = ctk.CTkButton(buttons, text="Save", width=80, command=self.save)
        self.revert_button = ctk.CTkButton(buttons, text="Revert", width=80, command=self.revert)
        for button in (self.previous, self.next, self.save_button, self.revert_button):
            button.pack(side="left", padx=(0, 6))
        self.unsaved = ctk.CTkLabel(buttons, text="", text_color=("#b35900", "#ffb366"))
        self.unsaved.pack(side="left", padx=(6, 0))

    def _build_replace(self) -> None:
        row = ctk.CTkFrame(self.frame, fg_color="transparent")
        row.grid(row=3, column=0, columnspan=2, sticky="ew", padx=8, pady=(4, 0))
        ctk.CTkLabel(row, text="Find").pack(side="left")
        self.find = ctk.CTkEntry(row, width=160)
        self.find.pack(side="left", padx=(4, 8))
        ctk.CTkLabel(row, text="Replace with").pack(side="left")
        self.replacement = ctk.CTkEntry(row, width=160)
        self.replacement.pack(side="left", padx=(4, 8))
        self.regex = ctk.CTkCheckBox(row, text="Regular expression", width=20)
        self.regex.pack(side="left", padx=(0, 8))
        self.ignore_case = ctk.CTkCheckBox(row, text="Ignore case", width=20)
        self.ignore_case.pack(side="left")
        for entry in (self.find, self.replacement):
            entry.bind("<KeyRelease>", lambda _: self._forget_plan(), add="+")
        actions = ctk.CTkFrame(self.frame, fg_color="transparent")
        actions.grid(row=4, column=0, columnspan=2, sticky="ew", padx=8, pady=(4, 0))
        self.preview_button = ctk.CTkButton(actions, text="Preview", width=90,
                                            command=self.preview_replace)
        self.replace_button = ctk.CTkButton(actions, text="Replace", width=130,
                                            command=self.replace_all)
        self.undo_button = ctk.CTkButton(actions, text="Undo last replace", width=140,
                                         command=self.undo)
        for button in (self.preview_button, self.replace_button, self.undo_button):
            button.pack(side="left", padx=(0, 6))
        self.report = ctk.CTkTextbox(self.frame, height=90, wrap="none")
        self.report.grid(row=5, column=0, columnspan=2, sticky="ew", padx=8, pady=(4, 8))
        pass_wheel_at_ends(self.report)
        set_readonly_text(self.report, "Find and replace: Preview lists what would change "
                                       "(nothing is written until Replace).")

    def _dataset_names(self) -> list[str]:
        names = [f"Dataset {i + 1}: {Path(ds.path).name or ds.path}"
                 for i, ds in enumerate(self.binding.config.data.datasets)]
        return names or ["(no dataset)"]

    # --- state shown ------------------------------------------------------------------------
    def _say(self, text: str, error: bool = False) -> None:
        self.status_text = text
        self.status.configure(text=text, text_color=("#c0392b", "#ff6b6b") if error else
                              ("gray10", "gray90"))

    @property
    def current(self) -> int | None:
        """The listing index of the image shown (None: none)."""
        return self.order[self.position] if self.order else None

    @tk_thread_only
    def _show_entry(self) -> None:
        """Show the current image, its caption and its states; the buttons follow."""
        index = self.current
        entry = None if index is None else self.listing.entries[index]
        self.text.configure(state="normal")
        self.text.delete("1.0", "end")
        if entry is not None:
            self.text.insert("1.0", entry.caption)
        self.text.configure(state="normal" if entry is not None and entry.editable else "disabled")
        self.image_text = entry.relative if entry is not None else ""
        self.name.configure(text="" if entry is None else
                            f"{self.position + 1} / {len(self.order)}   {entry.relative}")
        self.state.configure(text="" if entry is None else self._describe(entry))
        self._show_picture(entry)
        self._set_dirty(False)

    def _describe(self, entry: Any) -> str:
        lines = [f"Caption: {frontend.CAPTION_STATES[entry.caption_state]}; mask: "
                 f"{frontend.MASK_STATES[entry.mask_state]}"]
        lines += [text for text in (entry.note, entry.image_problem, entry.mask_problem) if text]
        return "\n".join(lines)

    def _show_picture(self, entry: Any) -> None:
        """The image with its mask's left-out part tinted (drawn in a thread: a large photo
        takes a while), or why it cannot be shown."""
        self.thumbnail = None
        if entry is None or entry.image_problem:
            self._set_picture(None, "" if entry is None else "cannot be read")
            return
        self._set_picture(None, "…")
        key = (id(self.listing), self.current)

        def draw() -> None:
            try:
                self.pictures.put((key, frontend.image_thumbnail(entry.image, entry.mask,
                                                                 THUMBNAIL)))
            except Exception as exc:  # noqa: BLE001 - said where the picture would be
                self.pictures.put((key, f"cannot be shown:\n{exc}"))
        threading.Thread(target=draw, name="tempera-caption-picture", daemon=True).start()
        self.frame.after(POLL_MS, self._poll_picture)

    @tk_thread_only
    def _poll_picture(self) -> None:
        """Show a drawn picture when it is still the current image's (one poll per drawing)."""
        try:
            key, drawn = self.pictures.get_nowait()
        except queue.Empty:
            self.frame.after(POLL_MS, self._poll_picture)
            return
        if key != (id(self.listing), self.current):
            return  # the user stepped on: that image's own drawing follows
        if isinstance(drawn, str):
            self._set_picture(None, drawn)
        else:
            self.thumbnail = drawn
            self._set_picture(drawn, "")

    def _set_picture(self, image: Any, text: str) -> None:
        # customtkinter's label keeps showing a dropped image (a TclError later): a blank
        # picture replaces it instead of image=None
        shown = image or Image.new("RGBA", (1, 1), (0, 0, 0, 0))
        self._picture = ctk.CTkImage(light_image=shown, dark_image=shown, size=shown.size)
        self.picture.configure(image=self._picture, text=text, compound="center")

    def _set_dirty(self, dirty: bool) -> None:
        self.dirty = dirty
        if not self.built:
            return
        self.unsaved.configure(text=UNSAVED if dirty else "")
        entry = None if self.current is None else self.listing.entries[self.current]
        set_widget_enabled(self.save_button, dirty and not self.busy)
        set_widget_enabled(self.revert_button, dirty)
        set_widget_enabled(self.previous, self.position > 0 and not self.busy)
        set_widget_enabled(self.next, self.position + 1 < len(self.order) and not self.busy)
        ready = self.listing is not None and not self.busy
        set_widget_enabled(self.preview_button, ready)
        set_widget_enabled(self.replace_button, ready and self.plan is not None
                           and bool(self.plan.changes))
        set_widget_enabled(self.undo_button, not self.busy and self.last_backup is not None)
        set_widget_enabled(self.open_button, not self.busy)
        if entry is not None and not entry.editable:
            set_widget_enabled(self.save_button, False)

    def _edited(self) -> None:
        index = self.current
        if index is None:
            return
        typed = self.text.get("1.0", "end-1c")
        self._set_dirty(typed.strip() != self.listing.entries[index].caption)

    # --- opening ------------------------------------------------------------------------------
    def open_prep(self, key: str) -> None:
        """The preparation tool `key`'s window for the chosen dataset's folder (raised if it is
        open already); when a job there ends, an open listing is read again."""
        window = self.prep_windows.get(key)
        if window is not None and window.winfo_exists():
            window.lift()
            return
        from app.prep_dialog import PrepDialog
        names = self._dataset_names()
        index = names.index(self.dataset.get()) if self.dataset.get() in names else 0
        config = self.binding.config
        folder = frontend.dataset_folder(config, index) \
            if index < len(config.data.datasets) else None
        window = PrepDialog(self.frame.winfo_toplevel(), frontend.prep_tool(key),
                            str(folder or ""), self.busy_reason, on_done=self._prepared)
        self.prep_windows[key] = window

    def _prepared(self, report: Any) -> None:
        """A preparation job wrote files: the listing shown is read again (not over edits)."""
        if self.listing is not None and report.written and not self.dirty and not self.busy:
            self.open()

    def open(self) -> None:
        """List the chosen dataset's images in a thread (a big folder takes a while)."""
        if self.busy or not self.leave():
            return
        names = self._dataset_names()
        choice = self.dataset.get()
        index = names.index(choice) if choice in names else 0
        if index >= len(self.binding.config.data.datasets):
            self._say("There is no dataset to open.", error=True)
            return
        config = self.binding.config
        if not self.built:
            self._build_rest()

        def work() -> None:
            progress = lambda done, total: self.results.put(("progress", (done, total)))  # noqa: E731
            self.results.put(("listed", frontend.caption_listing(config, index, progress)))
        self._start(work, f"Reading the images of dataset {index + 1}…")

    def _start(self, work: Callable[[], None], saying: str) -> None:
        def guarded() -> None:
            try:
                work()
            except frontend.CaptionEditError as exc:
                self.results.put(("refused", str(exc)))
            except Exception as exc:  # anything else is shown too, never swallowed
                self.results.put(("failed", f"{type(exc).__name__}: {exc}"))
        self.busy = True
        self._say(saying)
        self._set_dirty(self.dirty)
        threading.Thread(target=guarded, name="tempera-caption-editor", daemon=True).start()
        self.frame.after(POLL_MS, self._poll)

    @tk_thread_only
    def _poll(self) -> None:
        """Take what the thread sent: its latest progress, or its result (then it is over)."""
        kind: str = ""
        value: Any = None
        while kind in ("", "progress"):
            try:
                kind, value = self.results.get_nowait()
            except queue.Empty:
                break
        if kind in ("", "progress"):
            if kind:
                self._say(f"Reading images: {value[0]} / {value[1]}")
            self.frame.after(POLL_MS, self._poll)
            return
        self.busy = False
        done: dict[str, Callable[[Any], None]] = {
            "listed": self._listed, "replaced": self._replaced, "undone": self._undone,
            "refused": self._refused, "failed": lambda text: self._refused(f"Failed: {text}")}
        done[kind](value)

    def _listed(self, listing: Any) -> None:
        self.listing, self.plan = listing, None
        if listing.note:
            self._say(f"Nothing to edit: {readable(listing.note)}.", error=True)
        else:
            counts = listing.counts()
            self._say(f"{counts['All images']} images in {listing.folder}: "
                      + ", ".join(f"{counts[name]} {name.lower()}" for name in list(counts)[1:])
                      + "".join(f"\n{problem}" for problem in listing.problems))
        self.filter.set(list(frontend.FILTERS)[0])
        self._refresh_counts()
        self._apply_filter()

    def _refresh_counts(self) -> None:
        """Each filter's count in its menu (after a read, a save or a replace); the images
        shown stay those the filter picked until it is chosen again."""
        counts = self.listing.counts()
        chosen = self.filter.get().rsplit(" (", 1)[0]
        self.filter.configure(values=[f"{name} ({count})" for name, count in counts.items()])
        self.filter.set(f"{chosen} ({counts[chosen]})")

    def _refused(self, text: str) -> None:
        self._say(f"Not done: {readable(text)}", error=True)
        self._set_dirty(self.dirty)

    def _apply_filter(self) -> None:
        if self.listing is None or not self.leave():
            return
        name = self.filter.get().rsplit(" (", 1)[0]
        self.order, self.position = self.listing.shown(name), 0
        self._show_entry()

    # --- stepping and saving ---------------------------------------------------------------
    def leave(self) -> bool:
        """May the image shown be left? Unsaved edits are saved, discarded or keep it, as the
        user answers."""
        if not self.dirty:
            return True
        entry = self.listing.entries[self.current]
        answer = self.ask_unsaved("Unsaved caption", f"The caption of {entry.relative} was "
                                  "changed. Save it? (No discards the change.)")
        if answer is None:
            return False
        return self.save() if answer else True

    def step(self, by: int) -> None:
        target = self.position + by
        if self.busy or not 0 <= target < len(self.order) or not self.leave():
            return
        self.position = target
        self._show_entry()

    def save(self) -> bool:
        """Save the caption shown; whether it was saved (a refusal is said, nothing lost)."""
        index = self.current
        if index is None or self.busy:
            return False
        try:
            frontend.save_caption(self.listing, index, self.text.get("1.0", "end-1c"))
        except frontend.CaptionEditError as exc:
            self._refused(str(exc))
            return False
        self.plan = None
        entry = self.listing.entries[index]
        self._say(f"Saved {entry.caption_file.name}.")
        self._refresh_counts()
        self.state.configure(text=self._describe(entry))
        self._set_dirty(False)
        return True

    def revert(self) -> None:
        self._show_entry()

    # --- find and replace ---------------------------------------------------------------------
    def _forget_plan(self) -> None:
        if self.plan is not None:
            self.plan = None
            self._set_dirty(self.dirty)

    def preview_replace(self) -> None:
        """Show what the replace would change (files, matches, each caption); writes nothing."""
        if self.listing is None:
            return
        try:
            self.plan = frontend.plan_replace(self.listing, self.find.get(),
                                              self.replacement.get(), bool(self.regex.get()),
                                              bool(self.ignore_case.get()))
        except frontend.CaptionEditError as exc:
            self.plan = None
            set_readonly_text(self.report, f"Not done: {exc}")
            self._set_dirty(self.dirty)
            return
        set_readonly_text(self.report, "\n".join([self.plan.summary() + ":",
                                                  *self.plan.preview(self.listing)]))
        self.replace_button.configure(text=f"Replace in {self.plan.files} file(s)")
        self._set_dirty(self.dirty)

    def replace_all(self) -> None:
        """Write the previewed replace in a thread (backed up first)."""
        if self.plan is None or self.busy:
            return
        if self.dirty:
            self._refused("save or revert the caption shown before replacing")
            return
        listing, plan = self.listing, self.plan
        self._start(lambda: self.results.put(("replaced", frontend.apply_replace(listing, plan))),
                    f"Replacing in {plan.files} caption file(s)…")

    def _replaced(self, result: Any) -> None:
        self.plan, self.last_backup = None, result.backup
        self.replace_button.configure(text="Replace")
        set_readonly_text(self.report, f"Replaced in {len(result.written)} caption file(s). "
                                       f"The files as they were are in {result.backup}.")
        self._say(f"Replaced in {len(result.written)} caption file(s).")
        self._refresh_counts()
        self._show_entry()

    def undo(self) -> None:
        if self.last_backup is None or self.busy or not self.leave():
            return
        backup = self.last_backup
        self._start(lambda: self.results.put(("undone", frontend.undo_replace(backup))),
                    "Putting back the caption files…")

    def _undone(self, restored: list[Path]) -> None:
        self.last_backup = None
        set_readonly_text(self.report, f"Put back {len(restored)} caption file(s).")
        self.open()  # the listing shows the files as they are now

    # --- the config --------------------------------------------------------------------------
    def _on_change(self, path: str | None, _source: object | None) -> None:
        if not self.frame.winfo_exists():
            return
        if path is None or path.startswith(RELOAD_ON):
            before = list(self.dataset.cget("values"))
            chosen = before.index(self.dataset.get()) if self.dataset.get() in before else 0
            names = self._dataset_names()
            self.dataset.configure(values=names)
            self.dataset.set(names[min(chosen, len(names) - 1)])
            if self.listing is not None and not self.busy:
                self._say("The dataset settings changed: press Open to read the folder again.")
