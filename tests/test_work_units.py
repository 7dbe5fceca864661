"""The suite's work units (tests/work_units.py): one per test file, the long ones handed out
first, and each unit's wall time and worker reported with the critical path."""
from __future__ import annotations

import json
from collections import OrderedDict

from tests.work_units import UnitClock, slow_first, work_unit


def test_a_unit_is_a_file_and_window_files_are_units_of_their_own():
    assert work_unit("tests/train/test_fsdp.py::test_a[x::y]") == "tests/train/test_fsdp.py"
    assert work_unit("tests/app/test_form.py::test_b") == "tests/app/test_form.py"
    assert work_unit("tests/app/test_training.py::test_c") == "tests/app/test_training.py"


def test_the_known_long_units_go_first_in_the_order_given_and_the_rest_keep_theirs():
    queue = OrderedDict((name, {}) for name in ("a.py", "b.py", "slow2.py", "c.py", "slow1.py"))
    slow_first(queue, ["slow1.py", "gone.py", "slow2.py"])
    assert list(queue) == ["slow1.py", "slow2.py", "a.py", "b.py", "c.py"]


def test_the_clock_sorts_units_by_wall_time_and_names_the_worker_that_ended_last(tmp_path):
    clock = UnitClock()
    # gw0: one unit of two tests, 100 s to 130 s; gw1: two units, 100-110 s and 110-150 s
    clock.add("tests/a.py::t1", "gw0", 100.0, 120.0, 20.0)
    clock.add("tests/a.py::t2", "gw0", 120.0, 130.0, 10.0)
    clock.add("tests/b.py::t", "gw1", 100.0, 110.0, 10.0)
    clock.add("tests/c.py::t", "gw1", 110.0, 150.0, 40.0)
    clock.add("tests/c.py::t", "gw1", 150.0, 150.5, 0.5)     # its teardown report
    table = clock.table()
    assert [(u["unit"], u["worker"], u["seconds"], u["tests"]) for u in table["units"]] == [
        ("tests/c.py", "gw1", 40.5, 1), ("tests/a.py", "gw0", 30.0, 2),
        ("tests/b.py", "gw1", 10.0, 1)]
    assert table["units"][0]["started_at_s"] == 10.0 and table["units"][0]["busy_s"] == 40.5
    assert table["workers"] == {"gw0": {"busy_s": 30.0, "ended_at_s": 30.0, "units": 1},
                                "gw1": {"busy_s": 50.5, "ended_at_s": 50.5, "units": 2}}
    assert table["critical_path"] == {"worker": "gw1", "seconds": 50.5,
                                      "units": ["tests/b.py", "tests/c.py"]}
    clock.write(tmp_path / "times.json")
    assert json.loads((tmp_path / "times.json").read_text()) == table
    lines = clock.lines(top=2)
    assert "tests/c.py (1)" in lines[1] and "tests/a.py (2)" in lines[2]
    assert not any("tests/b.py" in line for line in lines)
    assert lines[-1] == "critical path: gw1, 50 s"


def test_an_empty_clock_has_no_critical_path():
    assert UnitClock().table() == {"units": [], "workers": {}, "critical_path": None}
