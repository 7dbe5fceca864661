"""The benchmark on a CUDA GPU (marker ``gpu``; skipped without one): CUDA-event timing, both
allocator peaks, bf16 by default. Tiny model, eager and aot_eager only: well under a minute."""
from __future__ import annotations

import json

import pytest
import torch

from modules.bench.cli import main as bench_main

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_cells_are_timed_with_events_and_report_both_peaks(tmp_path, tempera_cache):
    out = tmp_path / "bench"
    assert bench_main(["--model", "tiny", "--device", "cuda", "--batch", "2",
                       "--backends", "NONE,AOT_EAGER", "--scopes", "FULL", "--dynamic", "STATIC",
                       "--steps", "3", "--no-warm-start", "--cache-dir", str(tempera_cache),
                       "--out", str(out)]) == 0
    data = json.loads((out / "benchmark.json").read_text())
    assert data["settings"]["mixed_precision"] == "BF16"
    for cell in data["cells"]:
        assert cell["status"] == "ok", cell
        assert cell["timing"] == "cuda_events" and cell["device"].startswith("cuda")
        assert 0 < cell["peak_allocated_bytes"] <= cell["peak_reserved_bytes"]
        assert len(cell["timed_steps"]) >= 3 and 1 not in cell["timed_steps"]
    table = (out / "benchmark.md").read_text()
    assert "| peak allocated MiB | peak reserved MiB |" in table and "CUDA events" in table
