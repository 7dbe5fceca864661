"""Weights & Biases beside TensorBoard (docs/logging.md): the same series reach both, the config
and run.json are the W&B run's config, a resumed run continues the same W&B run, and the API
key never lands in a file Tempera writes. W&B runs OFFLINE here (no network): what it logged is
read back from its `.wandb` run files with wandb's own protobuf records (`read_wandb_records`;
wandb 0.31 no longer ships a Python reader of the file), not from a mock."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from modules.config import validate
from modules.config.loader import from_dict, load_config
from modules.config.overrides import apply_overrides
from modules.config.problems import ConfigError
from modules.config.schema import Config
from modules.config.wandb_settings import check_wandb
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.trainer import TrainingError, train
from tests.train.test_resume import StopAt

# A made-up key of the real shape (40 hex digits): set in the environment of the shared run.
FAKE_KEY = "0123456789abcdef" * 2 + "01234567"
STEPS, STOP_AT = 3, 2
MAX_GRAD_NORM = 1e-4
BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks


def read_wandb_records(path: Path) -> list:
    """Every record of a W&B run file (`run-<id>.wandb`), as wandb's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B run file"
    payloads, partial, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the block's zero-filled tail
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk  # FULL/FIRST, MIDDLE/LAST
        if kind in (1, 4):
            payloads.append(partial)
    records = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def history(records) -> dict[int, dict[str, object]]:
    """step -> {key: value} of the run's logged rows (image keys as nested dicts)."""
    rows: dict[int, dict[str, object]] = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            keys = list(item.nested_key) or [item.key]
            target = row
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            target[keys[-1]] = json.loads(item.value_json)
        rows[int(row["_step"])] = row
    return rows


def merged_history(parts) -> dict[int, dict[str, object]]:
    """step -> {key: value} over every segment of a resumed run (a resumed segment may log
    more keys at the step the stop ended: the passes the stop cut short)."""
    rows: dict[int, dict[str, object]] = defaultdict(dict)
    for records in parts:
        for step, row in history(records).items():
            rows[step].update(row)
    return dict(rows)


