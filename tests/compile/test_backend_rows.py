"""One row per backend carries every fact about it: the readers ask the row, not a list of names."""
from __future__ import annotations

import subprocess
import sys

import pytest

from modules.compile.backends import BACKENDS, INDUCTOR, TORCH_DEFAULT_OPTIONS, BackendRow
from modules.compile.capabilities import Capabilities, backend_problem
from modules.compile.plan import spatial_dynamic_limit
from modules.config.schema import CompileBackend, CompileScope

CPU = Capabilities("cpu", False, None, False, "no triton", "/usr/bin/g++")


@pytest.mark.parametrize("backend", list(CompileBackend))
def test_every_backend_has_a_row_with_its_label_and_description(backend):
    row = BACKENDS[backend]
    assert row.label and row.description
    assert row.compiles == (backend != CompileBackend.NONE)


def test_the_window_shows_the_rows_labels():
    from app.labels import enum_label

    assert [enum_label(b) for b in CompileBackend] == [BACKENDS[b].label for b in CompileBackend]


def test_the_rows_are_read_without_importing_torch():
    # The window shows labels and descriptions before torch is imported (docs/gui.md).
    code = ("import sys, modules.compile.backends, app.labels, app.compile_info; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


def test_a_backend_is_known_by_its_rows_family_not_by_its_name():
    # What the family decides (the capability check, known compiler limits, the cache) follows
    # the row: a new inductor row gets all of it without being named in another table.
    assert {b for b, row in BACKENDS.items() if row.family == INDUCTOR} == {
        CompileBackend.DEFAULT, CompileBackend.INDUCTOR, CompileBackend.TRITON}
    aot = BackendRow("aot_eager", inductor=False)
    inductor = BackendRow("inductor", inductor=True)
    assert spatial_dynamic_limit(inductor, CompileScope.FULL, "unet")
    assert spatial_dynamic_limit(aot, CompileScope.FULL, "unet") is None
    assert backend_problem(CompileBackend.TRITON, CPU) == (
        "TRITON needs a CUDA GPU (CUDA graphs do not exist on the CPU)")
    assert backend_problem(CompileBackend.INDUCTOR, CPU) is None
    assert backend_problem(CompileBackend.AOT_EAGER, Capabilities("cpu", False, None, False,
                                                                 "no triton", None)) is None


@pytest.mark.parametrize("option", sorted(TORCH_DEFAULT_OPTIONS))
def test_options_the_text_calls_torch_defaults_are_torch_defaults(option):
    # docs/compilation.md, the GUI's descriptions and backends.py say these are torch's own
    # defaults, not a difference between backends: true for the installed torch, or this fails.
    from torch._inductor import config as inductor_config

    rows = [row for row in BACKENDS.values() if option in row.options]
    assert rows, f"no row writes {option} out any more: drop it from TORCH_DEFAULT_OPTIONS"
    assert all(row.options[option] == inductor_config.get_config_copy()[option] for row in rows)


def test_no_description_sells_a_torch_default_as_a_difference():
    for row in BACKENDS.values():
        text = row.description.lower()
        for option in TORCH_DEFAULT_OPTIONS:
            words = option.replace("_", " ")
            assert words not in text or "default" in text, (row.label, text)


def test_the_fallback_chain_is_read_from_the_rows():
    import dataclasses

    import pytest

    from modules.compile.backends import BACKENDS, FALLBACK_CHAIN, fallback_chain
    from modules.config.schema import CompileBackend
    assert FALLBACK_CHAIN[0] == CompileBackend.TRITON and FALLBACK_CHAIN[-1] == CompileBackend.NONE
    assert set(FALLBACK_CHAIN) == set(BACKENDS)  # every row is on the chain
    assert fallback_chain(CompileBackend.DEFAULT) == (CompileBackend.DEFAULT,
                                                      CompileBackend.AOT_EAGER,
                                                      CompileBackend.NONE)
    # a row that falls back elsewhere changes the chain; a loop is refused
    rows = dict(BACKENDS)
    rows[CompileBackend.INDUCTOR] = dataclasses.replace(rows[CompileBackend.INDUCTOR],
                                                        falls_back_to=CompileBackend.AOT_EAGER)
    assert CompileBackend.DEFAULT not in fallback_chain(CompileBackend.TRITON, rows)
    rows[CompileBackend.AOT_EAGER] = dataclasses.replace(rows[CompileBackend.AOT_EAGER],
                                                         falls_back_to=CompileBackend.INDUCTOR)
    with pytest.raises(ValueError, match="loops"):
        fallback_chain(CompileBackend.TRITON, rows)
