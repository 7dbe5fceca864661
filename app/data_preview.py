"""The preview in each dataset's box on the Data tab: one caption as a run would train it
(prefix, suffix, shuffled and dropped tags) and, with masked loss on, the folder's first image
with the part its mask leaves out tinted.

It asks `modules.frontend.dataset_preview`, the same caption rules and mask files a run uses,
and redraws shortly after any of the dataset's settings change; "Shuffle again" draws another
shuffle of the caption.
"""
from __future__ import annotations

from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding
from modules import frontend

REDRAW_DELAY_MS = 250  # typing a path redraws once, after the last key
WRAP = 520
SOURCES = {"file": "mask file", "alpha": "alpha channel", "none": "no mask: the whole image counts"}
REDRAW_ON = ("data.masked_loss", "data.recursive", "data.caption_extension", "data.datasets")


class DatasetPreviewView:
    """A caption line, a "Shuffle again" button and (masked loss) an image, in a dataset's
    box. `caption_text`, `image` (the PIL picture shown) and `mask_text` are what it shows."""

    def __init__(self, parent: Any, binding: ConfigBinding, index: int) -> None:
        self.binding, self.index, self.draw = binding, index, 0
        self.frame = ctk.CTkFrame(parent, fg_color="transparent")
        self.caption = ctk.CTkLabel(self.frame, text="", anchor="w", justify="left",
                                    wraplength=WRAP, font=ctk.CTkFont(size=12))
        self.caption.grid(row=0, column=0, sticky="w")
        self.shuffle = ctk.CTkButton(self.frame, text="Shuffle again", width=100,
                                     command=self.shuffle_again)
        self.shuffle.grid(row=0, column=1, sticky="w", padx=(10, 0))
        self.picture = ctk.CTkLabel(self.frame, text="", anchor="w", justify="left",
                                    font=ctk.CTkFont(size=11))
        self.caption_text, self.mask_text, self.image = "", "", None
        self._pending: str | None = None
        binding.subscribe(self._on_change)
        self.refresh()

    def _on_change(self, path: str | None, _source: object | None) -> None:
        if not self.frame.winfo_exists():
            return  # the row was rebuilt; a new view shows it
        if path is None or path.startswith(REDRAW_ON):
            if self._pending is not None:
                self.frame.after_cancel(self._pending)
            self._pending = self.frame.after(REDRAW_DELAY_MS, self.refresh)

    def shuffle_again(self) -> None:
        self.draw += 1
        self.refresh()

    def refresh(self) -> None:
        """Ask the engine for the preview and show it."""
        self._pending = None
        if not self.frame.winfo_exists() or self.index >= len(self.binding.config.data.datasets):
            return
        preview = frontend.dataset_preview(self.binding.config, self.index, self.draw)
        if preview.note:
            self.caption_text = f"Preview: {preview.note}"
        else:
            shown = preview.trained or "(empty caption)"
            self.caption_text = f"{preview.image.name} trains as: {shown}"
        self.caption.configure(text=self.caption_text)
        self.shuffle.configure(state="normal" if preview.varies else "disabled")
        self._show_mask(preview)

    def _show_mask(self, preview: Any) -> None:
        self.image = preview.overlay
        if self.image is None:
            self.mask_text = ""
            self.picture.grid_remove()
            return
        self.mask_text = f"Loss mask ({SOURCES[preview.mask_source]}); tinted parts are left out"
        picture = ctk.CTkImage(light_image=self.image, dark_image=self.image,
                               size=self.image.size)
        self.picture.configure(image=picture, text=self.mask_text, compound="top")
        self.picture.grid(row=1, column=0, columnspan=2, sticky="w", pady=(4, 0))
