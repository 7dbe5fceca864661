"""The dataset-size benchmark's parts: images of mixed sizes, a measurement row, the docs block
(the numbers themselves are measured by scripts/benchmark_data.py, never asserted)."""
from __future__ import annotations

from PIL import Image

from modules.bench.data_scale import BEGIN, END, make_images, markdown, measure, write_docs


def test_generated_images_mix_sizes_and_aspect_ratios_and_scan(tmp_path, tempera_cache):
    make_images(tmp_path / "images", 24)
    sizes = {Image.open(p).size for p in (tmp_path / "images").glob("*.jpg")}
    assert len(sizes) > 5 and any(w > h for w, h in sizes) and any(h > w for w, h in sizes)
    row = measure(tmp_path / "images", tempera_cache, with_cache=False)
    assert row["images"] == 24 and row["scan_images_per_s"] > 0 and "cache_seconds" not in row


def test_the_block_replaces_only_its_markers(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# before\n{BEGIN}\nold\n{END}\nafter\n", encoding="utf-8")
    result = {"machine": "test box", "date": "2026-11-25", "resolution": 256,
              "rows": [{"images": 1000, "scan_seconds": 2.0, "scan_images_per_s": 500.0,
                        "scan_peak_rss_mib": 230, "bucket_seconds": 0.01, "peak_rss_mib": 240}],
              "resume": {"images": 200, "killed_after_seconds": 40, "killed": True,
                         "reused_after_kill": 120, "encoded_after_kill": 80}}
    write_docs(result, docs)
    text = docs.read_text(encoding="utf-8")
    assert text.startswith("# before\n") and text.endswith(f"{END}\nafter\n")
    assert "| 1,000 | 2.0 s (500.0) | 230 MiB | 0.01 s | not measured | 240 MiB |" in text
    assert "reused 120 cached latents and encoded 80" in text and "old" not in text
    assert markdown(result) in text
