"""The Cloud tab: push the current settings to a training repository and watch its runs.

Where to push (the training repository's folder, its git remote and branch) and where to read
run statuses (the GPU machine's work root: a local path, or `user@host:/path` over ssh) belong to
this computer, not to the training config: they are kept with the GUI settings (`ui.json`).

"Push and train" writes the form as `runs/<name>.json` in the repository, then runs the same
checks, commit and push as `tempera-cloud push-and-train` (`modules.cloud.repo`). Git and ssh run
in a worker thread; their outcome comes back through the window's event queue.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding
from app.dialogs import ask_directory
from app.settings import UISettings
from app.text_boxes import pass_wheel_at_ends, set_readonly_text
from app.widgets import set_widget_enabled

TAB = "Cloud"
LOG_LINES = 20
ENTRIES = (  # (settings attribute, label, hint)
    ("cloud_repo", "Training repository", "a folder made by `tempera-cloud init`"),
    ("cloud_remote", "Git remote", "the remote whose push trains (e.g. origin)"),
    ("cloud_branch", "Branch", "the branch the GPU machine's hook watches"),
    ("cloud_status", "Status from", "the GPU machine's work root: /path, or user@host:/path"),
)


def push_task(config: Any, settings: UISettings, name: str) -> Callable[[], Any]:
    def push() -> Any:
        from modules.cloud.repo import push_current_config
        return push_current_config(config, Path(settings.cloud_repo), name,
                                   settings.cloud_remote, settings.cloud_branch)
    return push


def status_task(location: str) -> Callable[[], str]:
    """Read the run table and the latest run's log tail (in a worker thread)."""
    def read() -> str:
        from modules.cloud.remote_status import (format_table, parse_remote, read_log_tail,
                                                 read_views)
        from modules.cloud.git import CloudError
        remote = parse_remote(location)
        views = read_views(remote)  # the state observed now, and step/loss/ETA of running runs
        text = format_table(views)
        if views:
            latest = views[-1].status
            try:
                tail = read_log_tail(remote, latest.run_id, LOG_LINES)
            except CloudError as exc:
                tail = f"(no log yet: {exc})"
            text += f"\n\nLog of {latest.run_id} (last {LOG_LINES} lines):\n{tail}"
        return text
    return read


