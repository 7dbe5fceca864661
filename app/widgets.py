"""One view class per field kind; `make_view` picks it from the field's metadata.

A view owns a label, an input, an error line and a tooltip with the field's help text. It reads
its value from the binding and writes user input back through it (tk variables with traces,
so `.set()`, `.select()` and typing all take the same path).

The error line is always there, empty while the field is fine, so a message never moves the
fields below it (a click aimed at the next field lands there); it is cut to the field's width
and the whole text shows on hover. Disabled inputs are greyed (customtkinter keeps most of
their colours), with the reason in the tooltip.
"""
from __future__ import annotations

import tkinter
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding, enum_class, format_value
from app.dialogs import ask_directory, ask_open_file
from app.labels import enum_label, enum_member
from app.readable import readable
from app.text_boxes import pass_wheel_at_ends
from app.tooltip import Tooltip

ERROR_COLOR = ("#c62828", "#ef5350")
HINT_COLOR = ("gray40", "gray62")
LABEL_WIDTH = 200
DISABLED_TEXT = ("gray60", "gray45")
DISABLED_FILL = ("gray78", "gray32")
# What greying a disabled widget changes, by widget class (the first match wins).
DISABLED_LOOK: tuple[tuple[type, dict[str, Any]], ...] = (
    (ctk.CTkOptionMenu, {"fg_color": DISABLED_FILL, "button_color": DISABLED_FILL}),
    (ctk.CTkButton, {"fg_color": DISABLED_FILL}),
    (ctk.CTkSwitch, {"progress_color": DISABLED_FILL, "button_color": DISABLED_TEXT}),
    (ctk.CTkCheckBox, {"fg_color": DISABLED_FILL, "border_color": DISABLED_FILL}),
    (ctk.CTkEntry, {"fg_color": ("gray88", "gray22"), "text_color": DISABLED_TEXT}),
)


def set_widget_enabled(widget: Any, enabled: bool) -> None:
    """Enable or disable a customtkinter widget so that it also looks it."""
    look = next((colors for cls, colors in DISABLED_LOOK if isinstance(widget, cls)), {})
    own = widget.__dict__.setdefault("_tempera_colors", {k: widget.cget(k) for k in look})
    widget.configure(state="normal" if enabled else "disabled", **(own if enabled else look))


def set_label_enabled(label: Any, enabled: bool) -> None:
    """Grey a label's text, or give it back its own colour (a label has no state to set)."""
    own = label.__dict__.setdefault("_tempera_text_color", label.cget("text_color"))
    label.configure(text_color=own if enabled else DISABLED_TEXT)


def grid_hide(widget: Any) -> None:
    """`grid_remove` that stays removed: customtkinter repeats a widget's last grid() call on
    every UI-scale change, which would show a closed panel or a collapsed section again."""
    widget.grid_remove()
    widget._last_geometry_manager_call = None


def elide(text: str, font: Any, width: float) -> str:
    """`text` cut with "…" to fit `width` pixels in `font` (whole when it fits)."""
    if font.measure(text) <= width:
        return text
    low, high = 0, len(text)
    while low < high:
        middle = (low + high + 1) // 2
        if font.measure(text[:middle].rstrip() + "…") <= width:
            low = middle
        else:
            high = middle - 1
    return text[:low].rstrip() + "…"