def tensorboard_series(folder: Path, kind: str = "scalars") -> dict[str, dict[int, object]]:
    """tag -> step -> value (scalars) or event (images), over every events file (both halves)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    series: dict[str, dict[int, object]] = defaultdict(dict)
    for events in sorted(folder.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={kind: 0})
        accumulator.Reload()
        for tag in accumulator.Tags()[kind]:
            for event in getattr(accumulator, kind.capitalize())(tag):
                series[tag][event.step] = event.value if kind == "scalars" else event
    return series


@pytest.fixture(scope="module")
def wandb_run(tempera_cache, tmp_path_factory):
    """One run logged to TensorBoard and W&B (OFFLINE), stopped at step 2 (from its progress
    event, before step 2's passes) and resumed to 3, with a W&B key in the environment:
    samples and validation every step. ~15-20 s (two train() calls on the tiny model, a
    sample and a validation pass per step), shared by seven tests."""
    out = tmp_path_factory.mktemp("wandb") / "out"
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={out}", "data.resolution=64",
        f"training.max_steps={STEPS}", "training.batch_size=2", "training.learning_rate=1e-3",
        'sampling.prompts=["a red circle"]', "sampling.every_steps=1", "sampling.steps=2",
        "validation.every_steps=1", "validation.split_ratio=0.25",
        # far below this run's gradient norms: the logged norm is the one before clipping
        f"training.max_grad_norm={MAX_GRAD_NORM}",
        "logging.tensorboard=true", "logging.wandb=true", "logging.wandb_mode=OFFLINE",
        "logging.wandb_project=tempera-tests", "output.backup_every_steps=1"])
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_API_KEY", FAKE_KEY)
        env.setenv("WANDB_SILENT", "true")
        commands = TrainerCommands()
        callbacks = StopAt(commands, STOP_AT)
        first = train(config, callbacks, commands)
        config.training.resume_from = "latest"
        second = train(config, RecordingCallbacks())
    assert (first.status, first.steps, second.steps) == ("stopped", STOP_AT, STEPS)
    files = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))
    return out, files, [read_wandb_records(f) for f in files]


def test_the_resumed_run_continues_the_same_wandb_run(wandb_run):
    out, files, records = wandb_run
    record = json.loads((out / "run.json").read_text())
    run_id = record["wandb"]["run_id"]
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)
    assert record["wandb"]["continued"] is True and record["resume_count"] == 1
    runs = [r.run for part in records for r in part if r.WhichOneof("record_type") == "run"]
    assert {r.run_id for r in runs} == {run_id} and {r.project for r in runs} == {"tempera-tests"}
    # the first half logged steps 1-2, the resumed half step 2's passes (the stop cut them
    # short) and step 3: one series over both
    assert sorted(history(records[0])) == [1, 2] and sorted(history(records[1])) == [2, 3]
    assert set(history(records[1])[2]) >= {"sample/0", "validation/loss"}


def test_the_passes_a_stop_cut_short_run_when_the_run_is_resumed(wandb_run):
    """Stop came during step 2, before its sample and validation: the stopped run's backup
    owes them and the resumed run ran them first, so every series has every step."""
    out, _, records = wandb_run
    board = tensorboard_series(out / "tensorboard")
    images = tensorboard_series(out / "tensorboard", "images")
    logged = merged_history(records)
    every = list(range(1, STEPS + 1))
    assert sorted(board["validation/loss"]) == every and sorted(images["sample/0"]) == every
    assert [s for s in every if "sample/0" in logged[s] and "validation/loss" in logged[s]] == every
    assert sorted(p.name for p in (out / "samples").glob("*.png")) == [
        f"step-{s:06d}-0.png" for s in every]
    record = json.loads((out / "run.json").read_text())
    assert [step for step, _ in record["validation"]["history"]] == every


def test_grad_norm_and_step_time_reach_both_dashboards(wandb_run):
    """Every step logs the gradient norm before clipping (above training.max_grad_norm, which
    clipped it) and the step time (seconds per step, and images per second for its batch of
    two); test_wandb_gets_the_scalars_tensorboard_gets checks W&B has the same points."""
    out, _, _ = wandb_run
    board = tensorboard_series(out / "tensorboard")
    every = list(range(1, STEPS + 1))
    for tag in ("grad_norm", "time/step_seconds", "time/images_per_second"):
        assert sorted(board[tag]) == every, tag
    assert all(value > 10 * MAX_GRAD_NORM for value in board["grad_norm"].values())
    for step in every:
        seconds, per_second = board["time/step_seconds"][step], board["time/images_per_second"][step]
        assert seconds > 0 and per_second * seconds == pytest.approx(2, rel=1e-4)
    record = json.loads((out / "run.json").read_text())
    # the resumed half's first step is step 3: run.json's time of it is the one logged
    assert board["time/step_seconds"][STEPS] == pytest.approx(record["first_step_seconds"],
                                                              rel=1e-5)


def test_wandb_gets_the_scalars_tensorboard_gets(wandb_run):
    out, _, records = wandb_run
    board = tensorboard_series(out / "tensorboard")
    logged = merged_history(records)
    assert {"loss/step", "loss/smoothed", "lr", "validation/loss", "grad_norm",
            "time/step_seconds", "time/images_per_second"} <= set(board)
    assert sorted(board["loss/step"]) == [1, 2, 3]
    assert min(board["validation/loss"]) <= STOP_AT < max(board["validation/loss"])
    for tag, points in board.items():
        wandb_steps = sorted(step for step, row in logged.items() if tag in row)
        assert wandb_steps == sorted(points), tag
        for step, value in points.items():  # TensorBoard stores float32
            assert logged[step][tag] == pytest.approx(value, rel=1e-6), (tag, step)


def test_samples_reach_wandb_as_images_with_their_prompts(wandb_run):
    out, files, records = wandb_run
    rows = merged_history(records)
    samples = {step: row["sample/0"] for step, row in rows.items() if "sample/0" in row}
    board = tensorboard_series(out / "tensorboard", "images")["sample/0"]
    assert sorted(samples) == sorted(board) and 1 in samples and STEPS in samples
    for step, image in samples.items():
        assert image["_type"] == "image-file" and image["caption"] == "a red circle"
        assert (image["width"], image["height"]) == (64, 64)
        assert list(files[0].parent.parent.glob(f"*/files/{image['path']}")), image["path"]


def test_wandb_config_holds_the_config_and_the_run_record(wandb_run):
    _, _, records = wandb_run
    run = next(r.run for r in records[0] if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["tempera"]["training"]["max_steps"] == STEPS
    assert config["tempera"]["logging"]["wandb_mode"] == "OFFLINE"
    run_json = json.loads((wandb_run[0] / "run.json").read_text())
    # what run.json said when the run started (its status and summary come later)
    for key in ("model_type", "model_identity", "method", "device", "weight_dtype"):
        assert config["run"][key] == run_json[key], key


def test_the_api_key_is_in_no_file_the_run_wrote(wandb_run):
    out, _, _ = wandb_run
    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "run.json" for p in written) and any("backups" in p.parts
                                                                for p in written)
    holding = [p for p in written if FAKE_KEY.encode() in p.read_bytes()]
    assert holding == []


def test_a_run_without_wandb_does_not_import_it(tempera_cache, tmp_path):
    """A subprocess, since this one has imported wandb: one step on the tiny model, ~7-12 s
    (the interpreter imports torch and diffusers again)."""
    code = (
        "import sys\n"
        "from modules.config.overrides import apply_overrides\n"
        "from modules.config.schema import Config\n"
        "from modules.train.trainer import train\n"
        f"config = apply_overrides(Config(), ['general.cache_dir={tempera_cache}', "
        f"'output.dir={tmp_path / 'out'}', 'data.resolution=64', 'training.max_steps=1', "
        "'training.batch_size=2', 'sampling.prompts=[]', 'logging.tensorboard=true'])\n"
        "assert train(config).steps == 1\n"
        "print('wandb' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"


# ------------------------------------------------------------------ refused before training
def test_online_without_an_api_key_is_refused_naming_offline(tmp_path):
    config = apply_overrides(Config(), ["logging.wandb=true", "logging.wandb_mode=ONLINE"])
    problems = {p.path: str(p) for p in check_wandb(config.logging,
                                                     {"NETRC": str(tmp_path / "none")})}
    assert "WANDB_API_KEY" in problems["logging.wandb_mode"]
    assert "OFFLINE" in problems["logging.wandb_mode"]
    assert check_wandb(config.logging, {"WANDB_API_KEY": FAKE_KEY}) == []
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {FAKE_KEY}\n")
    assert check_wandb(config.logging, {"NETRC": str(netrc)}) == []


@pytest.mark.parametrize("name", ["team/project", "a:b", "", "x" * 129])
def test_a_project_name_wandb_refuses_is_reported(name):
    config = apply_overrides(Config(), ["logging.wandb=true", "logging.wandb_mode=OFFLINE"])
    config.logging.wandb_project = name
    problems = [p for p in validate(config) if p.path == "logging.wandb_project"]
    assert len(problems) == 1 and "W&B refuses it" in str(problems[0])


def test_wandb_not_installed_is_reported(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    config = apply_overrides(Config(), ["logging.wandb=true", "logging.wandb_mode=OFFLINE"])
    problems = {p.path: str(p) for p in validate(config)}
    assert "pip install tempera[wandb]" in problems["logging.wandb"]


def process_wide_settings() -> dict:
    """What a run's setup may change for the whole process (the GUI trains several runs in
    one): the float32 precision switches, the compile engine's dynamo/inductor settings,
    cache folders and compile callbacks."""
    import os

    import torch
    import torch._dynamo
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    from modules.compile.cache import CACHE_DIR_ENV, TRITON_CACHE_ENV
    handler = torch._dynamo.callback_handler
    return {"matmul": torch.get_float32_matmul_precision(),
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "recompile_limit": torch._dynamo.config.recompile_limit,
            "fx_graph_cache": inductor_config.fx_graph_cache,
            "autograd_cache": functorch_config.enable_autograd_cache,
            "env": {name: os.environ.get(name) for name in (CACHE_DIR_ENV, TRITON_CACHE_ENV)},
            "callbacks": (list(handler.start_callbacks), list(handler.end_callbacks))}


def test_online_without_a_server_stops_before_the_first_step_offering_offline(
        tempera_cache, tmp_path, monkeypatch):
    """W&B's server unreachable (a closed local port): train() ends with a clear error after
    the model loads and before any step, and the failed setup leaves the process as it found
    it: the compile engine (AOT_EAGER, built before W&B starts) closed, its dynamo/inductor
    settings and cache folders back, the output folder's lock let go (~10-15 s: the tiny
    model, and W&B's 5 s wait; compiling is lazy, so nothing compiles)."""
    import torch
    import torch._dynamo
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setattr("modules.train.outputs.metrics.WANDB_INIT_TIMEOUT_S", 5.0)
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={tmp_path / 'out'}",
        "data.resolution=64", "training.max_steps=2", "training.batch_size=2",
        "sampling.prompts=[]", "logging.tensorboard=true", "logging.wandb=true",
        "logging.wandb_project=tempera-tests", "compile.backend=AOT_EAGER",
        f"compile.cache_dir={tmp_path / 'compile-cache'}"])
    torch._dynamo.reset()  # the engine resets dynamo: start from a reset state to compare
    previous_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # not the default, so a reset would show
    try:
        before = process_wide_settings()
        callbacks = RecordingCallbacks()
        with pytest.raises(TrainingError) as err:
            train(config, callbacks)
        assert process_wide_settings() == before
    finally:
        torch.set_float32_matmul_precision(previous_precision)
    assert callbacks.compile_events  # the engine was built (and announced what it compiles)
    message = str(err.value)
    assert "Weights & Biases could not start the run in project 'tempera-tests' (ONLINE)" in message
    assert "logging.wandb_mode = OFFLINE" in message and FAKE_KEY not in message
    assert callbacks.progress == [] and not (tmp_path / "out" / "backups").exists()
    from modules.train.setup.output_lock import OutputLock
    OutputLock(tmp_path / "out").acquire().release()  # the failed run let go of its lock


# ------------------------------------------------------------------ the key is never a setting
def test_a_wandb_key_in_a_config_or_preset_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        from_dict({"logging": {"wandb": True, "wandb_api_key": FAKE_KEY}})
    assert "logging.wandb_api_key" in str(err.value) and "WANDB_API_KEY" in str(err.value)
    assert FAKE_KEY not in str(err.value)
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({"logging": {"wandb_project": FAKE_KEY}}))
    with pytest.raises(ConfigError) as err:
        load_config(preset)
    assert "logging.wandb_project" in str(err.value) and FAKE_KEY not in str(err.value)
    # the environment's key anywhere in a value, even inside longer text
    monkeypatch.setenv("WANDB_API_KEY", "my-own-key-format-" + "z" * 24)
    with pytest.raises(ConfigError):
        from_dict({"sampling": {"prompts": ["a cat my-own-key-format-" + "z" * 24]}})
    # a Hugging Face cache path holds a 40-hex commit hash and is no key
    from_dict({"model": {"path": f"/hf/snapshots/{FAKE_KEY}"}})
