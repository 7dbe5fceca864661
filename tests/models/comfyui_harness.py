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

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

STAND_INS = ("torchvision",)


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for `STAND_INS` (any attribute is an empty class)."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {})
        return module

    def exec_module(self, module):
        pass


def import_comfyui(checkout: Path) -> types.SimpleNamespace:
    """comfy.lora, comfy.utils, comfy.model_base and comfy.model_detection from `checkout`."""
    if not (checkout / "comfy" / "lora.py").is_file():
        pytest.skip(f"{checkout}: not a ComfyUI checkout")
    for package in ("einops", "psutil"):
        pytest.importorskip(package, reason=f"ComfyUI needs {package} (pip install {package})")
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    if not any(isinstance(finder, _StandIn) for finder in sys.meta_path):
        sys.meta_path.append(_StandIn())
    import comfy.options
    comfy.options.enable_args_parsing()
    argv, sys.argv = sys.argv, ["comfyui", "--cpu"]
    try:
        import comfy.lora
        import comfy.model_base
        import comfy.model_detection
        import comfy.utils
    finally:
        sys.argv = argv
    return types.SimpleNamespace(lora=comfy.lora, utils=comfy.utils, model_base=comfy.model_base,
                                 model_detection=comfy.model_detection)
