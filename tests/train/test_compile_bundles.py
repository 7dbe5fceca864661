"""Compile bundles through the real trainer: the first run writes one, a second process with
another cache folder and home starts from it alone (inductor's cache hits, not misses) and
trains the same numbers, and a damaged bundle is named and passed over without stopping a run.

The compiled component is the frozen text encoder, FULL: its forward-only graph is the
cheapest real inductor compile a run makes (about 20 s here; the UNet's forward and backward
take minutes). The bundle file format's refusals are tests/compile/test_bundle.py's."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from modules.train.trainer import train
from tests.child_env import REPO, with_repo_on_pythonpath

pytestmark = pytest.mark.inductor

COMPILED = ["compile.backend=INDUCTOR", "compile.scope=FULL", "compile.denoiser=false",
            "compile.text_encoder=true", "training.max_steps=2"]


def encoder_seconds(record: dict) -> float:
    return record["compile"]["text_encoder"]["compile_seconds"]


def _record(folder) -> dict:
    return json.loads((folder / "run.json").read_text())


def train_elsewhere(tempera_cache, tmp_path, name: str, **compile_settings) -> dict:
    """A run of the compiled settings in a fresh process with its own home (what another
    machine is): its run.json. The test process's own global state (what earlier tests in it
    left) is no part of a bundle's fingerprint, so the bundle is made in a fresh process too;
    CPU kernels are built for a thread count, which the child gets from this process."""
    config = {"general": {"cache_dir": str(tempera_cache)}, "data": {"resolution": 64},
              "training": {"max_steps": 2, "batch_size": 2, "learning_rate": 1e-3},
              "sampling": {"prompts": []}, "logging": {"tensorboard": False},
              "output": {"dir": str(tmp_path / name)},
              "compile": {"backend": "INDUCTOR", "scope": "FULL", "denoiser": False,
                          "text_encoder": True, **compile_settings}}
    (tmp_path / f"{name}.json").write_text(json.dumps(config))
    env = with_repo_on_pythonpath()
    env["HOME"] = str(tmp_path / f"home-{name}")
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--config",
                           str(tmp_path / f"{name}.json"), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return _record(tmp_path / name)


def test_a_bundle_warms_a_fresh_cache_folder_in_another_process_and_changes_no_number(
        tiny_config, tempera_cache, tmp_path):
    """Over 10 s: one cold inductor compile of the text encoder (the first run), and a second
    process with another cache folder and home that must not compile it cold (it loads the
    bundle): what a new machine or a cloud run meets. A third run in the first cache folder,
    told to start from a truncated bundle, finds the cache folder's own and names the damaged
    one."""
    record = train_elsewhere(tempera_cache, tmp_path, "a", cache_dir=str(tmp_path / "cache_a"))
    written = record["compile_bundle"]["written"]
    assert record["compile_bundle"]["lookup"] == "miss" and written, record["compile_bundle"]
    assert record["compile"]["text_encoder"]["cache"] == "miss"
    assert record["compile"]["text_encoder"]["bundle"].startswith("miss")
    assert record["compile"]["unet"]["bundle"] == "off"  # not compiled

    second = train_elsewhere(tempera_cache, tmp_path, "b", cache_dir=str(tmp_path / "cache_b"),
                             bundle=written)
    assert second["compile_bundle"]["lookup"] == "hit", second["compile_bundle"]
    assert second["compile_bundle"]["found"] == written
    assert second["compile_bundle"]["loaded_entries"] > 0
    cold = record["compile"]["text_encoder"]["compile_seconds"]
    assert second["compile_bundle"]["cold_compile_seconds"] == pytest.approx(cold, abs=0.1)
    assert second["compile_bundle"]["seconds_saved"] == pytest.approx(
        cold - encoder_seconds(second), abs=0.2)
    encoder = second["compile"]["text_encoder"]
    # every graph the first run compiled cold came from the bundle, none compiled again
    compiled_cold = record["compile"]["text_encoder"]["cache_misses"]
    assert compiled_cold > 0 and encoder["cache_hits"] == compiled_cold, encoder
    assert encoder["bundle"] == "hit" and encoder["cache"] == "hit", encoder
    assert encoder["compiled_code_ran"]
    assert second["losses"] == record["losses"]

    cut = tmp_path / "cut.tcb"
    data = (tmp_path / "cache_a" / "bundles").joinpath(written.rsplit("/", 1)[1]).read_bytes()
    cut.write_bytes(data[:100])
    third = train(tiny_config(f"output.dir={tmp_path / 'c'}",
                              f"compile.cache_dir={tmp_path / 'cache_a'}",
                              f"compile.bundle={cut}", *COMPILED))
    bundle = _record(third.output_dir)["compile_bundle"]
    assert third.status == "finished"
    assert bundle["lookup"] == "hit" and bundle["found"] == written
    assert len(bundle["skipped"]) == 1 and str(cut) in bundle["skipped"][0]
