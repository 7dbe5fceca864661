"""One view class per field kind; `make_view` picks it from the field's metadata.

A view owns a label, an input, an error line and a tooltip with the field's help text. It reads
its value from the binding and writes user input back through it (tk variables with traces,
so `.set()`, `.select()` and typing all take the same path).
"""
from __future__ import annotations

import tkinter
from tkinter import filedialog
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding, format_value
from app.tooltip import Tooltip

ERROR_COLOR = ("#c62828", "#ef5350")
LABEL_WIDTH = 200


class FieldView:
    """Base: label + input + error line for the field at `path`."""

    def __init__(self, parent: Any, binding: ConfigBinding, path: str, label: str | None = None,
                 show_label: bool = True, label_width: int = LABEL_WIDTH) -> None:
        self.binding, self.path = binding, path
        self.info = binding.info(path)
        self._updating = False
        self.frame = ctk.CTkFrame(parent, fg_color="transparent")
        self.frame.grid_columnconfigure(1, weight=1)
        self.label = None
        if show_label:
            self.label = ctk.CTkLabel(self.frame, text=label or self.info.label, anchor="w",
                                      width=label_width)
            self.label.grid(row=0, column=0, sticky="w", padx=(0, 8))
            Tooltip(self.label, self.info.help)
        self.input = self._build_input(self.frame)
        self.input.grid(row=0, column=1, sticky="w", pady=2)
        Tooltip(self.input, self.info.help)
        self.error_label = ctk.CTkLabel(self.frame, text="", text_color=ERROR_COLOR, anchor="w",
                                        justify="left", wraplength=460)
        self.error: str | None = None
        self.refresh()

    # subclasses -----------------------------------------------------------------------------
    def _build_input(self, parent: Any) -> Any:
        raise NotImplementedError

    def _show(self, value: Any) -> None:
        raise NotImplementedError

    def _mark(self, bad: bool) -> None:
        """Highlight the input itself (entries get a red border)."""

    def focus_widget(self) -> Any:
        return self.input

    # shared ---------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Show the config's value and the field's recorded error, if any."""
        self._updating = True
        try:
            self._show(self.binding.get(self.path))
        finally:
            self._updating = False
        error = self.binding.errors.get(self.path)
        self.show_error(str(error) if error else None)

    def show_error(self, message: str | None) -> None:
        self.error = message
        if message:
            self.error_label.configure(text=message)
            self.error_label.grid(row=1, column=1, sticky="w")
        else:
            self.error_label.grid_remove()
        self._mark(bool(message))

    def focus(self) -> None:
        self.focus_widget().focus_set()

    def set_enabled(self, enabled: bool) -> None:
        self.input.configure(state="normal" if enabled else "disabled")

    def _text_changed(self, text: str) -> None:
        if self._updating:
            return
        error = self.binding.set_text(self.path, text, source=self)
        self.show_error(str(error) if error else None)

    def _value_changed(self, value: Any) -> None:
        if self._updating:
            return
        self.binding.set_value(self.path, value, source=self)
        self.show_error(None)


class EntryView(FieldView):
    """int, float, optional float, str and comma-separated lists: a validated text entry."""
    WIDTHS = {"int": 140, "float": 140, "optional_float": 140, "str": 260, "list_str": 420,
              "path": 420}

    def _build_input(self, parent: Any) -> Any:
        self.var = tkinter.StringVar(parent)
        self.entry = ctk.CTkEntry(parent, textvariable=self.var,
                                  width=self.WIDTHS.get(self.info.kind, 200))
        self._border = self.entry.cget("border_color")
        self.var.trace_add("write", lambda *_: self._text_changed(self.var.get()))
        return self.entry

    def _show(self, value: Any) -> None:
        self.var.set(format_value(self.info, value))

    def _mark(self, bad: bool) -> None:
        self.entry.configure(border_color=ERROR_COLOR if bad else self._border)

    def focus_widget(self) -> Any:
        return self.entry

    def set_enabled(self, enabled: bool) -> None:
        self.entry.configure(state="normal" if enabled else "disabled")


