"""Helpers for text boxes and entries that every panel shares: a read-only box's text, the
mouse wheel passed to the page at a box's ends, and Ctrl+A selecting everything."""
from __future__ import annotations

from typing import Any

import customtkinter as ctk


def page_of(widget: Any) -> Any | None:
    """The scrollable page (CTkScrollableFrame) `widget` sits in, if any."""
    master = widget.master
    while master is not None and not isinstance(master, ctk.CTkScrollableFrame):
        master = master.master
    return master


def pass_wheel_at_ends(box: Any) -> None:
    """Let the mouse wheel over a text box scroll the page around it once the box itself
    cannot scroll further that way (customtkinter's pages ignore the wheel over text boxes,
    so the page stopped under the pointer)."""
    text = box._textbox

    def wheel(event: Any) -> str | None:
        up = event.num == 4 or getattr(event, "delta", 0) > 0
        first, last = text.yview()
        if (up and first > 0.0) or (not up and last < 1.0):
            return None  # the box scrolls itself
        page = page_of(box)
        if page is None:
            return None
        page._parent_canvas.yview_scroll(-1 if up else 1, "units")
        return "break"

    for sequence in ("<Button-4>", "<Button-5>", "<MouseWheel>"):
        text.bind(sequence, wheel, add="+")


def set_readonly_text(box: Any, text: str) -> None:
    """Replace the whole text of a read-only CTkTextbox (reports, tables, logs)."""
    box.configure(state="normal")
    box.delete("1.0", "end")
    box.insert("1.0", text)
    box.configure(state="disabled")


def bind_select_all(root: Any) -> None:
    """Ctrl+A selects the whole text of an entry or text box, as on other desktops. Tk's own
    class bindings make it "go to the line's start" (Emacs keys) on X11, which loses a user
    who wants to replace a value."""
    def entry_select_all(event: Any) -> str:
        event.widget.select_range(0, "end")
        event.widget.icursor("end")
        return "break"

    def text_select_all(event: Any) -> str:
        event.widget.tag_add("sel", "1.0", "end-1c")
        event.widget.mark_set("insert", "end-1c")
        return "break"

    for sequence in ("<Control-a>", "<Control-A>"):
        root.bind_class("Entry", sequence, entry_select_all)
        root.bind_class("Text", sequence, text_select_all)
