"""The layers docs/architecture.md draws, checked import by import (lazy imports inside
functions too: a lazy import across a layer is still a dependency, it only fails later).

Inside `modules/`, imports only point down (LAYERS). The GUI's boundary with the engine
(docs/architecture.md, "The GUI"):

`app/` imports from `modules/` only `modules.frontend` (everything it asks the engine),
`modules.config` (the config types) and `modules.events` (the trainer protocol); the Benchmark
section and the Cloud tab also import the front ends they show, `modules.bench` and
`modules.cloud`. The GUI imports the facade before torch, so the facade must not import torch.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.child_env import REPO, with_repo_on_pythonpath

ALLOWED = ("modules.frontend", "modules.config", "modules.events")
ALLOWED_IN = {"modules.bench": "benchmark_panel.py", "modules.cloud": "cloud_panel.py"}


def engine_imports(path: Path) -> list[tuple[int, str]]:
    """Every module of `modules/` that a file imports, at any depth (lazy imports in
    functions too), as (line, dotted name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = ([f"modules.{alias.name}" for alias in node.names]
                     if node.module == "modules" else [node.module])
        else:
            continue
        found += [(node.lineno, name) for name in names
                  if name == "modules" or name.startswith("modules.")]
    return found


def allowed(name: str, file: Path) -> bool:
    def under(package: str) -> bool:
        return name == package or name.startswith(package + ".")
    return (any(under(package) for package in ALLOWED)
            or any(under(package) and file.name == owner for package, owner in ALLOWED_IN.items()))


def test_app_imports_the_engine_only_through_the_frontend_module():
    files = sorted((REPO / "app").glob("*.py"))
    seen = {name for file in files for _, name in engine_imports(file)}
    assert "modules.frontend" in seen and "modules.bench" in seen  # a lazy import is found too
    wrong = [f"{file.relative_to(REPO)}:{line}: {name}" for file in files
             for line, name in engine_imports(file) if not allowed(name, file)]
    assert wrong == [], "app/ imports the engine past modules.frontend:\n" + "\n".join(wrong)


def test_the_rule_refuses_a_deep_import(tmp_path):
    bad = tmp_path / "window.py"
    bad.write_text("def f():\n    from modules.train.setup.inputs import check_inputs\n"
                   "from modules import frontend, paths\n")
    names = sorted(name for _, name in engine_imports(bad))
    assert names == ["modules.frontend", "modules.paths", "modules.train.setup.inputs"]
    assert [name for name in names if not allowed(name, bad)] == ["modules.paths",
                                                                   "modules.train.setup.inputs"]
    assert not allowed("modules.cloud.repo", bad)  # only the Cloud tab's file may
    assert allowed("modules.cloud.repo", tmp_path / "cloud_panel.py")


def test_the_frontend_module_imports_without_torch():
    code = ("import sys, modules.frontend as f; assert 'torch' not in sys.modules, 'torch'; "
            "f.check; f.resume_offer; f.list_backups; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=with_repo_on_pythonpath(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# --- inside modules/: imports only point down ----------------------------------------------
MODULES = Path(__file__).resolve().parent.parent / "modules"

# From the top down; a package may import its own modules and anything in a lower layer.
LAYERS = (
    {"cli"},
    {"cloud", "bench"},
    {"frontend"},
    {"train", "lora_tools"},
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


def test_the_layer_checker_sees_a_lazy_upward_import(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("def f():\n    from modules.train.state.run import Run\n", encoding="utf-8")
    assert _imported_packages(source) == {"train"}
    assert _layer("train") > _layer("config")


# --- no circles between the files of modules/ ------------------------------------------------
def module_graph(root: Path) -> dict[str, set[str]]:
    """Each module under ``root`` (its dotted name, ``root`` being the ``modules`` folder) and
    the modules of ``root`` it imports, at any depth: lazy imports inside functions and types
    under ``TYPE_CHECKING`` too (a circle through either still ties the two files together).
    Importing ``a.b.c`` counts as depending on ``a.b.c``, not on the package ``a.b`` around it."""
    top = root.name
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"):
             p for p in root.rglob("*.py")}

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found |= {owner(name) for name in names if name.split(".")[0] == top} - {None}
        graph[module] = found - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_files_of_modules_import_each_other_in_a_circle():
    assert circles(module_graph(MODULES)) == [], (
        "import circles in modules/ (move what both files need into a lower file; "
        "docs/architecture.md, 'The trainer's rooms')")


def test_the_circle_checker_finds_a_lazy_circle_inside_a_folder(tmp_path):
    room = tmp_path / "modules" / "train" / "room"
    room.mkdir(parents=True)
    for folder in (tmp_path / "modules", tmp_path / "modules" / "train", room):
        (folder / "__init__.py").write_text("")
    (room / "a.py").write_text("from modules.train.room.b import f\n")
    (room / "b.py").write_text("def f():\n    from modules.train.room import c\n")
    (room / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from modules.train.room.a import X\n")
    (room / "d.py").write_text("import modules.train.room.a\n")  # outside the circle
    graph = module_graph(tmp_path / "modules")
    assert graph["modules.train.room.b"] == {"modules.train.room.c"}
    assert circles(graph) == [["modules.train.room.a", "modules.train.room.b",
                               "modules.train.room.c"]]
