"""Tabs of field views generated from the config schema's metadata.

Each field's `group` names its tab; its parent object names its section; `advanced=True`
fields go into the tab's collapsible "More options". A new field with metadata appears here
without new GUI code. `FieldRegistry` maps dotted paths to views (problems jump through it).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding
from app.fields import FieldInfo, container_labels, iter_fields
from app.widgets import FieldView, ListView, ReadOnlyView, grid_hide, make_view
from modules.config import Config

TAB_TITLES = {"Advanced": "Advanced Options"}
TAB_ORDER = ("General", "Model", "Data", "Training", "Sampling", "Advanced")
READ_ONLY = {"config_version"}  # shown, not edited: the loader's migrations own it
_TRAILING_INDEX = re.compile(r"\[\d+\]$")
_ROW = re.compile(r"\[(\d+)\]")


def tab_title(group: str) -> str:
    return TAB_TITLES.get(group, group)


def groups_in_order() -> list[str]:
    """TAB_ORDER first, then any other group the schema declares, in schema order."""
    seen = list(TAB_ORDER)
    for info in iter_fields(Config):
        if info.group not in seen:
            seen.append(info.group)
    return seen


class MoreSection:
    """A tab's advanced fields behind "More options": their column frames sit in the same grid
    as the tab's other fields (below them), so both line up column for column."""

    def __init__(self, grid: Any, count: int) -> None:
        self.count = count
        self.button = ctk.CTkButton(grid, text="", anchor="w", fg_color="transparent",
                                    text_color=("gray10", "gray90"), hover=False,
                                    command=self.toggle)
        self.bodies: list[Any] = []  # the column frames (placed by ColumnLayout)
        self.expanded = False
        self.on_open: Callable[[], None] | None = None  # after a click opened it
        self._label()

    def _label(self) -> None:
        arrow = "▾" if self.expanded else "▸"
        self.button.configure(text=f"{arrow} More options ({self.count})")

    def toggle(self) -> None:
        """The button's click: open (then `on_open`) or close."""
        if self.expanded:
            self.collapse()
            return
        self.expand()
        if self.on_open is not None:
            self.on_open()

    def expand(self) -> None:
        if not self.expanded:
            for body in self.bodies:
                body.grid()
            self.expanded = True
            self._label()

    def collapse(self) -> None:
        if self.expanded:
            for body in self.bodies:
                grid_hide(body)
            self.expanded = False
            self._label()


class ColumnLayout:
    """A tab's column frames: side by side while they fit the tab's width, stacked in one
    column when they do not (a narrow window, a large UI scale), so no field is ever out of
    reach to the right. Bands are rows of columns: the fields, then "More options"."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, MoreSection | None]] = []  # a band (list) or a widget
        self.stacked: bool | None = None

    def needed_width(self) -> int:
        """Screen pixels the bands need side by side. They share the grid's columns, so each
        column is as wide as its widest band's frame, a collapsed "More options" counted too:
        opening it then never pushes a column past the edge (nor makes the tab jump)."""
        widths: dict[int, int] = {}
        for band, _ in self.items:
            if isinstance(band, list):
                for index, column in enumerate(band):
                    widths[index] = max(widths.get(index, 0), column.winfo_reqwidth() + 24)
        return sum(widths.values())

    def arrange(self, stacked: bool) -> bool:
        """Grid the bands side by side or stacked; False when that is already so."""
        if stacked == self.stacked:
            return False
        row = 0
        for item, more in self.items:
            if not isinstance(item, list):
                item.grid(row=row, column=0, columnspan=99, sticky="w", pady=(4, 8))
                row += 1
                continue
            for index, column in enumerate(item):
                column.grid(row=row + index if stacked else row, column=0 if stacked else index,
                            sticky="nwe", padx=(0, 24))
                if more is not None and not more.expanded:
                    grid_hide(column)
            row += len(item) if stacked else 1
        self.stacked = stacked
        return True


class FieldRegistry:
    """Dotted path -> views, the tab each lives on, and the More section that hides it."""

    def __init__(self) -> None:
        self.views: dict[str, list[FieldView]] = {}
        self.tab_of: dict[str, str] = {}
        self.more_of: dict[str, MoreSection] = {}
        self.section_titles: dict[str, Any] = {}  # parent path -> its section's title label
        self.layouts: list[ColumnLayout] = []  # every tab's columns

    def add(self, view: FieldView, tab: str, more: MoreSection | None = None) -> None:
        self.views.setdefault(view.path, []).append(view)
        self.tab_of.setdefault(view.path, tab)
        if more is not None:
            self.more_of[view.path] = more

    def all_views(self) -> Iterator[FieldView]:
        for views in self.views.values():
            for view in views:
                yield view
                if isinstance(view, ListView):
                    yield from view.item_views

    def view(self, path: str) -> FieldView:
        """The view of a field the form always shows (a KeyError naming it otherwise)."""
        found = self.find(path)
        if found is None:
            raise KeyError(f"no field view shows {path}")
        return found

    def find(self, path: str) -> FieldView | None:
        """The view for a problem's path: exact, else the list it indexes, else the first under it."""
        by_path: dict[str, FieldView] = {}
        for view in self.all_views():
            by_path.setdefault(view.path, view)
        if path in by_path:
            return by_path[path]
        trimmed = _TRAILING_INDEX.sub("", path)
        if trimmed in by_path:
            return by_path[trimmed]
        for candidate, view in by_path.items():
            if candidate.startswith(path + ".") or candidate.startswith(path + "["):
                return view
        return None

    def where(self, path: str) -> str:
        """A config path as the window names it: "Training › UNet › Learning rate", list rows
        counted from 1 ("Data › Datasets › row 2 › Path"); a group is named by its own label."""
        labels = container_labels(Config)
        view = self.find(path)
        if view is None:
            return labels.get(path, path)
        tab = self.tab_of.get(self.top_path(view.path)) or self.tab_of.get(view.path, "")
        parts = [tab]
        index = _ROW.search(path)
        if index is not None:  # a list's row, or a field of one
            list_view = self.views[self.top_path(view.path)][0]
            parts += [list_view.info.label, f"row {int(index.group(1)) + 1}"]
            if view is not list_view:
                parts.append(view.info.label)
        elif view.path != path:  # a group of fields, found through its first field
            parts.append(labels.get(path, path))
        else:
            section = labels.get(path.rsplit(".", 1)[0]) if "." in path else None
            parts += [section, view.info.label] if section and section != tab else [
                view.info.label]
        return " › ".join(p for p in parts if p)

    def top_path(self, path: str) -> str:
        """The registered (top-level) path a concrete path belongs to ('data.datasets[0].x' -> 'data.datasets')."""
        return path.split("[", 1)[0] if "[" in path else path

    def on_change(self, path: str | None, source: object | None) -> None:
        """Binding listener: refresh the other views of a changed path (all views on replace)."""
        if path is None:
            for views in self.views.values():
                for view in views:
                    view.refresh()
            return
        for view in self.views.get(path, []):
            if view is not source:
                view.refresh()