class PathView(EntryView):
    """A path: entry plus a folder chooser, and a file chooser when the field accepts files
    (its `files` patterns, e.g. a base model that is a folder or a single checkpoint)."""

    def _build_input(self, parent: Any) -> Any:
        box = ctk.CTkFrame(parent, fg_color="transparent")
        super()._build_input(box)
        self.entry.pack(side="left")
        self.patterns: tuple[str, ...] = self.info.metadata.get("files", ())
        self.browse = ctk.CTkButton(box, text="Folder…" if self.patterns else "…",
                                    width=70 if self.patterns else 32, command=self._browse)
        self.browse.pack(side="left", padx=(4, 0))
        self.browse_file = None
        if self.patterns:
            self.browse_file = ctk.CTkButton(box, text="File…", width=60,
                                             command=self._browse_file)
            self.browse_file.pack(side="left", padx=(4, 0))
        return box

    def _browse(self) -> None:
        chosen = filedialog.askdirectory(parent=self.frame, title=self.info.label)
        if chosen:
            self.var.set(chosen)

    def _browse_file(self) -> None:
        chosen = filedialog.askopenfilename(
            parent=self.frame, title=self.info.label,
            filetypes=[(self.info.label, " ".join(self.patterns)), ("All files", "*")])
        if chosen:
            self.var.set(chosen)

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        for button in (self.browse, self.browse_file):
            if button is not None:
                button.configure(state="normal" if enabled else "disabled")


class BoolView(FieldView):
    """A switch next to the label, or (style='checkbox') a checkbox carrying the label."""

    def __init__(self, *args: Any, style: str = "switch", **kwargs: Any) -> None:
        self.style = style
        if style == "checkbox":
            kwargs["show_label"] = False
            self._text = kwargs.pop("label", None)
        super().__init__(*args, **kwargs)

    def _build_input(self, parent: Any) -> Any:
        self.var = tkinter.BooleanVar(parent)
        cls = ctk.CTkCheckBox if self.style == "checkbox" else ctk.CTkSwitch
        text = (self._text or self.info.label) if self.style == "checkbox" else ""
        self.toggle = cls(parent, text=text, variable=self.var, onvalue=True, offvalue=False)
        self.var.trace_add("write", lambda *_: self._value_changed(bool(self.var.get())))
        return self.toggle

    def _show(self, value: Any) -> None:
        self.var.set(bool(value))


class EnumView(FieldView):
    def _build_input(self, parent: Any) -> Any:
        self.var = tkinter.StringVar(parent)
        values = [m.value for m in self.info.enum_type]
        self.menu = ctk.CTkOptionMenu(parent, values=values, variable=self.var, width=220,
                                      dynamic_resizing=False)
        self.var.trace_add("write", lambda *_: self._value_changed(
            self.info.enum_type(self.var.get())))
        return self.menu

    def _show(self, value: Any) -> None:
        self.menu.set(value.value)


class TextBoxView(FieldView):
    """A multi-line list of strings (one per line), e.g. sampling prompts."""

    def _build_input(self, parent: Any) -> Any:
        self.textbox = ctk.CTkTextbox(parent, width=520, height=110, border_width=2)
        self._border = self.textbox.cget("border_color")
        self.textbox._textbox.bind("<<Modified>>", self._modified, add="+")
        return self.textbox

    def _modified(self, _event: Any = None) -> None:
        inner = self.textbox._textbox
        if inner.edit_modified():
            inner.edit_modified(False)
            self.commit()

    def commit(self) -> None:
        """Write the box's text to the config now (also runs on every modification)."""
        self._text_changed(self.textbox.get("1.0", "end-1c"))

    def set_text(self, text: str) -> None:
        """Replace the text as a user would (used by tests and by nothing else)."""
        self.textbox.delete("1.0", "end")
        self.textbox.insert("1.0", text)
        self.commit()

    def _show(self, value: Any) -> None:
        self.textbox.delete("1.0", "end")
        self.textbox.insert("1.0", format_value(self.info, value))
        self.textbox._textbox.edit_modified(False)

    def _mark(self, bad: bool) -> None:
        self.textbox.configure(border_color=ERROR_COLOR if bad else self._border)

    def focus_widget(self) -> Any:
        return self.textbox._textbox