class FieldView:
    """Base: label + input + error line for the field at `path`."""

    def __init__(self, parent: Any, binding: ConfigBinding, path: str, label: str | None = None,
                 show_label: bool = True, label_width: int = LABEL_WIDTH) -> None:
        self.binding, self.path = binding, path
        self.info = binding.info(path)
        self._updating = False
        self.enabled, self.disabled_why = True, ""
        self.frame = ctk.CTkFrame(parent, fg_color="transparent")
        self.frame.grid_columnconfigure(1, weight=1)
        self.label = None
        self.tooltips: list[Tooltip] = []
        if show_label:
            self.label = ctk.CTkLabel(self.frame, text=label or self.info.label, anchor="w",
                                      width=label_width)
            self.label.grid(row=0, column=0, sticky="w", padx=(0, 8))
            self.tooltips.append(Tooltip(self.label, self.info.help))
        self.input = self._build_input(self.frame)
        self.input.grid(row=0, column=1, sticky="w", pady=(2, 0))
        self.tooltips.append(Tooltip(self.input, self.info.help))
        self.error_font = ctk.CTkFont(size=11)
        self.error_label = ctk.CTkLabel(self.frame, text="", text_color=ERROR_COLOR, anchor="w",
                                        height=15, font=self.error_font)
        self.error_label.grid(row=1, column=1, sticky="w")
        self.error_tip = Tooltip(self.error_label, "")
        self.error: str | None = None
        self.hint = ""
        self.refresh()

    # subclasses -----------------------------------------------------------------------------
    def _build_input(self, parent: Any) -> Any:
        raise NotImplementedError

    def _show(self, value: Any) -> None:
        raise NotImplementedError

    def _mark(self, bad: bool) -> None:
        """Highlight the input itself (entries get a red border)."""

    def _set_input_enabled(self, enabled: bool) -> None:
        set_widget_enabled(self.input, enabled)

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

    def show_own_error(self) -> None:
        """Show only the field's own parse error (or none), leaving its text as typed: a
        problem listed for it by a start check is gone."""
        error = self.binding.errors.get(self.path)
        self.show_error(str(error) if error else None)

    def error_width(self) -> float:
        """Pixels (unscaled) the error line may use: the field's width less its label."""
        scale = self.frame._get_widget_scaling()
        width = self.frame.winfo_width()
        if width <= 1:  # not laid out yet
            width = self.frame.winfo_reqwidth()
        if self.label is not None:
            width -= self.label.winfo_reqwidth() + 8 * scale
        return max(width / scale, 120)

    def show_error(self, message: str | None) -> None:
        """The message in red in the error line (None: the field is fine; its hint, if any,
        shows there in grey)."""
        self.error = message
        text = message or self.hint
        self.error_label.configure(
            text=elide(text, self.error_font, self.error_width()) if text else "",
            text_color=ERROR_COLOR if message else HINT_COLOR)
        self.error_tip.text = text
        self._mark(bool(message))
        self._update_tooltips()

    def set_hint(self, text: str) -> None:
        """A grey note in the error line while the field has no error (what empty means)."""
        self.hint = text
        self.show_error(self.error)

    def _update_tooltips(self) -> None:
        """The help text, after the error and why the field is greyed, as the window names
        things (`app.readable`: *LoHa*, not LOHA; a field's label, not its config path)."""
        own = self.info.enum_type if self.info.kind in ("enum", "list_enum") else None
        text = readable(self.info.help, own)
        if self.error:
            text = f"{self.error}\n\n{text}"
        if not self.enabled and self.disabled_why:
            text = f"Not used now: {readable(self.disabled_why, own)}\n\n{text}"
        for tip in self.tooltips:
            tip.text = text

    def focus(self) -> None:
        self.focus_widget().focus_set()

    def set_enabled(self, enabled: bool, why: str = "") -> None:
        """Enable or grey out the input and its label; `why` is added to the tooltip."""
        self.enabled, self.disabled_why = enabled, ("" if enabled else why)
        self._set_input_enabled(enabled)
        if self.label is not None:
            set_label_enabled(self.label, enabled)
        self._update_tooltips()

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


class ReadOnlyView(FieldView):
    """A value shown, not edited (the config version: the loader's migrations own it)."""

    def _build_input(self, parent: Any) -> Any:
        self.value_label = ctk.CTkLabel(parent, text="", anchor="w")
        return self.value_label

    def _show(self, value: Any) -> None:
        self.value_label.configure(text=format_value(self.info, value))

    def _set_input_enabled(self, enabled: bool) -> None:
        """Nothing to enable."""


class EntryView(FieldView):
    """int, float, optional float, str and comma-separated lists: a validated text entry."""
    WIDTHS = {"int": 140, "float": 140, "optional_float": 140, "str": 260, "list_str": 420,
              "list_int": 260,
              "path": 320}

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

    def _set_input_enabled(self, enabled: bool) -> None:
        set_widget_enabled(self.entry, enabled)


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
        chosen = ask_directory(self.frame, self.info.label, self.var.get())
        if chosen:
            self.var.set(chosen)

    def _browse_file(self) -> None:
        chosen = ask_open_file(self.frame, self.info.label, self.var.get(),
                               (self.info.label, self.patterns))
        if chosen:
            self.var.set(chosen)

    def _set_input_enabled(self, enabled: bool) -> None:
        super()._set_input_enabled(enabled)
        for button in (self.browse, self.browse_file):
            if button is not None:
                set_widget_enabled(button, enabled)


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
    """An option menu of the enum's labels (app.labels); a value's name is accepted too."""

    def _build_input(self, parent: Any) -> Any:
        self.var = tkinter.StringVar(parent)
        labels = [enum_label(m) for m in enum_class(self.info)]
        self.menu = ctk.CTkOptionMenu(parent, values=labels, variable=self.var, width=260,
                                      dynamic_resizing=False)
        self.var.trace_add("write", lambda *_: self._picked(self.var.get()))
        return self.menu

    def _picked(self, text: str) -> None:
        if self._updating:
            return
        member = enum_member(enum_class(self.info), text)
        self._value_changed(member)
        if text != enum_label(member):  # a value's name (a script, a test): show its label
            self._updating = True
            try:
                self._show(member)
            finally:
                self._updating = False

    def pick(self, member: Any) -> None:
        """Choose `member` (or its value's name) as a user picking it from the menu would."""
        text = member if isinstance(member, str) else enum_label(member)
        self.menu._dropdown_callback(enum_label(enum_member(enum_class(self.info), text)))

    def _show(self, value: Any) -> None:
        self.menu.set(enum_label(value))