class CloudPanel:
    def __init__(self, parent: Any, binding: ConfigBinding, settings: UISettings,
                 run_task: Callable[[Callable[[], Any], str], object],
                 default_name: Callable[[], str], save_settings: Callable[[], None]) -> None:
        self.binding, self.settings = binding, settings
        self.run_task, self.default_name, self.save_settings = run_task, default_name, save_settings
        self.busy = False
        self.kept = ""  # the push report, kept above the status read right after it
        self.box = ctk.CTkFrame(parent, corner_radius=8)
        self.box.pack(fill="both", expand=True, padx=4, pady=4)
        ctk.CTkLabel(self.box, text="Train on a GPU machine by a git push",
                     font=ctk.CTkFont(size=15, weight="bold"), anchor="w").pack(
            anchor="w", padx=10, pady=(8, 2))
        ctk.CTkLabel(self.box, anchor="w", justify="left", wraplength=900,
                     text_color=("gray25", "gray75"),
                     text="The current settings are committed as runs/<name>.json and pushed; "
                          "the machine's hook trains them with the same compile settings. "
                          "Paths must lie inside the repository (or in that machine's "
                          "local.json). See docs/cloud.md.").pack(fill="x", padx=10, pady=(0, 6))
        self.entries: dict[str, ctk.CTkEntry] = {}
        for attribute, label, hint in ENTRIES:
            self.entries[attribute] = self._entry_row(label, hint, getattr(settings, attribute),
                                                      browse=attribute == "cloud_repo")
        self.name_entry = self._entry_row("Run name", "becomes runs/<name>.json", "")
        buttons = ctk.CTkFrame(self.box, fg_color="transparent")
        buttons.pack(fill="x", padx=10, pady=(8, 4))
        self.push_button = ctk.CTkButton(buttons, text="Push and train", width=160,
                                         command=self.push)
        self.push_button.pack(side="left")
        self.status_button = ctk.CTkButton(buttons, text="Refresh status", width=140,
                                           command=self.refresh_status)
        self.status_button.pack(side="left", padx=(8, 0))
        self.status = ctk.CTkLabel(buttons, text="", anchor="w")
        self.status.pack(side="left", padx=10, fill="x", expand=True)
        self.output = ctk.CTkTextbox(self.box, height=300, wrap="none",
                                     font=ctk.CTkFont(family="Courier", size=12))
        self.output.pack(fill="both", expand=True, padx=10, pady=(0, 10))
        pass_wheel_at_ends(self.output)
        self.show("Nothing pushed yet.")

    def _entry_row(self, label: str, hint: str, value: str, browse: bool = False) -> ctk.CTkEntry:
        row = ctk.CTkFrame(self.box, fg_color="transparent")
        row.pack(fill="x", padx=10, pady=1)
        ctk.CTkLabel(row, text=label, anchor="w", width=200).pack(side="left", padx=(0, 8))
        entry = ctk.CTkEntry(row, width=420, placeholder_text=hint)
        if value:
            entry.insert(0, value)
        entry.pack(side="left")
        if browse:
            ctk.CTkButton(row, text="…", width=32, command=lambda: self._browse(entry)).pack(
                side="left", padx=(4, 0))
        return entry

    def _browse(self, entry: ctk.CTkEntry) -> None:
        chosen = ask_directory(self.box, "Training repository", entry.get())
        if chosen:
            self.set_entry(entry, chosen)

    @staticmethod
    def set_entry(entry: ctk.CTkEntry, text: str) -> None:
        entry.delete(0, "end")
        entry.insert(0, text)

    def _store_settings(self) -> None:
        for attribute, entry in self.entries.items():
            setattr(self.settings, attribute, entry.get().strip())
        self.save_settings()

    def run_name(self) -> str:
        return self.name_entry.get().strip() or self.default_name()

    # --- actions -----------------------------------------------------------------------------
    def push(self) -> bool:
        """Commit the form as runs/<name>.json and push it, in a worker thread."""
        if self.busy:
            return False
        self._store_settings()
        missing = [label for attribute, label, _ in ENTRIES[:3]
                   if not getattr(self.settings, attribute)]
        if missing:
            return self._refuse("Not pushed.", f"Fill in: {', '.join(missing)}.")
        unfit = self.binding.field_problems()
        if unfit:
            problems = "\n".join(f"• {p}" for p in unfit)
            return self._refuse("Not pushed.", "Fix these fields first:\n" + problems)
        name = self.run_name()
        self._set_busy(f"Pushing runs/{name}.json to {self.settings.cloud_remote}/"
                       f"{self.settings.cloud_branch}…")
        self.run_task(push_task(self.binding.snapshot(), self.settings, name), "cloud_push")
        return True

    def refresh_status(self, keep: str = "") -> bool:
        """Read the runs (and the latest run's log) from `Status from`, in a worker thread."""
        if self.busy:
            return False
        self._store_settings()
        if not self.settings.cloud_status:
            return self._refuse("No status read.",
                                "Fill in Status from: the GPU machine's work root.")
        self.kept = keep
        self._set_busy(f"Reading runs from {self.settings.cloud_status}…")
        self.run_task(status_task(self.settings.cloud_status), "cloud_status")
        return True

    # --- outcomes (on the Tk thread) -----------------------------------------------------------
    def on_pushed(self, ok: bool, value: Any) -> None:
        self._set_idle()
        if not ok:
            self.status.configure(text="Not pushed.", text_color=("#b71c1c", "#ef9a9a"))
            self.show(f"Not pushed:\n{value}")
            return
        lines = [f"Pushed {value.config} in commit {value.commit[:10]} to "
                 f"{self.settings.cloud_remote}/{self.settings.cloud_branch}."]
        lines += [f"warning: {w}" for w in value.warnings]
        if value.push_output.strip():
            lines += ["", value.push_output.rstrip()]
        if value.remote_invalid:  # the push went through, but nothing will train
            lines.insert(1, f"The GPU machine found {', '.join(value.remote_invalid)} INVALID "
                            "and started nothing: fix it and push again.")
            self.status.configure(text=f"Pushed, but {value.config} is INVALID there.",
                                  text_color=("#b71c1c", "#ef9a9a"))
        else:
            self.status.configure(text=f"Pushed {value.config}.", text_color=("gray10", "gray90"))
        self.show("\n".join(lines))
        if self.settings.cloud_status:
            self.refresh_status(keep=self.text())

    def on_status(self, ok: bool, value: Any) -> None:
        self._set_idle()
        above = f"{self.kept}\n\n" if self.kept else ""
        if not ok:
            self.status.configure(text="Could not read the runs.",
                                  text_color=("#b71c1c", "#ef9a9a"))
            self.show(f"{above}Could not read the runs: {value}")
            return
        self.status.configure(text=f"Runs at {self.settings.cloud_status}",
                              text_color=("gray10", "gray90"))
        self.show(f"{above}{value}")

    # --- helpers -----------------------------------------------------------------------------
    def _refuse(self, status: str, message: str) -> bool:
        self.status.configure(text=status, text_color=("#b71c1c", "#ef9a9a"))
        self.show(message)
        return False

    def _set_busy(self, message: str) -> None:
        self.busy = True
        set_widget_enabled(self.push_button, False)
        set_widget_enabled(self.status_button, False)
        self.status.configure(text=message, text_color=("gray10", "gray90"))

    def _set_idle(self) -> None:
        self.busy = False
        set_widget_enabled(self.push_button, True)
        set_widget_enabled(self.status_button, True)

    def show(self, text: str) -> None:
        set_readonly_text(self.output, text)

    def text(self) -> str:
        return self.output.get("1.0", "end-1c")
