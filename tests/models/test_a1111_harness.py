"""The A1111 harness's own plumbing (tests/models/a1111_harness.py), without any A1111 code: what
`assemble` copies and what it refuses, and the skip that names a folder's missing embedding
loader. (The tests that run A1111's code need `pytest --a1111=PATH`.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.a1111_harness import (CONFIGS, LORA_DIR, LORA_FILES, TI_FILE, assemble,
                                        import_a1111_textual_inversion, missing_files)


def _checkouts(root: Path) -> tuple[Path, Path, Path]:
    """Three folders with the layout of the webui, stablediffusion and generative-models
    checkouts, each file holding its own path (placeholders, not their code)."""
    webui, sd, sgm = root / "webui", root / "sd", root / "sgm"
    files = [webui / LORA_DIR / f for f in LORA_FILES] + [
        webui / TI_FILE, webui / CONFIGS["sd15"],
        sd / "ldm" / "modules" / "diffusionmodules" / "openaimodel.py",
        sd / "configs" / "stable-diffusion" / "v2-inference.yaml",
        sgm / "sgm" / "modules" / "diffusionmodules" / "openaimodel.py",
        sgm / "configs" / "inference" / "sd_xl_base.yaml"]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(path))
    return webui, sd, sgm


def test_assemble_copies_the_embedding_loader_with_the_lora_loader(tmp_path):
    webui, sd, sgm = _checkouts(tmp_path)
    out = assemble(webui, sd, sgm, tmp_path / "a1111")
    assert missing_files(out) == []
    assert (out / TI_FILE).read_text() == str(webui / TI_FILE)


def test_assemble_names_a_missing_embedding_loader_and_writes_nothing(tmp_path):
    webui, sd, sgm = _checkouts(tmp_path)
    (webui / TI_FILE).unlink()
    with pytest.raises(SystemExit, match="textual_inversion.py"):
        assemble(webui, sd, sgm, tmp_path / "a1111")
    assert not (tmp_path / "a1111").exists()


def test_a_folder_without_the_embedding_loader_skips_naming_the_file(tmp_path):
    with pytest.raises(pytest.skip.Exception, match="textual_inversion.py.*assemble"):
        import_a1111_textual_inversion(tmp_path)
