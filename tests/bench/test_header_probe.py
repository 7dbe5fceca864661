"""The header probe's cases (modules/bench/header_probe.py): which processes share an inductor
cache or a temporary folder, and which switch each turns. The processes themselves run in
`scripts/probe_compile_header.py` (minutes of inductor)."""
from __future__ import annotations

from modules.bench.header_probe import CASES, case_env


def test_the_warm_cases_share_the_cold_cache_and_differ_in_the_temporary_folder(tmp_path):
    env = {case: case_env(case, tmp_path) for case in CASES}
    cache = {case: e["TORCHINDUCTOR_CACHE_DIR"] for case, e in env.items()}
    tmp = {case: e["TMPDIR"] for case, e in env.items()}
    assert list(CASES)[0] == "cold"  # the warm cases read what it wrote
    assert cache["warm-same-tmp"] == cache["warm-new-tmp"] == cache["cold"]
    assert tmp["warm-same-tmp"] == tmp["cold"]
    assert tmp["warm-new-tmp"] != tmp["cold"] and tmp["warm-new-tmp-no-header"] != tmp["cold"]
    assert len({cache["cold"], cache["cold-no-header"], cache["cold-O0"]}) == 3
    assert all((tmp_path / name).is_dir() for _, name, _ in CASES.values())
    off = {case for case, e in env.items()
           if e.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS") == "0"}
    assert off == {"warm-new-tmp-no-header", "cold-no-header"}
    assert {case for case, e in env.items()
            if e.get("TORCHINDUCTOR_DEBUG_COMPILE") == "1"} == {"cold-O0"}
