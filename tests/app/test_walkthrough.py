"""The scripted first-use walkthrough (scripts/walkthrough_ui.py) with real pointer and keyboard
input, on the smallest screen it knows, after a launch of tempera-ui watched from outside
(app/first_paint.py): every check it makes must pass."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.app.conftest import REPO


def test_the_walkthrough_passes_on_a_1024x700_screen(display, tmp_path):
    if not (shutil.which("xdotool") and shutil.which("Xvfb")):
        pytest.skip("the walkthrough needs xdotool and Xvfb (bash scripts/ensure_xvfb.sh)")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "walkthrough_ui.py"),
                           "--screens", "1024x700@100", "--out", str(tmp_path),
                           # its Continue journey trains; tests/app/test_resume_offer.py
                           # clicks through the same journey (an engine test)
                           "--journey", "none"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    report = done.stdout
    assert done.returncode == 0, report + done.stderr[-3000:]
    assert "FAIL" not in report and report.count("ok  ") >= 15, report
    pictures = sorted(p.name for p in (tmp_path / "1024x700-100").glob("*.png"))
    assert {"startup-loading.png", "tab-general.png", "tab-advanced-options.png",
            "problems.png", "inline-error.png"} <= set(pictures)
    assert "ok   while torch loads, a typed value reaches the settings" in report
    # launched as a user launches it: the curtain, then the complete form, never half built
    assert "ok   first the starting curtain with its line, then the complete form" in report
    launch = sorted(p.name for p in (tmp_path / "launch").glob("*.png"))
    assert any(name.endswith("-curtain.png") for name in launch), launch
    assert launch[-1].endswith("-form.png"), launch
