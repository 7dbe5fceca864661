"""Compile bundles' file handling: found by fingerprint, refused with the part that differs,
damaged or unreadable ones named and skipped, written whole by concurrent writers. The real
torch round trip (a bundle from one process warming another cache folder) is
tests/train/test_compile_ahead.py's."""
from __future__ import annotations

import dataclasses
import json
import threading
import zipfile

import pytest

from modules.compile import bundle as bundles
from modules.compile.bundle import (BundleError, BundleKeeper, find_bundle,
                                    load_bundle, read_header)
from tests.compile.bundle_files import PRINT, fake_bundle

def test_the_bundle_made_for_the_settings_is_found_among_others(tmp_path):
    other = dataclasses.replace(PRINT, family="SDXL")
    fake_bundle(tmp_path, other)
    mine = fake_bundle(tmp_path)
    lookup = find_bundle(PRINT, [tmp_path])
    assert (lookup.status, lookup.path) == ("hit", mine)
    assert PRINT.file_name() != other.file_name() and PRINT.file_name().endswith(".tcb")


@pytest.mark.parametrize("change, part", [
    ({"torch": "2.12.0"}, "torch: this run 2.13.0, bundle 2.12.0"),
    ({"device": "NVIDIA H200", "capability": "9.0"}, "device: this run cpu, bundle NVIDIA H200"),
    ({"shapes": ("1x64x64",)}, "shapes: this run 2x64x64, bundle 1x64x64"),
    ({"threads": "1"}, "threads: this run 2, bundle 1"),
    ({"components": ("unet: INDUCTOR FULL abc",)}, "components: this run unet: INDUCTOR "
                                                    "REGIONAL abc, bundle unet: INDUCTOR FULL"),
])
def test_a_bundle_for_other_settings_is_not_used_and_says_what_differed(tmp_path, change, part):
    path = fake_bundle(tmp_path, dataclasses.replace(PRINT, **change))
    lookup = find_bundle(PRINT, [tmp_path])
    assert (lookup.status, lookup.path) == ("mismatch", path)
    assert part in lookup.why and lookup.describe().startswith("mismatch (")


def test_the_closest_bundle_is_the_one_named_when_none_matches(tmp_path):
    fake_bundle(tmp_path, dataclasses.replace(PRINT, torch="2.12.0", family="SDXL"))
    near = fake_bundle(tmp_path, dataclasses.replace(PRINT, torch="2.12.0"))
    lookup = find_bundle(PRINT, [tmp_path])
    assert lookup.path == near and "family" not in lookup.why


def test_nothing_there_is_a_miss(tmp_path):
    assert find_bundle(PRINT, [tmp_path / "missing", tmp_path]).status == "miss"


def test_a_truncated_bundle_is_named_and_skipped_and_a_whole_one_still_found(tmp_path):
    good = fake_bundle(tmp_path / "good")
    data = good.read_bytes()
    cut = tmp_path / "cut" / PRINT.file_name()
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) // 2])
    alone = find_bundle(PRINT, [cut])
    assert alone.status == "damaged" and str(cut) in alone.why and "truncated" in alone.why
    both = find_bundle(PRINT, [cut, good.parent])
    assert (both.status, both.path) == ("hit", good)
    assert len(both.skipped) == 1 and str(cut) in both.skipped[0]


def test_a_bundle_path_that_is_a_folder_named_like_a_bundle_or_a_broken_link(tmp_path):
    folder = tmp_path / "x.tcb"
    folder.mkdir()
    assert find_bundle(PRINT, [folder]).status == "miss"  # a folder is searched, not read
    with pytest.raises(BundleError, match="is a folder"):
        read_header(folder)
    link = tmp_path / "gone.tcb"
    link.symlink_to(tmp_path / "nowhere.tcb")
    lookup = find_bundle(PRINT, [link])
    assert lookup.status == "damaged" and str(link) in lookup.why


def test_a_file_that_is_no_bundle_or_of_another_format_is_refused_by_name(tmp_path):
    junk = tmp_path / "junk.tcb"
    junk.write_text("not a zip")
    with pytest.raises(BundleError, match="junk.tcb is not a whole compile bundle"):
        read_header(junk)
    path = fake_bundle(tmp_path / "v9")
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(bundles.HEADER, json.dumps({"format": 9}))
    with pytest.raises(BundleError, match="format 9"):
        read_header(path)


