"""``benchmark_compile.py buckets``: one setting end to end, numbers read from the run's run.json."""
from __future__ import annotations

import json

from modules.bench.buckets import markdown
from modules.bench.cli import main


def test_one_bucketed_setting_is_measured_and_tabled(tmp_path, tempera_cache):
    out = tmp_path / "out"
    assert main(["buckets", "--out", str(out), "--scopes", "REGIONAL", "--dynamic", "DYNAMIC",
                 "--epochs", "2", "--cache-dir", str(tempera_cache), "--device", "cpu"]) == 0
    result = json.loads((out / "buckets.json").read_text())
    assert result["device"] == "cpu" and result["precision"] == "fp32"
    (row,) = result["rows"]
    assert row["device"].startswith("cpu")
    assert row["exit_code"] == 0 and row["compiled_code_ran"]
    assert row["shapes"] == 3          # three aspect ratios, batch 2, two images each
    assert row["steps"] == 6           # 3 buckets x 1 batch x 2 epochs
    assert row["recompiles_after_first_pass"] == 0
    assert row["compile_seconds"] > 0
    table = (out / "buckets.md").read_text()
    assert "| REGIONAL | DYNAMIC | 6 | 3 |" in table and result["machine"]["cpu"] in table
    assert "fp32" in table


def test_a_failed_setting_is_a_row_with_its_error():
    result = {"machine": {"cpu": "x", "cpu_cores": 2, "torch": "t", "date": "d"},
              "backend": "AOT_EAGER", "epochs": 3, "precision": "bf16",
              "rows": [{"scope": "FULL", "dynamic": "STATIC", "exit_code": 1,
                        "error": "TrainingError: boom"}]}
    assert "| FULL | STATIC | failed: TrainingError: boom |" in markdown(result)