class TextBoxView(FieldView):
    """A multi-line list of strings (one per line), e.g. sampling prompts."""

    def _build_input(self, parent: Any) -> Any:
        self.textbox = ctk.CTkTextbox(parent, width=520, height=110, border_width=2)
        self._border = self.textbox.cget("border_color")
        self.textbox._textbox.bind("<<Modified>>", self._modified, add="+")
        pass_wheel_at_ends(self.textbox)
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
        for member in enum_class(self.info):
            var = tkinter.BooleanVar(box)
            cb = ctk.CTkCheckBox(box, text=enum_label(member), variable=var, onvalue=True,
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

    def _set_input_enabled(self, enabled: bool) -> None:
        for cb in self.boxes.values():
            set_widget_enabled(cb, enabled)

    def focus_widget(self) -> Any:
        return next(iter(self.boxes.values()))


ITEM_FIELDS_PER_LINE = 2  # a list item's fields per line (ListView)


NARROW_KINDS = ("bool", "int", "float", "optional_float")  # two of these share a line


def item_grid(item_type: type, several: bool) -> list[tuple[int, int, int]]:
    """(line, column, columns spanned) of each field of a list item: all on one line for a
    small item; else a line per text or path field and two numbers or switches a line, so
    the item fits a 1000-pixel window."""
    from app.fields import iter_fields
    places: list[tuple[int, int, int]] = []
    line, column = 0, 0
    for sub in iter_fields(item_type):
        if not several:
            places.append((0, len(places), 1))
            continue
        narrow = sub.kind in NARROW_KINDS
        if column and not narrow:
            line, column = line + 1, 0
        places.append((line, column, 1 if narrow else ITEM_FIELDS_PER_LINE))
        column = column + 1 if narrow and column + 1 < ITEM_FIELDS_PER_LINE else 0
        line += 1 if column == 0 else 0
    return places


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
        self.previews: list[Any] = []
        several = len(list(iter_fields(self.info.item_type))) > 2
        for index in range(len(value)):
            # An item with more than two fields is a framed card, two fields a line, so a
            # dataset's caption settings stay inside the window's width.
            row = ctk.CTkFrame(self.rows_frame, fg_color="transparent",
                               border_width=1 if several else 0, corner_radius=6)
            row.pack(fill="x", pady=(1, 4 if several else 1))
            pad = 6 if several else 0
            places = item_grid(self.info.item_type, several)
            last = places[-1][0]
            for sub, (line, column, span) in zip(iter_fields(self.info.item_type), places):
                view = make_view(row, self.binding, f"{self.path}[{index}].{sub.dotted_path}",
                                 label_width=(90 if several else 60) if column == 0 else 100)
                view.frame.grid(row=line, column=column, columnspan=span, sticky="w",
                                padx=(pad if column == 0 else 0, 10),
                                pady=(pad if line == 0 else 0, pad if line == last else 0))
                self.item_views.append(view)
            self._add_preview(row, index, last + 1, pad)
            remove = ctk.CTkButton(row, text="Remove", width=70,
                                   command=lambda i=index: self.remove_row(i))
            remove.grid(row=0, column=ITEM_FIELDS_PER_LINE, sticky="nw", padx=(0, pad),
                        pady=(pad, 0))
            self.remove_buttons.append(remove)
            self.rows.append(row)
        if not self.enabled:
            self._set_input_enabled(False)

    def _add_preview(self, row: Any, index: int, line: int, pad: int) -> None:
        """A dataset's box ends with its caption (and mask) preview (app/data_preview.py)."""
        if self.path != "data.datasets":
            return
        from app.data_preview import DatasetPreviewView
        preview = DatasetPreviewView(row, self.binding, index)
        preview.frame.grid(row=line, column=0, columnspan=ITEM_FIELDS_PER_LINE, sticky="w",
                           padx=(pad, 10), pady=(0, pad))
        self.previews.append(preview)

    def add_row(self) -> None:
        self.binding.add_list_item(self.path)

    def remove_row(self, index: int) -> None:
        self.binding.remove_list_item(self.path, index)

    def focus_widget(self) -> Any:
        return self.item_views[0].focus_widget() if self.item_views else self.add_button

    def _set_input_enabled(self, enabled: bool) -> None:
        for view in self.item_views:
            view.set_enabled(enabled, self.disabled_why)
        for button in (self.add_button, *self.remove_buttons):
            set_widget_enabled(button, enabled)


VIEW_CLASSES = {
    "bool": BoolView, "enum": EnumView, "int": EntryView, "float": EntryView,
    "optional_float": EntryView, "str": EntryView, "path": PathView, "list_enum": MultiEnumView,
    "list_int": EntryView,
    "list_dataclass": ListView,
}


def make_view(parent: Any, binding: ConfigBinding, path: str, **kwargs: Any) -> FieldView:
    """The view for the field at `path`, chosen by its kind (and `multiline` for string lists)."""
    info = binding.info(path)
    cls: type[FieldView]
    if info.kind == "list_str":
        cls = TextBoxView if info.metadata.get("multiline") else EntryView
    else:
        cls = VIEW_CLASSES[info.kind]
    return cls(parent, binding, path, **kwargs)
