"""How `make test` spreads the suite over its xdist workers, and what each unit of work cost.

A work unit is a whole test file, so the tests of a file that share a module-scoped fixture (one
training run read by several tests) are not split and the fixture is built once. The window
tests (tests/app) are units of their own too, one file each: every worker that runs one starts
its own Xvfb (the session's `display` fixture picks a free display), so two window files may
run at once, each on its own core, as a window file always ran beside a training test. They
were one serial unit of 1,080 s before, the longest block of the suite.

xdist hands out the units largest first by test count; `SLOW_FIRST` puts the units known to be
long (a handful of minutes each) at the head of the queue, so none of them starts last and
keeps one worker busy after the other has finished. The numbers come from `UnitClock`'s table,
which `pytest --work-unit-times=PATH` writes and the end of every run of more than one unit
prints: when it shows a long unit starting late, add it here.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

# Units (test files) with tests or fixtures of over a minute each, started first, longest first
# (the slow parts' seconds measured serially on an idle 2-core machine, November 2026). A unit
# not collected in a run is ignored.
SLOW_FIRST = [
    "tests/train/test_typed_presets.py",     # 17 distinct preset runs, 2 steps each
    "tests/models/test_klein_compile.py",    # REGIONAL and FULL over 3 buckets, and inductor
    "tests/train/test_compile_ahead.py",     # its runs: cold DEFAULT compiles, ahead and
                                             # plain (the bundle tests read the plain one)
    "tests/bench/test_gpu_rehearsal.py",     # the phases 192 + the compiled cells 219 (before
                                             # they trained one shape)
    "tests/train/test_weight_storage.py",    # its runs, FLOAT8 and INT8: 2 x ~120
    "tests/train/test_fsdp.py",              # two FSDP setups, ~75 each
    "tests/models/test_zimage_compile.py",   # two compiled tests, 74 + 61
    "tests/compile/test_inductor.py",        # two inductor tests, 72 + 64
    "tests/app/test_resume_offer.py",        # one window journey, 131
    "tests/train/test_fused_backward.py",    # its runs, 77
]


def work_unit(nodeid: str) -> str:
    """The unit a test belongs to: its file."""
    return nodeid.split("::")[0]


def slow_first(queue: OrderedDict, slow: list[str] = SLOW_FIRST) -> None:
    """Move the units of ``slow`` that ``queue`` (xdist's queue of units) holds to its front,
    in the order ``slow`` gives."""
    for unit in reversed(slow):
        if unit in queue:
            queue.move_to_end(unit, last=False)


@dataclass
class Unit:
    name: str
    worker: str
    start: float          # the first report's start (epoch seconds)
    stop: float           # the last report's stop
    busy: float = 0.0     # the sum of its tests' setup, call and teardown
    tests: set[str] = field(default_factory=set)


class UnitClock:
    """Each work unit's wall time and worker, from the test reports (on xdist's controller they
    arrive from every worker; without xdist the worker is "main")."""

    def __init__(self) -> None:
        self.units: dict[str, Unit] = {}

    def add(self, nodeid: str, worker: str, start: float, stop: float, duration: float) -> None:
        name = work_unit(nodeid)
        unit = self.units.get(name)
        if unit is None:
            unit = self.units[name] = Unit(name, worker, start, stop)
        unit.start, unit.stop = min(unit.start, start), max(unit.stop, stop)
        unit.busy += duration
        unit.tests.add(nodeid)

    def table(self) -> dict:
        """The units by wall time, longest first, and each worker's span: the worker that ended
        last is the critical path, and its units are listed in the order it ran them."""
        if not self.units:
            return {"units": [], "workers": {}, "critical_path": None}
        begin = min(u.start for u in self.units.values())
        units = sorted(self.units.values(), key=lambda u: u.stop - u.start, reverse=True)
        workers: dict[str, dict] = {}
        for u in self.units.values():
            w = workers.setdefault(u.worker, {"busy_s": 0.0, "ended_at_s": 0.0, "units": 0})
            w["busy_s"] = round(w["busy_s"] + u.busy, 1)
            w["ended_at_s"] = round(max(w["ended_at_s"], u.stop - begin), 1)
            w["units"] += 1
        last = max(workers, key=lambda name: workers[name]["ended_at_s"])
        path = sorted((u for u in self.units.values() if u.worker == last), key=lambda u: u.start)
        return {
            "units": [{"unit": u.name, "worker": u.worker, "seconds": round(u.stop - u.start, 1),
                       "busy_s": round(u.busy, 1), "started_at_s": round(u.start - begin, 1),
                       "tests": len(u.tests)} for u in units],
            "workers": workers,
            "critical_path": {"worker": last, "seconds": workers[last]["ended_at_s"],
                              "units": [u.name for u in path]},
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.table(), indent=1) + "\n", encoding="utf-8")

    def lines(self, top: int = 20) -> list[str]:
        """The terminal summary: the ``top`` longest units, then each worker's span."""
        table = self.table()
        out = [f"{'seconds':>8} {'start':>7}  worker  unit (tests)"]
        for row in table["units"][:top]:
            out.append(f"{row['seconds']:8.1f} {row['started_at_s']:7.1f}  {row['worker']:<6}  "
                       f"{row['unit']} ({row['tests']})")
        for name, w in sorted(table["workers"].items()):
            out.append(f"worker {name}: {w['units']} units, busy {w['busy_s']:.0f} s, "
                       f"ended at {w['ended_at_s']:.0f} s")
        path = table["critical_path"]
        if path:
            out.append(f"critical path: {path['worker']}, {path['seconds']:.0f} s")
        return out
