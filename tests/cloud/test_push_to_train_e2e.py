"""End to end with the real trainer: a push to the "cloud" bare repo trains the pushed config.

One tiny run (2 steps of the built-in model, the text encoder compiled with AOT_EAGER; compiling
the UNet too costs 30-80 s on a CPU, so it is left out) plus pushes that must start nothing.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from modules.cloud.cli import main as cloud_main
from modules.cloud.queue import list_statuses, wait_for
from modules.cloud.runs import default_train_command
from modules.cloud.secrets import scan_text

from .conftest import git, sparse_config

HF = "hf_" + "Xk7" * 12

COMPILE = {"backend": "AOT_EAGER", "denoiser": False, "text_encoder": True, "vae": False}


def tiny_config(**extra) -> dict:
    return sparse_config(
        data={"resolution": 64},
        training={"max_steps": 2, "batch_size": 2, **extra},
        compile=COMPILE,
        sampling={"prompts": [], "every_steps": 0},
        logging={"tensorboard": False},
        output={"dir": "../outputs/tiny"})


def test_push_trains_the_config_with_its_compile_settings_and_records_the_commit(
        make_cloud, tempera_cache, capsys):
    # What differs on the GPU machine lives in its local.json, not in the pushed config.
    cloud = make_cloud(default_train_command(),
                       local={"general.cache_dir": str(tempera_cache), "general.device": "CPU"})
    output = cloud.commit_and_push({"runs/tiny.json": tiny_config()}, "train tiny")
    commit = cloud.head()
    assert "runs/tiny.json: queued as" in output
    (status,) = wait_for(cloud.work_root, cloud.run_ids(), timeout=240)
    log = Path(status.log).read_text()
    assert status.state == "finished", log[-3000:]
    assert status.exit_code == 0 and status.commit == commit
    # A clean progress line in the log (no tqdm bar) and progress.json beside the status.
    assert "[progress] step 2/2 (100%)  loss " in log and "\r" not in log
    progress = json.loads((Path(status.log).parent / "progress.json").read_text())
    assert progress["step"] == progress["max_steps"] == 2 and progress["loss"] is not None

    out = Path(status.output_dir)
    assert out.parent == cloud.work_root.resolve() / "outputs"
    resolved = json.loads((out / "config.json").read_text())
    assert {k: resolved["compile"][k] for k in COMPILE} == COMPILE
    assert resolved["general"]["cache_dir"] == str(tempera_cache)  # from the machine's local.json
    # The worker pointed compile.bundle at the pushed repo's bundles/ (tempera-cloud init made it)
    assert resolved["compile"]["bundle"] == str(Path(status.checkout) / "bundles")
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "finished" and record["steps_done"] == 2
    assert record["meta"] == {"commit": commit, "config": "runs/tiny.json",
                              "cloud_run_id": status.run_id}
    requested = {name: record["compile"][name]["requested"] for name in ("unet", "text_encoder",
                                                                          "vae")}
    assert requested == {"unet": "NONE", "text_encoder": "AOT_EAGER", "vae": "NONE"}
    # Nothing compiles with inductor: no bundle looked for, and the worker read that from run.json
    assert "compile_bundle" in record and record["compile_bundle"] is None
    assert status.compile_bundle == {"lookup": "off"}

    # A push that leaves the config unchanged starts nothing.
    output = cloud.commit_and_push({"README.md": "notes\n"}, "docs")
    assert "nothing to train" in output and len(cloud.run_ids()) == 1

    # A push with an invalid config records why and starts nothing.
    output = cloud.commit_and_push({"runs/broken.json": tiny_config(batch_size=0)}, "broken")
    broken = list_statuses(cloud.work_root)[-1]
    assert broken.state == "invalid" and broken.config == "runs/broken.json"
    assert any("training.batch_size" in p for p in broken.problems)
    assert "runs/broken.json: INVALID" in output and not Path(broken.output_dir).exists()

    # status shows both, read from the machine's work root.
    capsys.readouterr()
    assert cloud_main(["status", "--remote", str(cloud.work_root)]) == 0
    table = capsys.readouterr().out
    assert status.run_id in table and "finished" in table and "invalid" in table

    # push-and-train refuses a config holding a token; nothing secret is in the pushed history.
    leaky = cloud.repo.parent / "leaky.json"
    leaky.write_text(json.dumps({**tiny_config(), "hub_token": HF}))
    assert cloud_main(["push-and-train", str(leaky), "--repo", str(cloud.repo)]) == 1
    history = subprocess.run(["git", "log", "-p", "--all"], cwd=cloud.bare, check=True,
                             capture_output=True, text=True).stdout
    assert "runs/tiny.json" in history and scan_text(history, "bare repo history") == []
    assert HF not in history and len(cloud.run_ids()) == 2
    assert git(cloud.bare, "rev-parse", "main") == cloud.head()
