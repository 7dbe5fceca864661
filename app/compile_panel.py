"""The Advanced Options tab's Model Compilation section: hand-placed, because order matters.

Backend first with a line saying what it does and what training will hand to torch.compile on
this machine, and why when that differs (the plan training applies, rendered by
`app.compile_info.describe_plan`), then the component checkboxes, then the details, then "Check
compilation". The views themselves are the generic ones built from the schema; any other field
of the group is generated below this panel.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk

from app import dialogs
from app.binding import ConfigBinding
from app.compile_info import backend_description, bundle_text, describe_plan
from app.form import FieldRegistry
from app.text_boxes import pass_wheel_at_ends, set_readonly_text
from app.widgets import BoolView, FieldView, make_view, set_label_enabled, set_widget_enabled
from modules import frontend
from modules.config.introspect import outdates_compile_check
from modules.config.schema import CompileBackend, Config, Device

TAB = "Advanced Options"
DESCRIPTION_INDENT = 10 + 208  # under the menu: the field label column and its gap
COMPONENT_TOGGLES = (("compile.denoiser", "UNet"), ("compile.text_encoder", "Text Encoder"),
                     ("compile.vae", "VAE"))
DETAILS = ("compile.scope", "compile.mode", "compile.dynamic", "compile.fullgraph",
           "compile.cache_dir", "compile.strict", "compile.bundles", "compile.ahead",
           "compile.bundle")
BUNDLE_FILES = ("Compile bundles", ("*.tcb",))
PLACED = {"compile.backend", *(p for p, _ in COMPONENT_TOGGLES), *DETAILS}


def detect_machine(config: Config) -> Any:
    """What the configured device can compile with (imports torch and triton)."""
    return frontend.machine_capabilities(config)


def plan_text(config: Config, machine: Any) -> str:
    """The description line for ``config`` on ``machine``: the plan training applies, and
    with several resolutions or aspect buckets what their shape sets cost it at most."""
    text = describe_plan(config.compile.backend, frontend.compile_plans(config, machine))
    cost = frontend.compile_cost(config, machine)
    return text if cost is None else f"{text}\n{cost.describe()}"


class CompilePanel:
    def __init__(self, parent: Any, binding: ConfigBinding, registry: FieldRegistry,
                 on_check: Callable[[], None]) -> None:
        self.binding = binding
        self.box = ctk.CTkFrame(parent, corner_radius=8)
        self.box.pack(fill="x", anchor="nw", pady=(0, 12))
        ctk.CTkLabel(self.box, text="Model Compilation (torch.compile)",
                     font=ctk.CTkFont(size=15, weight="bold"), anchor="w").pack(
            anchor="w", padx=10, pady=(8, 2))

        self.backend = make_view(self.box, binding, "compile.backend", label="Backend")
        self.backend.frame.pack(fill="x", padx=10)
        registry.add(self.backend, TAB)
        # Under the menu, wrapped at word boundaries to the width the box has (`_fit_wrap`):
        # a fixed wrap length was wider than the window at 150 % or 1024 px, and Tk then cut
        # the line at the window's edge, mid-word.
        self.description = ctk.CTkLabel(self.box, text="", anchor="w", justify="left",
                                        wraplength=620, text_color=("gray25", "gray75"))
        self.description.pack(fill="x", padx=(DESCRIPTION_INDENT, 10), pady=(0, 6))
        self._wrap = 620
        # The box's width comes from the page, not from the label, so this cannot loop.
        self.box.bind("<Configure>", self._fit_wrap, add="+")

        row = ctk.CTkFrame(self.box, fg_color="transparent")
        row.pack(fill="x", padx=10, pady=2)
        self.toggles_label = ctk.CTkLabel(row, text="Compile components", anchor="w", width=200)
        self.toggles_label.pack(side="left", padx=(0, 8))
        self.toggles: dict[str, BoolView] = {}
        for path, label in COMPONENT_TOGGLES:
            view = BoolView(row, binding, path, label=label, style="checkbox")
            view.frame.pack(side="left", padx=(0, 16))
            registry.add(view, TAB)
            self.toggles[path] = view

        self.details: list[FieldView] = []
        for path in DETAILS:
            detail = make_view(self.box, binding, path)
            detail.frame.pack(fill="x", padx=10, pady=1)
            registry.add(detail, TAB)
            self.details.append(detail)

        bundle_row = ctk.CTkFrame(self.box, fg_color="transparent")
        bundle_row.pack(fill="x", padx=10, pady=(6, 0))
        self.export_button = ctk.CTkButton(bundle_row, text="Export bundle…", width=130,
                                           command=self.export_bundle)
        self.export_button.pack(side="left")
        self.import_button = ctk.CTkButton(bundle_row, text="Import bundle…", width=130,
                                           command=self.import_bundle)
        self.import_button.pack(side="left", padx=(8, 0))
        self.bundle_line = ctk.CTkLabel(bundle_row, text="", anchor="w", justify="left",
                                        text_color=("gray35", "gray65"))
        self.bundle_line.pack(side="left", padx=10, fill="x", expand=True)
        self.bundle: Any = None  # what a run would find of its compile bundle (a Lookup)
        # the file choosers (tests answer them)
        self.ask_export: Callable[[str], str | None] = lambda name: dialogs.ask_save_file(
            self.box, "Export the compile bundle", Path.home(), BUNDLE_FILES, ".tcb")
        self.ask_import: Callable[[], str | None] = lambda: dialogs.ask_open_file(
            self.box, "Import a compile bundle", "", BUNDLE_FILES)

        check_row = ctk.CTkFrame(self.box, fg_color="transparent")
        check_row.pack(fill="x", padx=10, pady=(8, 4))
        self.check_button = ctk.CTkButton(check_row, text="Check compilation", width=160,
                                          command=on_check)
        self.check_button.pack(side="left")
        self.check_hint = ctk.CTkLabel(check_row,
                                       text="graph breaks and what this machine can compile with",
                                       text_color=("gray35", "gray65"))
        self.check_hint.pack(side="left", padx=10)
        self.has_result = False  # a report of a finished check is on screen
        self.report = ctk.CTkTextbox(self.box, height=150, wrap="word")
        self.report.pack(fill="x", padx=10, pady=(0, 10))
        pass_wheel_at_ends(self.report)
        self.show_report("Press “Check compilation” to see graph breaks and backend support "
                         "for the current settings.")
        self._summaries = False  # the plan needs torch: filled in after idle
        # What the configured device can compile with, detected once per device setting
        # (tests fake a machine with `use_machine`).
        self._detect_machine: Callable[[Config], Any] = detect_machine
        self._machines: dict[Device, Any] = {}
        binding.subscribe(self._on_change)
        self._update()
        self._pending: str | None = self.box.after(150, self._load_summaries)

    def _fit_wrap(self, _event: Any = None) -> None:
        """Wrap the description to the box's width (customtkinter scales `wraplength`, so it
        is given in unscaled units, as the paddings are)."""
        scale = self.box._get_widget_scaling()
        wrap = max(160, int(self.box.winfo_width() / scale) - DESCRIPTION_INDENT - 10 - 8)
        if wrap != self._wrap:
            self._wrap = wrap
            self.description.configure(wraplength=wrap)

    def cancel_pending(self) -> None:
        if self._pending is not None:
            self.box.after_cancel(self._pending)
            self._pending = None

    def detect(self, config: Config) -> tuple[Device, Any]:
        """What `config`'s device can compile with (imports torch and triton; touches no
        widget, so the window's engine loader calls it in its thread)."""
        return config.general.device, self._detect_machine(config)

    def load_summaries(self, detected: tuple[Device, Any] | None = None) -> None:
        """Show the plan's torch.compile(...) line and its reasons (imports torch);
        `detected`: what `detect` found."""
        if detected is not None:
            self._machines[detected[0]] = detected[1]
        self._load_summaries()

    def _load_summaries(self) -> None:
        self._pending = None
        self._summaries = True
        self._update()

    def use_machine(self, detect: Callable[[Config], Any]) -> None:
        """Detect the machine with ``detect`` from now on (forgetting what was detected)."""
        self._detect_machine = detect
        self._machines.clear()
        self._update()

    def _on_change(self, path: str | None, _source: object | None) -> None:
        # the plan depends on what a compilation check depends on (device, training settings:
        # the fields whose schema metadata says compile_check)
        outdates = path is None or outdates_compile_check(path)
        if outdates:
            self._update()
        if self.has_result and outdates:
            self.has_result = False
            self.show_report("OUTDATED: the settings changed since this check; press “Check "
                             "compilation” again.\n\n" + self.report_text())

    def _update(self) -> None:
        config = self.binding.config
        backend: CompileBackend = config.compile.backend
        text = backend_description(backend)
        if self._summaries:
            device = config.general.device
            if device not in self._machines:
                self._machines[device] = self._detect_machine(config)
            text = plan_text(config, self._machines[device])
            self.bundle = frontend.matching_bundle(config, self._machines[device])
        self.description.configure(text=text)
        self.bundle_line.configure(text=bundle_text(self.bundle, self._summaries))
        set_widget_enabled(self.export_button, self.bundle is not None
                           and self.bundle.status == "hit")
        set_widget_enabled(self.import_button, config.compile.bundles)
        enabled = backend != CompileBackend.NONE
        for view in [*self.toggles.values(), *self.details]:
            view.set_enabled(enabled, "the backend is None (eager): nothing is compiled")
        set_label_enabled(self.toggles_label, enabled)

    def export_bundle(self) -> None:
        """Copy the bundle made for these settings where the user says (another machine's
        or a cloud run's repository picks it up there)."""
        if self.bundle is None or self.bundle.path is None:
            return
        target = self.ask_export(self.bundle.path.name)
        if not target:
            return
        try:
            written = frontend.export_bundle(self.bundle.path, target)
        except frontend.BundleError as err:
            self.bundle_line.configure(text=f"Not exported: {err}")
            return
        self.bundle_line.configure(text=f"Exported to {written}")

    def import_bundle(self) -> None:
        """Copy a bundle file into this machine's bundles folder, and say whether it was
        made for the current settings (and if not, what differs)."""
        source = self.ask_import()
        if not source:
            return
        try:
            imported = frontend.import_bundle(source, self.binding.config)
        except frontend.BundleError as err:
            self.bundle_line.configure(text=f"Not imported: {err}")
            return
        self._update()
        if self.bundle is not None and self.bundle.status != "hit":
            self.bundle_line.configure(
                text=f"Imported {imported.path.name}, but it was made for other settings: "
                     f"{self.bundle.why}")

    def show_report(self, text: str, result: bool = False) -> None:
        set_readonly_text(self.report, text)
        self.has_result = result

    def set_check_enabled(self, enabled: bool, why_not: str = "") -> None:
        set_widget_enabled(self.check_button, enabled)
        self.check_hint.configure(text="graph breaks and what this machine can compile with"
                                  if enabled else why_not)

    def report_text(self) -> str:
        return self.report.get("1.0", "end-1c")
