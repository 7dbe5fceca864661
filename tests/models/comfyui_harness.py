"""ComfyUI's own loading code, run without its window: a checkout of ComfyUI (fetched, never
committed here: GPL-3) named with `pytest --comfyui=PATH`; without it the tests that need it
are skipped, saying so.

ComfyUI's `comfy.model_base` imports every architecture it knows, and one of them (Cosmos)
imports torchvision's transforms at import time; Tempera's environment has no torchvision (a
second torch build). `import_comfyui` gives that one import a stand-in module so the import
finishes; nothing Z-Image runs touches it. It also passes ComfyUI's `--cpu`, as a CPU-only
torch needs, through its own argument switch (comfy.options), not through sys.argv at large.
"""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests.models.stand_ins import torchvision_stand_in

def import_comfyui(checkout: Path) -> types.SimpleNamespace:
    """comfy.lora, comfy.utils, comfy.model_base, comfy.model_detection and the checkpoint
    loading modules (comfy.sd, comfy.model_patcher, comfy.sd1_clip, comfy.supported_models)
    from `checkout`."""
    if not (checkout / "comfy" / "lora.py").is_file():
        pytest.skip(f"{checkout}: not a ComfyUI checkout")
    for package in ("einops", "psutil"):
        pytest.importorskip(package, reason=f"ComfyUI needs {package} (pip install {package})")
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    argv, sys.argv = sys.argv, ["comfyui", "--cpu"]
    try:
        with torchvision_stand_in():  # ComfyUI's modules keep theirs; nothing else sees one
            import comfy.options
            comfy.options.enable_args_parsing()
            import comfy.lora
            import comfy.model_base
            import comfy.model_detection
            import comfy.model_patcher
            import comfy.sd
            import comfy.sd1_clip
            import comfy.supported_models
            import comfy.utils
    finally:
        sys.argv = argv
    return types.SimpleNamespace(lora=comfy.lora, utils=comfy.utils, model_base=comfy.model_base,
                                 model_detection=comfy.model_detection, sd=comfy.sd,
                                 model_patcher=comfy.model_patcher, sd1_clip=comfy.sd1_clip,
                                 supported_models=comfy.supported_models)
