"""What the preparation jobs' tests share."""
from __future__ import annotations

import os
import subprocess

import pytest
from PIL import Image


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder holding one image that nobody may write to: chmod for a normal user; for root
    (whom permissions do not stop) a tmpfs remounted read-only (skipped without mount rights)."""
    folder = tmp_path / "images"
    folder.mkdir()
    image = Image.new("RGB", (16, 16), (255, 0, 0))
    if os.geteuid() != 0:
        image.save(folder / "a.png")
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)],
                      capture_output=True).returncode != 0:
        pytest.skip("a read-only folder for root needs mount rights")
    try:
        image.save(folder / "a.png")
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