def _section_title(parent: str, labels: dict[str, str]) -> str:
    return labels.get(parent, "File") if parent else "File"


def _place_sections(grid: Any, sections: dict[str, list[FieldInfo]],
                    labels: dict[str, str], binding: ConfigBinding, registry: FieldRegistry,
                    tab: str, more: MoreSection | None, columns: int) -> list[Any]:
    """Sections of views in column frames of `grid`, dealt into `columns` columns, shortest
    column first; returns the column frames (ColumnLayout places them)."""
    cols = [ctk.CTkFrame(grid, fg_color="transparent") for _ in range(columns)]
    heights = [0] * columns
    for parent_path, infos in sections.items():
        index = heights.index(min(heights))
        heights[index] += len(infos) + 2
        box = ctk.CTkFrame(cols[index], corner_radius=8)
        box.pack(fill="x", pady=(0, 12), anchor="n")
        title = ctk.CTkLabel(box, text=_section_title(parent_path, labels),
                             font=ctk.CTkFont(size=14, weight="bold"), anchor="w")
        title.pack(anchor="w", padx=10, pady=(6, 2))
        registry.section_titles.setdefault(parent_path, title)
        for info in infos:
            view: FieldView
            if info.dotted_path in READ_ONLY:
                view = ReadOnlyView(box, binding, info.dotted_path)
            else:
                view = make_view(box, binding, info.dotted_path)
            view.frame.pack(fill="x", padx=10, pady=0)
            registry.add(view, tab, more)
        ctk.CTkFrame(box, height=6, fg_color="transparent").pack()
    for col, height in zip(cols, heights):
        if not height:  # fewer sections than columns: an empty frame would still take room
            col.destroy()
    return [col for col, height in zip(cols, heights) if height]


def build_fields(parent: Any, infos: Iterable[FieldInfo], binding: ConfigBinding,
                 registry: FieldRegistry, tab: str, columns: int = 2) -> MoreSection | None:
    """Sections of views for `infos` in `parent`; advanced ones behind "More options"."""
    labels = container_labels(Config)
    normal: dict[str, list[FieldInfo]] = {}
    advanced: dict[str, list[FieldInfo]] = {}
    for info in infos:
        (advanced if info.advanced else normal).setdefault(info.parent, []).append(info)
    grid = ctk.CTkFrame(parent, fg_color="transparent")
    grid.pack(fill="x", anchor="nw")
    layout = ColumnLayout()
    registry.layouts.append(layout)
    layout.items.append((_place_sections(grid, normal, labels, binding, registry, tab, None,
                                          columns), None))
    more = None
    if advanced:
        more = MoreSection(grid, sum(len(v) for v in advanced.values()))
        more.bodies = _place_sections(grid, advanced, labels, binding, registry, tab, more,
                                      columns)
        layout.items += [(more.button, None), (more.bodies, more)]
    layout.arrange(stacked=False)
    return more


def fields_of_group(group: str, skip: Collection[str] = frozenset()) -> list[FieldInfo]:
    return [i for i in iter_fields(Config) if i.group == group and i.dotted_path not in skip]


def scroll_to(scroll: Any, widget: Any, above: int = 40) -> None:
    """Scroll the page so `widget` sits `above` pixels below its top edge (as far as the
    page's length allows)."""
    scroll.update_idletasks()
    canvas = scroll._parent_canvas  # its scroll region follows the content on <Configure>,
    canvas.configure(scrollregion=canvas.bbox("all"))  # which has not come yet
    content_height = max(scroll.winfo_reqheight(), 1)
    offset = widget.winfo_rooty() - scroll.winfo_rooty()  # from the content's top
    if content_height > canvas.winfo_height():
        canvas.yview_moveto(max(0.0, (offset - above) / content_height))


def reveal(scroll: Any, button: Any) -> None:
    """After "More options" opens: when the button sits in the lower half of the page, the
    new fields would open below the fold, so the button is scrolled up to the top."""
    scroll.update_idletasks()
    canvas = scroll._parent_canvas
    if button.winfo_rooty() - canvas.winfo_rooty() > canvas.winfo_height() / 2:
        scroll_to(scroll, button, above=8)
