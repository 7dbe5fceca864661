"""The caption editor's engine: a dataset's images with their captions and mask states, and
saving one caption in place (the Data tab's editor, app/caption_editor.py; docs/datasets.md).

Images and captions are found the way the scan finds them (modules/data/folders.py): the same
files (hidden ones left out, subfolders with `data.recursive`), the captions file first, then
the caption file beside the image, then the folder's class caption; masks by
modules/data/file_kinds.py and checked by modules/data/masks.py. A caption file is read as
training reads it (UTF-8, a byte-order mark allowed, the text stripped); a UTF-16 file (what
Notepad calls "Unicode") is shown too, with a note that training skips it, and is saved in the
encoding, line ending and final newline it had.

Nothing is overwritten silently: a save re-reads the file and refuses when it changed since it
was listed (someone else's edit), and refuses a folder it cannot write before it writes. An
image that cannot be read is listed with its reason, never fatal to the listing.
"""
from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from modules.data.captions import CaptionsFileError, load_captions_file
from modules.data.file_kinds import IMAGE_EXTENSIONS, split_masks
from modules.data.progress import ProgressCallback
from modules.util.atomic import atomic_file
from modules.util.cores import usable_cores

# A caption's state: where its text comes from, or why there is none.
CAPTION_STATES = {
    "file": "caption file",
    "empty": "empty caption file",
    "missing": "no caption file",
    "class": "no caption file: the folder's class caption",
    "listed": "from the captions file",
    "unreadable": "caption file unreadable",
}
# A mask's state (modules/data/masks.py): what limits the image's loss, if anything.
MASK_STATES = {
    "file": "mask file",
    "alpha": "alpha channel",
    "none": "no mask",
    "empty": "empty mask: keeps no pixel (all black), the image trains nothing",
    "unreadable": "mask unreadable",
}
EDITABLE = frozenset({"file", "empty", "missing", "class"})  # written to the caption file


class CaptionEditError(Exception):
    """A caption edit that was refused; nothing was written."""


@dataclass(frozen=True)
class TextStyle:
    """How a caption file is written: its encoding ("utf-8", "utf-8-sig" with a byte-order
    mark, "utf-16"), its line ending and whether it ends with one."""
    encoding: str = "utf-8"
    newline: str = "\n"
    final_newline: bool = False


@dataclass(frozen=True)
class CaptionEntry:
    """One image of the dataset: its caption as training reads it and its mask's state.

    `digest` is the caption file's content hash when it was read (None: there was no file),
    so a save can tell whether the file changed since. `image_problem` says why training
    skips the image ("" when it loads); `note` says anything else worth knowing."""
    image: Path
    relative: str
    caption_file: Path
    caption: str
    caption_state: str
    mask: Path | None = None
    mask_state: str = "none"
    image_problem: str = ""
    mask_problem: str = ""
    note: str = ""
    digest: str | None = None
    style: TextStyle = TextStyle()

    @property
    def editable(self) -> bool:
        return self.caption_state in EDITABLE


@dataclass
class CaptionListing:
    """A dataset folder's images in the scan's order, with what stopped the listing (`note`:
    no folder, no image) and problems that apply to the whole folder (a bad captions file)."""
    folder: Path | None
    extension: str = ".txt"
    entries: list[CaptionEntry] = field(default_factory=list)
    note: str = ""
    problems: list[str] = field(default_factory=list)
    captions_file: str = ""  # the dataset's captions file (its captions are edited there)

    def counts(self) -> dict[str, int]:
        """How many images each filter of `FILTERS` shows."""
        return {name: sum(1 for e in self.entries if keep(e)) for name, keep in FILTERS.items()}

    def shown(self, filter_name: str) -> list[int]:
        """The indices of the entries `filter_name` (a key of `FILTERS`) keeps."""
        keep = FILTERS[filter_name]
        return [i for i, entry in enumerate(self.entries) if keep(entry)]


def _no_caption(entry: CaptionEntry) -> bool:
    return entry.caption_state in ("missing", "class")


def _empty_caption(entry: CaptionEntry) -> bool:
    return entry.caption_state == "empty" or (entry.caption_state == "listed"
                                              and not entry.caption)


def _unreadable(entry: CaptionEntry) -> bool:
    return bool(entry.image_problem or entry.mask_problem
                or entry.caption_state == "unreadable")


