"""Two processes on the CPU (gloo), launched by torchrun like `accelerate launch` would."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


# scripts/train.py's main, then what is left of the process group when it returned: a group
# left to the interpreter's exit can abort a rank that finished (Distributed.close)
DRIVER = """import sys
import torch.distributed
sys.path.insert(0, {repo!r})
from modules.cli.train import main
code = main(sys.argv[1:])
# one write per rank: torchrun's ranks share the pipe unbuffered, and print's separate
# arguments were written apart and interleaved with the other rank's
print("process group still initialized: " + str(torch.distributed.is_initialized()))
sys.exit(code)
"""


def run_torchrun(tmp_path: Path, settings: dict, port: int) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch"
    config = tmp_path / "ddp.json"
    config.write_text(json.dumps(settings))
    driver = tmp_path / "train_then_report.py"
    driver.write_text(DRIVER.format(repo=str(REPO)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", str(port),
         str(driver), "--config", str(config), "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)


@pytest.mark.timeout(600)
def test_two_processes_stay_in_sync_and_write_once(tmp_path, tempera_cache):
    """One 2-process DDP run (one launch: each costs two processes importing torch, loading
    the tiny model and compiling its UNet): the compiled UNet and the trained text encoder
    both wrapped, gradient accumulation, an epoch split over the ranks, a sample, the LoRA
    written once, the process group left before exit."""
    result = run_torchrun(tmp_path, {
        "general": {"cache_dir": str(tempera_cache), "device": "CPU"},
        "data": {"resolution": 64},
        "training": {"max_steps": 0, "epochs": 1, "batch_size": 4, "gradient_accumulation": 2,
                     "learning_rate": 1e-3},
        "components": {"text_encoder": {"train": True}},
        "compile": {"backend": "AOT_EAGER", "scope": "FULL", "dynamic": "STATIC",
                    "unet": True},
        "sampling": {"prompts": ["a red circle"], "steps": 2},
        "logging": {"tensorboard": False},
        "output": {"dir": "out"},
    }, port=29533)
    assert result.returncode == 0, result.stderr[-3000:]

    out = tmp_path / "out"
    record = json.loads((out / "run.json").read_text())
    dist = record["distributed"]
    assert dist["world_size"] == 2 and dist["backend"] == "gloo"
    launcher = shlex.split(record["launcher"])  # what a printed resume command starts with
    assert Path(launcher[0]).name == "torchrun" and launcher[1:] == [
        "--nproc_per_node", "2", "--master_port", "29533", str(tmp_path / "train_then_report.py")]
    # the ranks trained on different images and noise, so being in sync means gradients were
    # averaged (without the wrappers the checksums differ), exchanged on the closing
    # micro-batch of each step
    assert dist["ranks_in_sync"], dist["weight_checksums"]
    assert dist["compiled_code_ran_on_all_ranks"]["unet"]
    # compile, then wrap: the compiled UNet ran inside DistributedDataParallel on both ranks;
    # both trained components are wrapped
    assert dist["data_parallel"] == {"unet": "DistributedDataParallel",
                                     "text_encoder": "DistributedDataParallel"}
    # 48 images sharded over 2 ranks, batch 4 and 2 micro-batches a step: 3 steps make one
    # epoch.
    assert record["steps_done"] == 3 and len(record["losses"]) == 3
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-000003-0.png"]
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
    assert result.stdout.count("finished: 3 steps") == 2  # each rank reports its exit
    # each rank left the process group before the interpreter's exit
    assert result.stdout.count("process group still initialized: False") == 2, result.stdout
