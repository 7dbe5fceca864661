"""An empty torchvision for the import of third-party loaders the harnesses run (ComfyUI's
`comfy.model_base`, open_clip): they import its transforms at import time, Tempera's
environment has no torchvision (a second torch build), and nothing the harnesses run uses it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager


class _EmptyMeta(type):
    def __getattr__(cls, attr: str) -> type:
        return _empty_class(attr)


def _empty_class(attr: str) -> type:
    if attr.startswith("__"):  # what inspection asks a module (__file__, __spec__ ...)
        raise AttributeError(attr)
    return _EmptyMeta(attr, (), {})


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for torchvision: every attribute, and every attribute of those, is an
    empty class."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _empty_class
        return module

    def exec_module(self, module):
        pass


@contextmanager
def torchvision_stand_in() -> Iterator[None]:
    """An empty torchvision for the imports inside the block only: the modules imported there
    keep theirs, nothing imported later sees one."""
    # transformers decides once, at its import, whether torchvision is installed: let it see
    # the truth before the stand-in exists
    import transformers.utils.import_utils  # noqa: F401
    stand_in = _StandIn()
    sys.meta_path.append(stand_in)
    try:
        yield
    finally:
        sys.meta_path.remove(stand_in)
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
