"""Made-up compile bundle files, laid out as modules/compile/bundle.py writes them: for the
tests of bundle handling here and of bundles carried by cloud runs (tests/cloud/)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

from modules.compile import bundle as bundles
from modules.compile.bundle import Fingerprint

PRINT = Fingerprint(torch="2.13.0", triton="", cuda="", device="cpu", capability="", threads="2",
                    family="SD15", components=("unet: INDUCTOR REGIONAL abc",),
                    dtype="FLOAT32 WEIGHT_DTYPE NO", shapes=("2x64x64",))


def fake_bundle(folder: Path, fingerprint: Fingerprint = PRINT, artifacts: bytes = b"code",
                name: str | None = None, cold_seconds: float | None = None) -> Path:
    """A bundle file as write_bundle lays it out, with made-up compiled code (``cold_seconds``:
    the cold compile time its header records)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or fingerprint.file_name())
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(bundles.HEADER, json.dumps({
            "format": bundles.BUNDLE_FORMAT, "fingerprint": dataclasses.asdict(fingerprint),
            "artifacts_bytes": len(artifacts),
            "artifacts_sha256": hashlib.sha256(artifacts).hexdigest(), "kernels": 1,
            "cold_compile_seconds": cold_seconds}))
        z.writestr(bundles.ARTIFACTS, artifacts)
        z.writestr(bundles.KERNELS + "ab/cabkernel.main.so", b"\x7fELF")
    return path