# The editor's filters, in the order its menu lists them: name -> which entries it keeps.
FILTERS: dict[str, Callable[[CaptionEntry], bool]] = {
    "All images": lambda entry: True,
    "No caption file": _no_caption,
    "Empty caption": _empty_caption,
    "No mask": lambda entry: entry.mask_state == "none",
    "Empty mask": lambda entry: entry.mask_state == "empty",
    "Unreadable": _unreadable,
}


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def decode_caption(data: bytes) -> tuple[str, TextStyle]:
    """The text of a caption file's bytes (not yet stripped) and how it is written. Raises
    UnicodeDecodeError for text that is neither UTF-8 nor UTF-16 / UTF-32 with a byte-order
    mark (UTF-32's little-endian mark begins with UTF-16's, so it is tried first)."""
    if data.startswith(codecs.BOM_UTF8):
        encoding = "utf-8-sig"
    elif data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        encoding = "utf-32"
    elif data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        encoding = "utf-16"
    else:
        encoding = "utf-8"
    text = data.decode(encoding)
    newline = "\r\n" if "\r\n" in text else "\n"
    return text, TextStyle(encoding, newline, text.endswith(("\n", "\r")))


def encode_caption(text: str, style: TextStyle) -> bytes:
    """`text` as a caption file of `style` (its line ending, its final newline)."""
    body = text.strip().replace("\r\n", "\n").replace("\n", style.newline)
    if style.final_newline:
        body += style.newline
    return body.encode(style.encoding)


def read_caption_file(path: Path) -> tuple[str, str, TextStyle, str]:
    """(the caption as training reads it, the file's digest, its style, a note) of an existing
    caption file. Raises OSError or UnicodeDecodeError."""
    data = path.read_bytes()
    text, style = decode_caption(data)
    note = (f"{style.encoding.upper()} text: training reads UTF-8 only and skips this image; "
            "re-save it as UTF-8" if style.encoding in ("utf-16", "utf-32") else "")
    return text.strip(), digest_of(data), style, note


def mask_state(image: Path, mask: Path | None, size: tuple[int, int] | None,
               alpha: bool) -> tuple[str, str]:
    """(a key of MASK_STATES, the problem when it is unreadable) for one image's mask."""
    from modules.data.masks import check_mask, mask_is_blank
    if mask is None and not alpha:
        return "none", ""
    if mask is not None:
        why = check_mask(mask, size)
        if why:
            return "unreadable", why
    try:
        blank = mask_is_blank(mask, image, alpha)
    except Exception as exc:  # noqa: BLE001 - listed as the mask's problem, never fatal
        return "unreadable", str(exc)
    return ("empty" if blank else "file" if mask is not None else "alpha"), ""


def list_captions(ds, folder: Path | None, caption_extension: str, recursive: bool,
                  progress: ProgressCallback | None = None, threads: int | None = None
                  ) -> CaptionListing:
    """Every image of the dataset `ds` (a DatasetConfig) in `folder`, with its caption and mask
    state, in the scan's order. `progress(done, total)` is told as each image is checked."""
    from modules.data.errors import DatasetError
    from modules.data.folders import list_folder_files, normalize_caption_extension
    try:
        extension = normalize_caption_extension(caption_extension)
    except DatasetError as exc:
        return CaptionListing(folder, caption_extension, note=f"{exc} (data.caption_extension)")
    listing = CaptionListing(folder, extension, captions_file=ds.captions_file)
    if folder is None or not folder.is_dir():
        listing.note = f"no folder at {folder}" if folder else "choose a folder of images"
        return listing
    files, _hidden, _broken = list_folder_files(folder, recursive)
    images, masks = split_masks(files, [p for p in files
                                        if p.suffix.lower() in IMAGE_EXTENSIONS])
    if not images:
        listing.note = f"no image in {folder}"
        return listing
    listed: dict[str, str] = {}
    if ds.captions_file:
        try:
            listed = load_captions_file(Path(ds.captions_file))
        except CaptionsFileError as exc:
            listing.problems.append(f"{exc}; its captions are not shown")
    # the scan's matching: the caption file's name compared case-insensitively
    captions = {(f.parent, f.name.lower()): f for f in files
                if f.suffix.lower() == extension.lower()}
    with ThreadPoolExecutor(max_workers=threads or min(8, usable_cores())) as pool:
        for entry in pool.map(lambda image: _entry(ds, folder, image, masks, captions,
                                                   extension, listed),
                              images):  # map keeps the scan's order
            listing.entries.append(entry)
            if progress is not None:
                progress(len(listing.entries), len(images))
    return listing


