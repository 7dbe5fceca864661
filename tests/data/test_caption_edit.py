"""The caption editor's engine: listing (captions as training reads them, mask states,
unreadable images named), saving in place, find and replace with its preview and undo, and
each refusal leaving the files as they were."""
from __future__ import annotations

import codecs
import os
from pathlib import Path

import pytest
from PIL import Image

from modules.config import Config
from modules.config.data import DatasetConfig
from modules.data.caption_edit import (CaptionEditError, decode_caption, encode_caption,
                                       list_captions, save_caption)
from modules.data.caption_replace import (BACKUP_FOLDER, apply_replace, plan_replace,
                                          undo_replace)
from modules.data.folders import DatasetSource, scan_datasets


def image(path: Path, colour=(200, 30, 30), mode="RGB") -> Path:
    Image.new(mode, (16, 16), colour).save(path)
    return path


@pytest.fixture
def folder(tmp_path):
    """a: caption; b: empty caption + all-black mask; c: no caption + mask that keeps half;
    d: a broken image; e: UTF-8 with a BOM and CRLF; f: UTF-16; g: Latin-1 (undecodable)."""
    root = tmp_path / "data"
    root.mkdir()
    for name in "abcefg":
        image(root / f"{name}.png")
    (root / "a.txt").write_text("sks dog, red, grass", encoding="utf-8")
    (root / "b.txt").write_text("  \n", encoding="utf-8")
    Image.new("L", (16, 16), 0).save(root / "b_mask.png")
    half = Image.new("L", (16, 16), 0)
    half.paste(255, (0, 0, 8, 16))
    half.save(root / "c_mask.png")
    (root / "d.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    (root / "e.txt").write_bytes(codecs.BOM_UTF8 + "café, red dog\r\n".encode("utf-8"))
    (root / "f.txt").write_bytes("cat, red".encode("utf-16"))
    (root / "g.txt").write_bytes("déjà vu".encode("latin-1"))
    return root


def listing_of(folder: Path, **dataset):
    return list_captions(DatasetConfig(path=str(folder), **dataset), folder, ".txt", False)


def by_name(listing):
    return {entry.relative: entry for entry in listing.entries}


def test_listing_reads_captions_as_training_does_and_says_each_state(folder):
    listing = listing_of(folder)
    entries = by_name(listing)
    assert list(entries) == ["a.png", "b.png", "c.png", "d.png", "e.png", "f.png", "g.png"]
    scan = scan_datasets([DatasetSource(folder)], check_masks=True)
    trained = {item.path.name: item.caption for item in scan.items}
    for name in ("a.png", "b.png", "c.png", "e.png"):  # the same caption training reads
        assert entries[name].caption == trained[name]
    assert entries["e.png"].caption == "café, red dog"
    assert {n: e.caption_state for n, e in entries.items()} == {
        "a.png": "file", "b.png": "empty", "c.png": "missing", "d.png": "missing",
        "e.png": "file", "f.png": "file", "g.png": "unreadable"}
    assert entries["f.png"].caption == "cat, red" and "UTF-16" in entries["f.png"].note
    assert "training skips" in entries["g.png"].note
    assert {n: e.mask_state for n, e in entries.items()} == {
        "a.png": "none", "b.png": "empty", "c.png": "file", "d.png": "none", "e.png": "none",
        "f.png": "none", "g.png": "none"}
    # the broken image is listed and named, the rest still listed
    assert entries["d.png"].image_problem.startswith("unreadable: ")
    assert {p.name for p, _ in scan.skipped} >= {"d.png"}
    assert scan.blank_masks == [folder / "b.png"]


def test_the_filters_pick_the_images_with_no_caption_or_an_empty_mask(folder):
    listing = listing_of(folder)
    names = lambda which: [listing.entries[i].relative for i in listing.shown(which)]  # noqa: E731
    assert names("No caption file") == ["c.png", "d.png"]
    assert names("Empty caption") == ["b.png"]
    assert names("Empty mask") == ["b.png"]
    assert names("No mask") == ["a.png", "d.png", "e.png", "f.png", "g.png"]
    assert names("Unreadable") == ["d.png", "g.png"]
    assert listing.counts()["All images"] == 7


def test_the_class_caption_and_the_captions_file_are_shown_as_training_uses_them(folder,
                                                                                   tmp_path):
    captions = tmp_path / "captions.json"
    captions.write_text('{"a.png": "from the file"}', encoding="utf-8")
    listing = listing_of(folder, class_caption="a photo", captions_file=str(captions))
    entries = by_name(listing)
    assert (entries["a.png"].caption, entries["a.png"].caption_state) == ("from the file",
                                                                         "listed")
    assert (entries["c.png"].caption, entries["c.png"].caption_state) == ("a photo", "class")
    index = listing.entries.index(entries["a.png"])
    with pytest.raises(CaptionEditError, match="captions file .*captions.json; edit it there"):
        save_caption(listing, index, "new")
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks dog, red, grass"


def test_a_listing_of_no_folder_or_no_image_says_why(tmp_path):
    assert "no folder" in listing_of(tmp_path / "missing").note
    assert "no image" in listing_of(tmp_path).note
    empty = list_captions(DatasetConfig(path=str(tmp_path)), tmp_path, " ", False)
    assert "caption extension is empty" in empty.note and not empty.entries


def test_saving_keeps_the_files_encoding_line_ending_and_writes_atomically(folder):
    listing = listing_of(folder)
    index = {e.relative: i for i, e in enumerate(listing.entries)}
    saved = save_caption(listing, index["e.png"], "café, blue dog")
    assert (folder / "e.txt").read_bytes() == codecs.BOM_UTF8 + "café, blue dog\r\n".encode()
    assert listing.entries[index["e.png"]] == saved and saved.caption == "café, blue dog"
    save_caption(listing, index["f.png"], "cat, blue")
    assert (folder / "f.txt").read_bytes().decode("utf-16") == "cat, blue"
    save_caption(listing, index["e.png"], "again")  # the saved entry knows its new content
    created = save_caption(listing, index["c.png"], "a new caption")
    assert (folder / "c.txt").read_text(encoding="utf-8") == "a new caption"
    assert created.caption_state == "file"
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_a_caption_changed_on_disk_since_it_was_read_is_not_overwritten(folder):
    listing = listing_of(folder)
    (folder / "a.txt").write_text("someone else's edit", encoding="utf-8")
    with pytest.raises(CaptionEditError, match="changed on disk since it was read"):
        save_caption(listing, 0, "mine")
    assert (folder / "a.txt").read_text(encoding="utf-8") == "someone else's edit"
    (folder / "c.txt").write_text("made elsewhere", encoding="utf-8")
    with pytest.raises(CaptionEditError, match="was created on disk"):
        save_caption(listing, 2, "mine")
    assert (folder / "c.txt").read_text(encoding="utf-8") == "made elsewhere"


def test_an_undecodable_caption_file_is_refused_not_overwritten(folder):
    listing = listing_of(folder)
    with pytest.raises(CaptionEditError, match="not UTF-8"):
        save_caption(listing, 6, "new")
    assert (folder / "g.txt").read_bytes() == "déjà vu".encode("latin-1")


def as_other_user(fn):
    """Run `fn` in a child process as the user `nobody` when this is root (root may write
    anywhere); its exception's message, or "" when it returned."""
    if os.geteuid() != 0:
        try:
            fn()
        except CaptionEditError as exc:
            return str(exc)
        return ""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, report, exit without running pytest's teardown
        os.close(read)
        message = ""
        try:
            os.setgid(65534)
            os.setuid(65534)
            fn()
        except CaptionEditError as exc:
            message = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as a failure
            message = f"UNEXPECTED {type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_a_folder_that_is_not_writable_is_refused(folder):
    listing = listing_of(folder)
    plan = plan_replace(listing, "red", "blue")
    folder.chmod(0o555)
    try:
        assert "is not writable" in as_other_user(lambda: save_caption(listing, 0, "mine"))
        assert "is not writable" in as_other_user(lambda: apply_replace(listing, plan))
    finally:
        folder.chmod(0o755)
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks dog, red, grass"
    assert not (folder / BACKUP_FOLDER).exists()


def test_find_and_replace_previews_then_writes_backs_up_and_undoes(folder):
    listing = listing_of(folder)
    plan = plan_replace(listing, "red", "blue")
    assert (plan.files, plan.matches) == (3, 3)  # a, e, f (g cannot be read, c has no file)
    assert plan.preview(listing)[0] == "a.png: sks dog, red, grass → sks dog, blue, grass"
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks dog, red, grass"  # a preview
    before = {p.name: p.read_bytes() for p in folder.glob("*.txt")}
    result = apply_replace(listing, plan)
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks dog, blue, grass"
    assert (folder / "e.txt").read_bytes() == codecs.BOM_UTF8 + "café, blue dog\r\n".encode()
    assert result.backup is not None and result.backup.parent == folder / BACKUP_FOLDER
    assert listing.entries[0].caption == "sks dog, blue, grass"
    assert [e.relative for e in listing_of(folder).entries] == [e.relative
                                                                for e in listing.entries]
    restored = undo_replace(result.backup)
    assert sorted(p.name for p in restored) == ["a.txt", "e.txt", "f.txt"]
    assert {p.name: p.read_bytes() for p in folder.glob("*.txt")} == before


def test_regex_replace_and_its_refusals(folder):
    listing = listing_of(folder)
    plan = plan_replace(listing, r"(\w+) dog", r"\1 cat", regex=True)
    assert [c.after for c in plan.changes] == ["sks cat, red, grass", "café, red cat"]
    assert plan_replace(listing, "RED", "x", ignore_case=True).files == 3
    assert plan_replace(listing, "RED", "x").files == 0
    assert plan_replace(listing, "a.b", "x").files == 0  # plain text: the dot is a dot
    for find, replacement, why in (("", "x", "give the text"),
                                   ("(", "x", "not a valid regular expression"),
                                   ("dog", r"\2", "replacement .* not valid")):
        with pytest.raises(CaptionEditError, match=why):
            plan_replace(listing, find, replacement, regex=True)


def test_replace_and_undo_refuse_files_changed_on_disk(folder):
    listing = listing_of(folder)
    plan = plan_replace(listing, "red", "blue")
    (folder / "e.txt").write_text("edited elsewhere, red", encoding="utf-8")
    with pytest.raises(CaptionEditError, match="1 caption file.*e.png; reload"):
        apply_replace(listing, plan)
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks dog, red, grass"
    assert not (folder / BACKUP_FOLDER).exists()
    listing = listing_of(folder)
    result = apply_replace(listing, plan_replace(listing, "red", "blue"))
    assert result.backup is not None
    (folder / "a.txt").write_text("edited after the replace", encoding="utf-8")
    with pytest.raises(CaptionEditError, match="changed since the replace: a.txt"):
        undo_replace(result.backup)
    assert (folder / "a.txt").read_text(encoding="utf-8") == "edited after the replace"
    assert (folder / "e.txt").read_text(encoding="utf-8") == "edited elsewhere, blue"


def test_the_frontend_lists_a_configured_dataset(folder):
    from modules import frontend
    config = Config()
    config.data.datasets = [DatasetConfig(path=str(folder))]
    seen = []
    listing = frontend.caption_listing(config, 0, lambda done, total: seen.append((done, total)))
    assert len(listing.entries) == 7 and seen[-1] == (7, 7)


def test_a_mask_that_cannot_be_used_is_listed_with_its_reason(tmp_path):
    image(tmp_path / "a.png")
    Image.new("L", (8, 8), 255).save(tmp_path / "a_mask.png")  # not the image's size
    image(tmp_path / "b.png", (0, 0, 0, 0), mode="RGBA")  # fully transparent: keeps nothing
    entries = by_name(listing_of(tmp_path))
    assert entries["a.png"].mask_state == "unreadable"
    assert "a_mask.png: 8x8 pixels, but its image is 16x16" in entries["a.png"].mask_problem
    assert entries["b.png"].mask_state == "empty"


def test_a_replace_that_fails_mid_way_puts_back_what_it_wrote(folder, monkeypatch):
    import modules.data.caption_replace as caption_replace
    listing = listing_of(folder)
    before = {p.name: p.read_bytes() for p in folder.glob("*.txt")}
    real, calls = caption_replace.atomic_write_bytes, []

    def disk_full_on_the_second(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(path, data)
    monkeypatch.setattr(caption_replace, "atomic_write_bytes", disk_full_on_the_second)
    with pytest.raises(CaptionEditError, match="No space left.*as they were"):
        apply_replace(listing, plan_replace(listing, "red", "blue"))
    assert {p.name: p.read_bytes() for p in folder.glob("*.txt")} == before
    assert listing.entries[0].caption == "sks dog, red, grass"  # the listing says so too


def test_utf32_captions_are_read_and_written_as_utf32():
    """The editor and the captioning job read captions through one decoder: UTF-32's
    little-endian mark begins with UTF-16's, and must not be read as UTF-16 (NULs in the text)."""
    for data in ("cat, red".encode("utf-32"), codecs.BOM_UTF32_BE + "cat, red".encode("utf-32-be")):
        text, style = decode_caption(data)
        assert (text, style.encoding) == ("cat, red", "utf-32")
        assert encode_caption("cat, blue", style).decode("utf-32") == "cat, blue"
