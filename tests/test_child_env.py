"""A child process started by a test keeps every PYTHONPATH entry (tests/child_env.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.child_env import REPO, with_repo_on_pythonpath


def test_the_repository_goes_first_and_every_existing_entry_stays():
    env = with_repo_on_pythonpath({"PYTHONPATH": os.pathsep.join(["/img/.site", "/other"]),
                                   "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/img/.site", "/other"]
    assert env["HOME"] == "/h"
    assert with_repo_on_pythonpath({})["PYTHONPATH"] == str(REPO)
    assert with_repo_on_pythonpath({"PYTHONPATH": ""})["PYTHONPATH"] == str(REPO)


def test_a_child_imports_this_checkout_and_a_package_known_only_to_pythonpath(tmp_path,
                                                                              monkeypatch):
    # Stands in for the GPU image's .site/ folder, where diffusers is found only via PYTHONPATH.
    site = tmp_path / ".site"
    site.mkdir()
    (site / "only_on_pythonpath.py").write_text("WHERE = 'site'\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    code = ("import modules, only_on_pythonpath; "
            "print(modules.__file__); print(only_on_pythonpath.WHERE)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True,
                         capture_output=True, text=True, env=with_repo_on_pythonpath()).stdout
    where, found = out.split()
    assert Path(where).resolve().is_relative_to(REPO) and found == "site"


# `{..., "PYTHONPATH": ...}` or `env["PYTHONPATH"] = ...`: a replaced PYTHONPATH
REPLACED = re.compile(r"""["']PYTHONPATH["']\s*(:|\]\s*=[^=])""")
# the helper itself (modules/util/process.py), and this file's own examples of what it is given
ALLOWED = {REPO / "modules" / "util" / "process.py", Path(__file__).resolve()}


def test_no_test_or_module_replaces_pythonpath_for_a_child():
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for top in ("tests", "modules", "scripts", "app")
             for path in sorted((REPO / top).rglob("*.py"))
             if path.resolve() not in ALLOWED
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if REPLACED.search(line)]
    assert found == [], "use tests/child_env.with_repo_on_pythonpath:\n" + "\n".join(found)


def test_a_stray_tests_package_on_the_path_does_not_shadow_this_one(tmp_path):
    # An image may carry a site-packages/tests/ of some library: as regular packages, this
    # checkout's tests/ and tests/gpu/ come first (a namespace package would lose to it).
    stray = tmp_path / "site-packages"
    for package in ("tests", "tests/gpu"):
        (stray / package).mkdir(parents=True)
        (stray / package / "__init__.py").write_text("STRAY = True\n")
    env = with_repo_on_pythonpath({**os.environ, "PYTHONPATH": str(stray)})
    code = "import tests.gpu.scenarios, tests.child_env; print(tests.gpu.scenarios.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == REPO / "tests" / "gpu" / "scenarios.py"
