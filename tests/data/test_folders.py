"""Scanning dataset folders: captions, skipped files, errors, ordering."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from PIL import Image

from modules.data.errors import DatasetError
from modules.data.folders import DatasetSource, scan_datasets


def make_image(path: Path, size: tuple[int, int] = (32, 24), color=(200, 30, 30),
               caption: str | None = None, caption_extension: str = ".txt") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    if caption is not None:
        path.with_suffix(caption_extension).write_text(caption, encoding="utf-8")
    return path


def make_truncated_jpeg(path: Path) -> Path:
    noise = Image.effect_noise((64, 64), 64).convert("RGB")
    noise.save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def test_captions_are_read_stripped_and_utf8(tmp_path: Path) -> None:
    make_image(tmp_path / "a.png", caption="  a red square \n")
    make_image(tmp_path / "b.jpg", caption="café, naïve ☕")
    (tmp_path / "c.txt").write_bytes("\ufeffwith a BOM".encode("utf-8"))
    make_image(tmp_path / "c.webp")

    result = scan_datasets([DatasetSource(tmp_path)])

    assert [(i.path.name, i.caption) for i in result.items] == [
        ("a.png", "a red square"), ("b.jpg", "café, naïve ☕"), ("c.webp", "with a BOM")]
    assert result.num_missing_captions == 0


def test_caption_extension_is_configurable(tmp_path: Path) -> None:
    make_image(tmp_path / "a.png", caption="from .caption", caption_extension=".caption")
    (tmp_path / "a.txt").write_text("from .txt", encoding="utf-8")

    assert scan_datasets([DatasetSource(tmp_path)], caption_extension="caption").items[0].caption \
        == "from .caption"
    assert scan_datasets([DatasetSource(tmp_path)]).items[0].caption == "from .txt"


def test_missing_caption_is_empty_counted_and_reported(tmp_path: Path, caplog) -> None:
    make_image(tmp_path / "with.png", caption="hello")
    make_image(tmp_path / "without.png")

    with caplog.at_level(logging.WARNING, logger="tempera.data"):
        result = scan_datasets([DatasetSource(tmp_path)])

    without = next(i for i in result.items if i.path.name == "without.png")
    assert without.caption == "" and not without.has_caption
    assert result.missing_captions == [tmp_path / "without.png"]
    assert result.num_images == 2
    assert "without.png" in caplog.text


def test_extensions_are_case_insensitive_and_order_is_sorted(tmp_path: Path) -> None:
    for name in ("d.PNG", "b.JpEg", "a.jpg", "c.WEBP"):
        make_image(tmp_path / name)
    (tmp_path / "notes.json").write_text("{}")

    names = [i.path.name for i in scan_datasets([DatasetSource(tmp_path)], check_threads=4).items]
    one_thread = scan_datasets([DatasetSource(tmp_path)], check_threads=1).items

    assert names == ["a.jpg", "b.JpEg", "c.WEBP", "d.PNG"]
    assert [i.path.name for i in one_thread] == names


def test_corrupt_and_truncated_files_are_skipped_named_and_counted(tmp_path: Path,
                                                                   caplog) -> None:
    make_image(tmp_path / "good.png", caption="ok")
    (tmp_path / "noise.png").write_bytes(os.urandom(2048))
    make_truncated_jpeg(tmp_path / "cut.jpg")

    with caplog.at_level(logging.WARNING, logger="tempera.data"):
        result = scan_datasets([DatasetSource(tmp_path)])

    assert [i.path.name for i in result.items] == ["good.png"]
    assert result.num_skipped == 2
    assert {p.name for p, _ in result.skipped} == {"noise.png", "cut.jpg"}
    assert all(reason for _, reason in result.skipped)
    assert "noise.png" in caplog.text and "cut.jpg" in caplog.text
    assert "truncated" in dict((p.name, r) for p, r in result.skipped)["cut.jpg"]


def test_unsupported_format_is_reported_and_hidden_files_ignored(tmp_path: Path) -> None:
    make_image(tmp_path / "good.png")
    Image.new("RGB", (8, 8)).save(tmp_path / "old.bmp")
    (tmp_path / "._good.png").write_bytes(b"AppleDouble junk")

    result = scan_datasets([DatasetSource(tmp_path)])

    assert [p.name for p, _ in result.skipped] == ["old.bmp"]
    assert result.hidden_ignored == 1
    assert result.num_images == 1


def test_subfolders_only_when_recursive(tmp_path: Path) -> None:
    make_image(tmp_path / "top.png")
    make_image(tmp_path / "sub" / "deep.png", caption="deep caption")

    flat = scan_datasets([DatasetSource(tmp_path)])
    deep = scan_datasets([DatasetSource(tmp_path)], recursive=True)

    assert [i.path.name for i in flat.items] == ["top.png"]
    assert [(i.path.name, i.caption) for i in deep.items] == [
        ("deep.png", "deep caption"), ("top.png", "")]


def test_several_sources_keep_their_index_and_repeats(tmp_path: Path) -> None:
    make_image(tmp_path / "one" / "a.png")
    make_image(tmp_path / "two" / "b.png")
    make_image(tmp_path / "two" / "c.png")

    result = scan_datasets([DatasetSource(tmp_path / "one", repeats=3),
                            DatasetSource(tmp_path / "two", repeats=2)])

    assert [i.source_index for i in result.items] == [0, 1, 1]
    assert result.images_per_source == [1, 2]
    assert result.num_samples_per_epoch == 3 * 1 + 2 * 2


def test_missing_folder_and_file_path_raise_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    a_file = make_image(tmp_path / "x.png")

    with pytest.raises(DatasetError, match="does not exist.*nope"):
        scan_datasets([DatasetSource(missing)])
    with pytest.raises(DatasetError, match="not a folder.*x.png"):
        scan_datasets([DatasetSource(a_file)])
    with pytest.raises(DatasetError, match="repeats"):
        scan_datasets([DatasetSource(tmp_path, repeats=0)])


def test_no_usable_images_names_folders_and_skip_reasons(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "bad.png").write_bytes(b"not an image at all")
    make_truncated_jpeg(second / "cut.jpg")

    with pytest.raises(DatasetError) as error:
        scan_datasets([DatasetSource(first), DatasetSource(second)])

    message = str(error.value)
    assert str(first) in message and str(second) in message
    assert "2 file(s) skipped" in message
    assert "bad.png" in message and "cut.jpg" in message


def test_empty_folder_error_says_no_images_found(tmp_path: Path) -> None:
    (tmp_path / "readme.txt").write_text("no images here")

    with pytest.raises(DatasetError, match="no usable images.*no .*png.* files found"):
        scan_datasets([DatasetSource(tmp_path)])


def kohya_layout(root: Path) -> Path:
    """The layout users bring from kohya / OneTrainer: nothing at the top, N_name subfolders."""
    make_image(root / "10_cat" / "a.png", caption="a cat")
    make_image(root / "10_cat" / "b.png", caption="another cat")
    make_image(root / "3_dog" / "nested" / "c.png", caption="a dog")
    make_image(root / "extra" / "d.png", caption="no prefix, one repeat")
    return root


def test_the_kohya_layout_trains_every_subfolder_with_its_repeat_prefix(tmp_path):
    from modules.data.dataset import expand_repeats
    result = scan_datasets([DatasetSource(kohya_layout(tmp_path / "data"), repeats=2)],
                           recursive=True)
    assert result.num_images == 4
    assert {item.path.name: item.repeats for item in result.items} == {"a.png": 10, "b.png": 10,
                                                                       "c.png": 3, "d.png": 1}
    assert result.num_samples_per_epoch == 2 * (10 + 10 + 3 + 1)
    assert len(expand_repeats(result)) == result.num_samples_per_epoch
    assert "repeat folders: 10_cat (2 images x10), 3_dog (1 images x3)" in result.summary()


def test_subfolders_without_recursion_are_refused_by_name(tmp_path):
    with pytest.raises(DatasetError) as err:
        scan_datasets([DatasetSource(kohya_layout(tmp_path / "data"))], recursive=False)
    message = str(err.value)
    assert "10_cat: 2" in message and "3_dog: 1" in message and "data.recursive" in message


def test_quiet_oddities_are_warned_about(tmp_path):
    root = tmp_path / "data"
    make_image(root / "fine.png", size=(256, 256), caption="fine")
    make_image(root / "empty.png", size=(256, 256), caption="")
    make_image(root / "tiny.png", size=(1, 1), caption="a dot")
    os.symlink(root / "gone.png", root / "link.png")
    result = scan_datasets([DatasetSource(root)], resolution=512)
    text = "\n".join(result.warnings)
    assert "1 caption file(s) are empty" in text and "empty.txt" in text
    assert "under 128 px, far below the training resolution 512" in text and "tiny.png" in text
    assert "symbolic link(s) point to nothing" in text and "link.png" in text
    assert result.num_images == 3


def test_a_bmp_is_an_unsupported_format_not_unreadable(tmp_path, tiny_config):
    from modules.events import RecordingCallbacks
    from modules.train.setup.prepare import check_run
    root = tmp_path / "data"
    make_image(root / "ok.png", size=(64, 64), caption="ok")
    Image.new("RGB", (64, 64)).save(root / "old.bmp")
    callbacks = RecordingCallbacks()
    check_run(tiny_config(f"data.datasets[0].path={root}"), callbacks)
    assert any("skipped 1 image file(s) (unsupported format)" in s for s in callbacks.statuses)
