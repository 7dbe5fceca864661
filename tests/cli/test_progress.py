"""The progress file of runs nobody watches live (cloud runs, the GPU validation's train jobs)."""
from __future__ import annotations

import io
import json

from modules.cli.progress import ProgressReporter, progress_line
from modules.events import CompileEvent, NullCallbacks, Progress


def test_a_compile_before_the_first_step_is_in_the_progress_file(tmp_path):
    # A run killed during its first compile (the GPU validation's limit) must still say so.
    reporter = ProgressReporter(NullCallbacks(), tmp_path / "progress.json", every=30,
                                stream=io.StringIO(), clock=lambda: 0.0)
    reporter.on_compile(CompileEvent("unet", "compiling graph 2", seconds=34.0))
    data = json.loads((tmp_path / "progress.json").read_text())
    assert data["step"] == 0 and data["compile"] == "unet progress: compiling graph 2"
    assert progress_line(data).startswith("step 0/?  loss ?")
    reporter.on_progress(Progress(1, 10, 1, 1, 0.5, 0.25, 1e-4, 0.5, 4.5))
    data = json.loads((tmp_path / "progress.json").read_text())
    assert data["step"] == 1 and data["compile"] == "unet progress: compiling graph 2"
