"""Imports inside modules/ only point down the layers docs/architecture.md draws.

Every import counts, a lazy one inside a function included: a lazy upward import is still a
dependency on the layer above, it only fails later.
"""
from __future__ import annotations

import ast
from pathlib import Path

MODULES = Path(__file__).resolve().parent.parent / "modules"

# From the top down; a package may import its own modules and anything in a lower layer.
LAYERS = (
    {"cli"},
    {"cloud", "bench"},
    {"train"},
    {"compile", "models", "data", "runtime"},
    {"config"},
    {"model_types", "util", "events", "paths", "geometry"},
)


def _layer(package: str) -> int:
    for depth, names in enumerate(LAYERS):
        if package in names:
            return len(LAYERS) - depth
    raise AssertionError(f"modules/{package} is in no layer: add it to LAYERS and to "
                         "docs/architecture.md")


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        found |= {name.split(".")[1] for name in names
                  if name.startswith("modules.") and name.count(".") >= 1}
    return found


def test_every_import_in_modules_points_down():
    upward = []
    for path in sorted(MODULES.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == MODULES:
            continue
        package = path.relative_to(MODULES).parts[0].removesuffix(".py")
        for imported in _imported_packages(path):
            if imported != package and _layer(imported) >= _layer(package):
                upward.append(f"{path.relative_to(MODULES.parent)} imports modules.{imported}")
    assert upward == []


def test_the_checker_sees_a_lazy_upward_import(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("def f():\n    from modules.train.run import Run\n", encoding="utf-8")
    assert _imported_packages(source) == {"train"}
    assert _layer("train") > _layer("config")