def _entry(ds, folder: Path, image: Path, masks: dict[tuple[Path, str], Path],
           captions: dict[tuple[Path, str], Path], extension: str,
           listed: dict[str, str]) -> CaptionEntry:
    from modules.data.images import inspect_image
    check = inspect_image(image)
    mask = masks.get((image.parent, image.stem.lower()))
    state, mask_problem = mask_state(image, mask, check.size, check.alpha)
    if check.reason is not None:  # the mask cannot be checked against an unreadable image
        state, mask_problem = ("none", "") if mask is None else ("file", "")
    relative = image.relative_to(folder).as_posix()
    entry = CaptionEntry(image, relative, image.with_suffix(extension), "", "missing", mask,
                         state, f"unreadable: {check.reason}" if check.reason else "",
                         mask_problem)
    path = captions.get((image.parent, (image.stem + extension).lower()))
    return replace(entry, **_caption_of(ds, entry, path, listed))


def _caption_of(ds, entry: CaptionEntry, path: Path | None, listed: dict[str, str]) -> dict:
    """The fields of `entry` that say its caption, found as the scan finds it."""
    if entry.relative in listed or entry.image.name in listed:
        caption = listed.get(entry.relative, listed.get(entry.image.name, ""))
        return {"caption": caption, "caption_state": "listed",
                "note": f"from the captions file {ds.captions_file}: edit it there"}
    if path is None:
        default = ds.class_caption.strip()
        return {"caption": default, "caption_state": "class" if default else "missing",
                "caption_file": entry.caption_file}
    try:
        caption, digest, style, note = read_caption_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        return {"caption_file": path, "caption_state": "unreadable",
                "note": f"{path.name} cannot be read ({exc}); training skips this image"}
    return {"caption": caption, "caption_state": "file" if caption else "empty",
            "caption_file": path, "digest": digest, "style": style, "note": note}


def check_writable(folder: Path) -> None:
    """Refuse (CaptionEditError) a folder this user cannot write new files into."""
    if not os.access(folder, os.W_OK | os.X_OK):
        read_only = os.path.exists(folder) and bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        reason = "it is on a read-only file system" if read_only else \
            "this user may not write there"
        raise CaptionEditError(f"{folder} is not writable ({reason}); nothing was written")


def current_digest(path: Path) -> str | None:
    """The content hash of `path` now (None: no file there)."""
    try:
        return digest_of(path.read_bytes())
    except FileNotFoundError:
        return None


def check_unchanged(entry: CaptionEntry) -> None:
    """Refuse (CaptionEditError) when the caption file changed on disk since it was read."""
    now = current_digest(entry.caption_file)
    if now != entry.digest:
        what = ("was created" if entry.digest is None else "was deleted" if now is None
                else "changed")
        raise CaptionEditError(f"{entry.caption_file} {what} on disk since it was read (edited "
                               "elsewhere?); reload the editor to see it; nothing was written")


def write_caption(entry: CaptionEntry, text: str) -> CaptionEntry:
    """Write `text` to the entry's caption file atomically (temp file + os.replace) in its
    style; the entry as now on disk. The caller has checked it may."""
    data = encode_caption(text, entry.style)
    try:
        with atomic_file(entry.caption_file) as tmp:
            tmp.write_bytes(data)
    except OSError as exc:
        raise CaptionEditError(f"{entry.caption_file} could not be written ({exc}); the "
                               "file is as it was") from exc
    caption = text.strip()
    return replace(entry, caption=caption, caption_state="file" if caption else "empty",
                   digest=digest_of(data), note=entry.note if entry.caption_state in
                   ("file", "empty") else "")


def save_caption(listing: CaptionListing, index: int, text: str) -> CaptionEntry:
    """Save `text` as the caption of image `index` (creating its caption file when it has
    none) and update the listing. Refused, with nothing written: a caption that comes from
    the captions file, a caption file that cannot be decoded, a folder that is not writable,
    a file that changed on disk since it was read."""
    entry = listing.entries[index]
    if entry.caption_state == "listed":
        raise CaptionEditError(f"the caption of {entry.relative} comes from the captions file "
                               f"{listing.captions_file}; edit it there; nothing was written")
    if entry.caption_state == "unreadable":
        raise CaptionEditError(f"{entry.caption_file} is not UTF-8 text ({entry.note}); save "
                               "it as UTF-8 in a text editor first; nothing was written")
    check_writable(entry.caption_file.parent)
    check_unchanged(entry)
    saved = write_caption(entry, text)
    listing.entries[index] = saved
    return saved