class MultiEnumView(FieldView):
    """A list of enum values: one checkbox per member."""

    def _build_input(self, parent: Any) -> Any:
        box = ctk.CTkFrame(parent, fg_color="transparent")
        self.vars: dict[Any, tkinter.BooleanVar] = {}
        self.boxes: dict[Any, Any] = {}
        for member in self.info.enum_type:
            var = tkinter.BooleanVar(box)
            cb = ctk.CTkCheckBox(box, text=member.value, variable=var, onvalue=True,
                                 offvalue=False)
            cb.pack(side="left", padx=(0, 10))
            var.trace_add("write", lambda *_: self._value_changed(self._selected()))
            self.vars[member], self.boxes[member] = var, cb
        return box

    def _selected(self) -> list[Any]:
        return [m for m, var in self.vars.items() if var.get()]

    def _show(self, value: Any) -> None:
        for member, var in self.vars.items():
            var.set(member in value)

    def set_enabled(self, enabled: bool) -> None:
        for cb in self.boxes.values():
            cb.configure(state="normal" if enabled else "disabled")

    def focus_widget(self) -> Any:
        return next(iter(self.boxes.values()))


class ListView(FieldView):
    """A list of objects (dataset folders): one row of sub-views per item, add/remove buttons."""

    def _build_input(self, parent: Any) -> Any:
        box = ctk.CTkFrame(parent, fg_color="transparent")
        self.rows_frame = ctk.CTkFrame(box, fg_color="transparent")
        self.rows_frame.pack(fill="x")
        self.add_button = ctk.CTkButton(box, text="+ Add " + self.info.label.lower().rstrip("s"),
                                        width=140, command=self.add_row)
        self.add_button.pack(anchor="w", pady=(4, 0))
        self.rows: list[Any] = []
        self.item_views: list[FieldView] = []
        self.remove_buttons: list[Any] = []
        return box

    def _show(self, value: Any) -> None:
        from app.fields import iter_fields
        for row in self.rows:
            row.destroy()
        self.rows, self.item_views, self.remove_buttons = [], [], []
        for index in range(len(value)):
            row = ctk.CTkFrame(self.rows_frame, fg_color="transparent")
            row.pack(fill="x", pady=1)
            for column, sub in enumerate(iter_fields(self.info.item_type)):
                view = make_view(row, self.binding, f"{self.path}[{index}].{sub.dotted_path}",
                                 label_width=60 if column == 0 else 70)
                view.frame.grid(row=0, column=column, sticky="w", padx=(0, 10))
                self.item_views.append(view)
            remove = ctk.CTkButton(row, text="Remove", width=70,
                                   command=lambda i=index: self.remove_row(i))
            remove.grid(row=0, column=99, sticky="w")
            self.remove_buttons.append(remove)
            self.rows.append(row)

    def add_row(self) -> None:
        self.binding.add_list_item(self.path)

    def remove_row(self, index: int) -> None:
        self.binding.remove_list_item(self.path, index)

    def focus_widget(self) -> Any:
        return self.item_views[0].focus_widget() if self.item_views else self.add_button

    def set_enabled(self, enabled: bool) -> None:
        for view in self.item_views:
            view.set_enabled(enabled)


VIEW_CLASSES = {
    "bool": BoolView, "enum": EnumView, "int": EntryView, "float": EntryView,
    "optional_float": EntryView, "str": EntryView, "path": PathView, "list_enum": MultiEnumView,
    "list_dataclass": ListView,
}


def make_view(parent: Any, binding: ConfigBinding, path: str, **kwargs: Any) -> FieldView:
    """The view for the field at `path`, chosen by its kind (and `multiline` for string lists)."""
    info = binding.info(path)
    if info.kind == "list_str":
        cls = TextBoxView if info.metadata.get("multiline") else EntryView
    else:
        cls = VIEW_CLASSES[info.kind]
    return cls(parent, binding, path, **kwargs)


def set_readonly_text(box: Any, text: str) -> None:
    """Replace the whole text of a read-only CTkTextbox (reports, tables, logs)."""
    box.configure(state="normal")
    box.delete("1.0", "end")
    box.insert("1.0", text)
    box.configure(state="disabled")
