"""Find and replace across a dataset's caption files, with a preview and a way back.

`plan_replace` says what would change (files, matches, each caption before and after) and
writes nothing; `apply_replace` writes that plan after copying every file it changes into a
backup folder beside the images, `.tempera-caption-backup/<time>/` (hidden, so a scan never
trains on it), with a `manifest.json`; `undo_replace` puts those copies back. Only caption
files are changed: a caption from the captions file or the class caption is left alone.

Refusals leave every file as it was: an empty search, a bad regular expression, a folder that
is not writable, and a caption file that changed on disk since it was listed (all named).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from modules.data.caption_edit import (CaptionEditError, CaptionListing, check_writable,
                                       current_digest, decode_caption, digest_of,
                                       encode_caption)
from modules.util.atomic import atomic_write_bytes, atomic_write_text

BACKUP_FOLDER = ".tempera-caption-backup"
MANIFEST = "manifest.json"
PREVIEW_LINES = 20  # captions a preview shows before "... and N more"


@dataclass(frozen=True)
class Change:
    """One caption file the plan changes: its entry's index, the caption before and after."""
    index: int
    before: str
    after: str
    matches: int


@dataclass(frozen=True)
class ReplacePlan:
    find: str
    replacement: str
    regex: bool
    ignore_case: bool
    changes: tuple[Change, ...]

    @property
    def files(self) -> int:
        return len(self.changes)

    @property
    def matches(self) -> int:
        return sum(change.matches for change in self.changes)

    def summary(self) -> str:
        if not self.changes:
            return f"{self.find!r} is in no caption file"
        return (f"{self.matches} match(es) of {self.find!r} in {self.files} caption file(s) "
                f"would become {self.replacement!r}")

    def preview(self, listing: CaptionListing, lines: int = PREVIEW_LINES) -> list[str]:
        """One line per changed caption ("name: before → after"), the first `lines` of them."""
        shown = [f"{listing.entries[c.index].relative}: {c.before} → {c.after}"
                 for c in self.changes[:lines]]
        if len(self.changes) > lines:
            shown.append(f"… and {len(self.changes) - lines} more")
        return shown


@dataclass(frozen=True)
class ReplaceResult:
    backup: Path | None  # the folder holding the files as they were (None: nothing written)
    written: tuple[Path, ...]


def _pattern(find: str, regex: bool, ignore_case: bool) -> re.Pattern[str]:
    if not find:
        raise CaptionEditError("give the text to find")
    try:
        return re.compile(find if regex else re.escape(find), re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise CaptionEditError(f"{find!r} is not a valid regular expression: {exc}") from exc


def plan_replace(listing: CaptionListing, find: str, replacement: str, regex: bool = False,
                 ignore_case: bool = False) -> ReplacePlan:
    """What replacing `find` (plain text, or a Python regular expression with `regex`, where
    the replacement may use \\1) with `replacement` would change; writes nothing."""
    pattern = _pattern(find, regex, ignore_case)
    changes = []
    for index, entry in enumerate(listing.entries):
        if entry.caption_state not in ("file", "empty"):
            continue
        try:
            after, count = pattern.subn(replacement if regex else lambda _: replacement,
                                        entry.caption)
        except (re.error, IndexError) as exc:  # a bad group reference in the replacement
            raise CaptionEditError(f"the replacement {replacement!r} is not valid: {exc}") \
                from exc
        if count and after != entry.caption:
            changes.append(Change(index, entry.caption, after.strip(), count))
    return ReplacePlan(find, replacement, regex, ignore_case, tuple(changes))


def apply_replace(listing: CaptionListing, plan: ReplacePlan) -> ReplaceResult:
    """Write `plan` (from `plan_replace` on this listing) and update the listing, after
    backing up each file it changes. Refused before anything is written when a folder is
    not writable or a file changed on disk since it was listed (every such file named)."""
    if not plan.changes:
        return ReplaceResult(None, ())
    entries = [listing.entries[change.index] for change in plan.changes]
    for folder in sorted({entry.caption_file.parent for entry in entries}):
        check_writable(folder)
    changed = [entry.relative for entry in entries
               if current_digest(entry.caption_file) != entry.digest]
    if changed:
        raise CaptionEditError(f"{len(changed)} caption file(s) changed on disk since they were "
                               f"read: {', '.join(changed[:5])}{', …' if len(changed) > 5 else ''}"
                               "; reload the editor; nothing was written")
    assert listing.folder is not None  # a listing with entries has its folder
    try:
        backup = _backup(listing.folder, [entry.caption_file for entry in entries])
    except OSError as exc:
        raise CaptionEditError(f"the backup of the caption files could not be written ({exc}); "
                               "nothing was replaced") from exc
    written: list[Path] = []
    after = {}
    for change, entry in zip(plan.changes, entries):
        data = encode_caption(change.after, entry.style)
        try:
            atomic_write_bytes(entry.caption_file, data)
        except OSError as exc:  # a full disk mid-way: the files written so far are put back
            _put_back(listing.folder, backup, written)
            raise CaptionEditError(f"{entry.caption_file} could not be written ({exc}); the "
                                   "caption files are as they were") from exc
        written.append(entry.caption_file)
        after[entry.caption_file.relative_to(listing.folder).as_posix()] = digest_of(data)
    for change, entry in zip(plan.changes, entries):
        listing.entries[change.index] = replace(
            entry, caption=change.after, caption_state="file" if change.after else "empty",
            digest=digest_of(encode_caption(change.after, entry.style)))
    _write_manifest(backup, {"folder": str(listing.folder), "find": plan.find,
                             "replacement": plan.replacement, "regex": plan.regex,
                             "after": after})
    return ReplaceResult(backup, tuple(written))


def _backup(folder: Path, files: list[Path]) -> Path:
    """Copy `files` (under `folder`) into a new backup folder; its path."""
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
    backup = folder / BACKUP_FOLDER / stamp
    for path in files:
        target = backup / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    _write_manifest(backup, {"folder": str(folder), "after": {}})  # complete once rewritten
    return backup


def _put_back(folder: Path, backup: Path, files: list[Path]) -> None:
    for path in files:
        atomic_write_bytes(path, (backup / path.relative_to(folder)).read_bytes())


def _write_manifest(backup: Path, manifest: dict) -> None:
    atomic_write_text(backup / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False))


def undo_replace(backup: Path) -> list[Path]:
    """Put back the caption files a replace changed, from its backup folder; the files
    restored. Refused, with nothing restored, when one of them changed since the replace."""
    try:
        manifest = json.loads((backup / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CaptionEditError(f"{backup} is not a caption backup ({exc})") from exc
    folder = Path(manifest["folder"])
    after: dict[str, str] = manifest["after"]
    changed = [name for name, digest in after.items()
               if current_digest(folder / name) != digest]
    if changed:
        raise CaptionEditError(f"{len(changed)} caption file(s) changed since the replace: "
                               f"{', '.join(sorted(changed)[:5])}; nothing was restored (the "
                               f"copies are in {backup})")
    for name in after:
        check_writable((folder / name).parent)
    restored = []
    for name in sorted(after):
        data = (backup / name).read_bytes()
        decode_caption(data)  # a copy that no longer decodes is not put back over a good file
        atomic_write_bytes(folder / name, data)
        restored.append(folder / name)
    return restored