def test_compiled_code_that_does_not_match_its_checksum_is_not_loaded(tmp_path):
    path = fake_bundle(tmp_path / "b")
    header = json.loads(zipfile.ZipFile(path).read(bundles.HEADER))
    header["artifacts_sha256"] = "0" * 64
    tampered = tmp_path / "t" / path.name
    fake_bundle(tampered.parent)
    with zipfile.ZipFile(tampered, "w") as z:
        z.writestr(bundles.HEADER, json.dumps(header))
        z.writestr(bundles.ARTIFACTS, b"code")
        z.writestr(bundles.KERNELS + "ab/cabkernel.main.so", b"\x7fELF")
    cache = tmp_path / "cache"
    with pytest.raises(BundleError, match="checksum"):
        load_bundle(read_header(tampered), cache)
    assert not cache.exists()  # checked before anything was written


def test_a_kernel_path_outside_the_cache_folder_is_refused(tmp_path):
    path = fake_bundle(tmp_path / "b")
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(bundles.KERNELS + "../../evil.so", b"x")
    with pytest.raises(BundleError, match="outside the cache folder"):
        load_bundle(read_header(path), tmp_path / "cache")
    assert not (tmp_path / "evil.so").exists()


def test_the_keeper_reports_a_damaged_hit_and_goes_on(tmp_path):
    """torch's reader refusing the compiled code (here: made-up bytes) is a damaged bundle,
    never an error that stops the run."""
    fake_bundle(tmp_path / "bundles")
    keeper = BundleKeeper(PRINT, [tmp_path / "bundles"], tmp_path / "bundles")
    lookup = keeper.load(tmp_path / "cache")
    assert lookup.status == "damaged" and "torch could not read" in lookup.why
    record = keeper.record()
    assert record["lookup"] == "damaged" and record["written"] is None


def test_concurrent_writers_leave_one_whole_bundle(tmp_path, monkeypatch):
    """Two processes finishing their first step together (or two runs of one config) each
    write to a temporary file and rename it: the reader finds one whole bundle, no .part."""
    import torch

    payload = b"z" * 200_000
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, None))
    folder = tmp_path / "bundles"
    threads = [threading.Thread(target=bundles.write_bundle, args=(folder, PRINT, tmp_path))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.name for p in folder.iterdir()] == [PRINT.file_name()]
    assert read_header(folder / PRINT.file_name()).header["artifacts_bytes"] == len(payload)


def test_a_failed_write_is_kept_for_the_report_and_written_again_only_after_new_compiles(
        tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"code", None))
    blocker = tmp_path / "file"
    blocker.write_text("a file where the bundles folder must go")
    keeper = BundleKeeper(PRINT, [], blocker / "bundles")
    assert keeper.write_if_new(2, tmp_path) is None and str(blocker) in keeper.write_error
    keeper.folder = tmp_path / "bundles"
    assert keeper.write_if_new(2, tmp_path) is None  # nothing new compiled since
    assert keeper.write_if_new(3, tmp_path) == tmp_path / "bundles" / PRINT.file_name()
    assert keeper.write_error is None
    quiet = BundleKeeper(PRINT, [], tmp_path / "other", write=False)  # not the main process
    assert quiet.write_if_new(5, tmp_path) is None and not (tmp_path / "other").exists()


def test_a_cold_regional_compile_with_a_repeated_graph_is_still_cold():
    """A bundle carries its cold compile time for a later run's "saved" only if the run
    that wrote it knows it compiled cold. The tiny SD 1.5 UNet compiled REGIONAL from an empty
    cache reported 1 cache hit (a graph two blocks share) and 19 misses: cold. A run warm from
    a cache or a bundle that meets one new shape is not."""
    from modules.compile.bundle import compiled_cold
    assert compiled_cold(hits=1, misses=19)
    assert compiled_cold(hits=0, misses=4)
    assert not compiled_cold(hits=19, misses=0)
    assert not compiled_cold(hits=20, misses=5)
    assert not compiled_cold(hits=0, misses=0)  # nothing compiled
