"""The status line of long passes: count, rate and ETA, throttled, and said at the end."""
from __future__ import annotations

from PIL import Image

from modules.data.folders import DatasetSource, scan_datasets
from modules.data.progress import RateMeter


def test_the_meter_says_rate_and_eta_at_most_every_few_seconds_and_always_at_the_end():
    now = [100.0]
    said: list[str] = []
    meter = RateMeter("caching latents", said.append, every=2.0, unit="latents",
                      clock=lambda: now[0])
    meter(0, 1000)
    now[0] += 1.0
    meter(100, 1000)  # within 2 s of the last line: quiet
    now[0] += 1.5
    meter(250, 1000)
    now[0] += 7.5
    meter(1000, 1000)  # the end is always said
    assert said == ["caching latents: 0/1,000 latents (0 %)",
                    "caching latents: 250/1,000 latents (25 %), 100/s, ETA 0:08",
                    "caching latents: 1,000/1,000 latents (100 %), 100/s"]


def test_a_scan_reports_each_folder_as_its_images_decode(tmp_path):
    folder = tmp_path / "pets"
    folder.mkdir()
    for i in range(5):
        Image.new("RGB", (32, 32), "red").save(folder / f"{i}.png")
    calls: list[tuple[str, int, int]] = []
    scan_datasets([DatasetSource(folder)],
                  progress=lambda path: lambda done, total: calls.append((path.name, done, total)))
    assert calls == [("pets", n, 5) for n in range(1, 6)]
