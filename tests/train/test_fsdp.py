"""FSDP (training.distributed_strategy=FSDP): a full fine-tune sharded over 2 gloo processes on
the CPU, launched by torchrun as `accelerate launch` would; what it refuses and why."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.caveats import config_warnings
from modules.config.loader import from_dict
from modules.config.schema import DistributedStrategy
from modules.config.problems import ConfigError
from modules.config.validate import validate
from modules.train.recipe.distributed import Distributed
from tests.child_env import with_repo_on_pythonpath
from tests.train.test_distributed import REPO, run_torchrun
from tests.train.test_resume import assert_resumed_as

# the one 2-process run every test below reads: it also trains the text encoder (sharded too)
# with gradient checkpointing on, and samples and validates (every rank runs those forwards)
FSDP_RUN = {
    "data": {"resolution": 64},
    "training": {"method": "FINE_TUNE", "distributed_strategy": "FSDP", "max_steps": 3,
                 "batch_size": 2, "gradient_accumulation": 2, "learning_rate": 1e-4,
                 "max_grad_norm": 1.0, "gradient_checkpointing": True},
    "components": {"text_encoder": {"train": True}},
    "compile": {"backend": "AOT_EAGER", "scope": "REGIONAL", "unet": True},
    "sampling": {"prompts": ["a red circle"], "steps": 2},
    "validation": {"every_steps": 2, "split_ratio": 0.05, "save_best": True},  # 2 images
    "logging": {"tensorboard": False},
    "output": {"dir": "out", "save_every_steps": 1, "backup_every_steps": 2},
}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tempera_cache) -> Path:
    """One 2-process FSDP run (3 steps of 2 micro-batches, AOT_EAGER REGIONAL, a backup, a
    sample and a validation pass at step 2) read by the tests below; about 60 s on 2 idle
    cores (85-95 s measured with them shared), the cost of two processes loading and compiling
    the tiny UNet (the 2-process DDP tests cost the same)."""
    folder = tmp_path_factory.mktemp("fsdp")
    settings = {**FSDP_RUN, "general": {"cache_dir": str(tempera_cache), "device": "CPU"}}
    result = run_torchrun(folder, settings, port=29541)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("finished: 3 steps") == 2  # each rank reports its exit
    return folder / "out"


def killed_after_backup(out: Path, copy: Path, step: int) -> Path:
    """`out` copied to `copy` as a run killed after its backup of `step` leaves its folder
    (a lost machine, the case FSDP's backups are for): run.json still says `running`, and
    neither final/ nor a later backup was written. Returns the backup folder."""
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "final")
    for later in (copy / "backups").glob("step-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    record = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**record, "status": "running"}))
    return copy / "backups" / f"step-{step:06d}"


@pytest.fixture(scope="module")
def fsdp_resumed(fsdp_run, tmp_path_factory, tempera_cache) -> Path:
    """`fsdp_run` killed after its backup of step 2 and resumed on 2 processes for step 3:
    the one more 2-process run exact resume needs (the unbroken run is `fsdp_run`). 76-92 s
    measured here with the 2 cores shared, like `fsdp_run`: two processes loading and
    compiling the tiny UNet again."""
    folder = tmp_path_factory.mktemp("fsdp-resumed")
    backup = killed_after_backup(fsdp_run, folder / "out", step=2)
    settings = {**FSDP_RUN, "general": {"cache_dir": str(tempera_cache), "device": "CPU"},
                "training": {**FSDP_RUN["training"], "resume_from": str(backup)}}
    result = run_torchrun(folder, settings, port=29543)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("finished: 3 steps") == 2
    return folder / "out"


def record_of(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


@pytest.mark.timeout(600)
def test_fsdp_trains_in_sync_and_saves_whole_weights(fsdp_run):
    record = record_of(fsdp_run)
    dist = record["distributed"]
    assert dist["strategy"] == "FSDP" and dist["shards"] == 2 and dist["world_size"] == 2
    assert dist["data_parallel"] == {"unet": "FSDPUNet2DConditionModel",
                                     "text_encoder": "FSDPCLIPTextModel"}
    assert dist["ranks_in_sync"], dist["weight_checksums"]
    assert dist["compiled_code_ran_on_all_ranks"]["unet"]
    assert record["steps_done"] == 3 and len(record["losses"]) == 3
    # final/ holds the gathered (whole) UNet: it loads with diffusers and its weights are the
    # ones both ranks summed (the checksum gathers every shard)
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel
    unet = UNet2DConditionModel.from_pretrained(fsdp_run / "final" / "unet")
    encoder = CLIPTextModel.from_pretrained(fsdp_run / "final" / "text_encoder")
    total = sum(float(p.detach().double().sum())
                for p in [*unet.parameters(), *encoder.parameters()])
    assert total == pytest.approx(dist["weight_checksums"][0], rel=1e-9)
    # a checkpoint during training is gathered the same way (both ranks take part)
    assert sorted(record["checkpoints"]) == ["step-000001", "step-000002"]  # step 3: final/
    first = UNet2DConditionModel.from_pretrained(fsdp_run / "checkpoints" / "step-000001" / "unet")
    assert sum(float(p.detach().double().sum()) for p in first.parameters()) != sum(
        float(p.detach().double().sum()) for p in unet.parameters())


def test_fsdp_trains_the_text_encoder_with_gradient_checkpointing(fsdp_run):
    """The shared run had gradient checkpointing on and trained the (sharded) text encoder:
    its saved weights moved away from the base model's."""
    from transformers import CLIPTextModel
    config = json.loads((fsdp_run / "config.json").read_text())
    assert config["training"]["gradient_checkpointing"]
    assert config["components"]["text_encoder"]["train"]
    base = CLIPTextModel.from_pretrained(base_model_folder(fsdp_run) / "text_encoder")
    trained = CLIPTextModel.from_pretrained(fsdp_run / "final" / "text_encoder")
    assert any(not torch.equal(a, b) for a, b in zip(base.parameters(), trained.parameters()))


def base_model_folder(out: Path) -> Path:
    from modules.paths import cache_dir_for
    from modules.train.setup.prepare import resolve_model_path
    config = from_dict(json.loads((out / "config.json").read_text()))
    return Path(resolve_model_path(config.model.path, cache_dir_for(config.general.cache_dir)))


@pytest.mark.timeout(300)
def test_fsdp_samples_and_validation_equal_one_process_on_the_same_weights(fsdp_run,
                                                                           tmp_path):
    """Every rank ran the sampling and validation forwards on its shards; rank 0 wrote the
    sample, both ranks scored the same validation loss, and one process holding the saved
    (gathered) weights of the same step draws the same image and scores the same loss, bit for
    bit: FSDP's all-gather hands each block its exact weights, and with the same inputs and
    seeds on one thread of the same CPU (as each rank ran) the forwards are the same
    arithmetic (on two threads the loss moves in its 8th digit: the sums split differently).
    About 9 s: the one-process run's setup (the tiny model, the training and validation
    images' latents) and its validation pass and sample on one thread."""
    from diffusers import UNet2DConditionModel
    from PIL import Image
    from transformers import CLIPTextModel

    from modules.events import RecordingCallbacks, TrainerCommands
    from modules.train.outputs.sampling import sample_images
    from modules.train.recipe.distributed import Distributed
    from modules.train.recipe.recipe import TrainingRecipe, forward_loss
    from modules.train.setup.prepare import prepare_run
    from modules.train.validation.validation import score

    record = record_of(fsdp_run)
    assert sorted(p.name for p in (fsdp_run / "samples").iterdir()) == ["step-000003-0.png"]
    validation = record["validation"]
    [[step2, loss2], [step, loss]] = validation["history"]  # every 2 steps, and at the end
    assert (step2, step) == (2, 3) and validation["last_pass_ranks"] == [loss, loss]
    best = min([(loss2, 2), (loss, 3)])
    assert record["best_weights"] == {"folder": "best", "step": best[1], "loss": best[0]}
    assert (fsdp_run / "best" / "unet").is_dir()  # gathered by both ranks, written by rank 0

    config = apply_overrides(from_dict(json.loads((fsdp_run / "config.json").read_text())),
                             [f"output.dir={tmp_path / 'one'}"])
    callbacks = RecordingCallbacks()
    recipe = TrainingRecipe(prepare_run(config, callbacks), callbacks, Distributed(),
                            TrainerCommands())
    run = recipe.setup()
    try:
        final = fsdp_run / "final"
        run.bundle.denoiser.load_state_dict(
            UNet2DConditionModel.from_pretrained(final / "unet").state_dict())
        run.bundle.text_encoders["text_encoder"].load_state_dict(
            CLIPTextModel.from_pretrained(final / "text_encoder").state_dict())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank ran (OMP_NUM_THREADS=1): the same sums' order
        try:
            assert score(run, forward_loss)[0] == loss
            [(_, _, image)] = sample_images(run.bundle, run.config, run.prompts, run.device, 3,
                                            tmp_path)
        finally:
            torch.set_num_threads(threads)
    finally:
        recipe.close()
    written = Image.open(fsdp_run / "samples" / "step-000003-0.png")
    assert np.array_equal(np.asarray(image), np.asarray(written))


@pytest.mark.timeout(600)
def test_fsdp_backups_hold_the_whole_state_and_resume_exactly(fsdp_run, fsdp_resumed):
    """Every rank gathered its shards into rank 0's backups (step 2, scheduled, and step 3,
    finished), written in the one-process format: every UNet weight whole under its own name,
    the optimizer's per-weight state whole. The run resumed from the step-2 backup on 2
    processes equals the unbroken one: the losses step by step and final/ bit for bit."""
    record = record_of(fsdp_run)
    assert record["backups"] == {"sharded_over": 2, "gathered_to": "rank 0",
                                 "format": "whole tensors, the format one process or DDP "
                                           "writes",
                                 "resumes_with": ["FSDP", "DDP", "one process"]}
    assert [p.name for p in sorted((fsdp_run / "backups").iterdir())] == [
        "step-000002", "step-000003"]
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel
    from modules.train.state.backup import load_states
    info, states = load_states(fsdp_run / "backups" / "step-000002")
    assert info["step"] == 2 and info["reason"] == "scheduled"
    checkpoint = fsdp_run / "checkpoints" / "step-000002"
    unet = UNet2DConditionModel.from_pretrained(checkpoint / "unet")
    encoder = CLIPTextModel.from_pretrained(checkpoint / "text_encoder")
    whole = {f"unet.{name}": p for name, p in unet.named_parameters()}
    whole.update({f"text_encoder.{name}": p for name, p in encoder.named_parameters()})
    assert states["parameters"].keys() == whole.keys()
    assert all(torch.equal(states["parameters"][k], whole[k]) for k in whole)
    adam = states["optimizer"]["state"]
    assert len(adam) == len(whole)
    # the optimizer's ids follow the order the backup lists the parameters in
    ordered = [whole[name] for name in states["parameters"]]
    assert all(adam[i]["exp_avg"].shape == ordered[i].shape for i in adam)
    assert_resumed_as(fsdp_run, fsdp_resumed)
    assert record_of(fsdp_resumed)["resumed_at_step"] == 2


def launch_two_ranks(folder: Path, settings: dict, port: int, timeout: float
                     ) -> list[subprocess.CompletedProcess]:
    """tests/train/fsdp_worker.py then scripts/train.py's main as ranks 0 and 1 of one gloo
    group, each started on its own with the variables torchrun would give it, not under
    torchrun: torchrun ends every rank as soon as one fails, which would hide a rank left
    waiting in a collective. A rank still running after `timeout` seconds is killed (its
    return code then says so)."""
    config = folder / "settings.json"
    config.write_text(json.dumps(settings))
    processes = []
    for rank in (0, 1):
        env = {**with_repo_on_pythonpath(), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        processes.append(subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "train" / "fsdp_worker.py"), "--config",
             str(config), "--quiet"], cwd=folder, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    finished = []
    for rank, process in enumerate(processes):
        try:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        finished.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return finished


@pytest.fixture(scope="module")
def failing_ranks(tmp_path_factory, tempera_cache):
    """One launch of 2 processes, each running tests/train/fsdp_worker.py's checks (rank 0
    prints them) and then an FSDP run whose sample of step 2 rank 0 cannot write (a folder
    stands where its file must go). Returns the ranks' results and the run's folder. 23 s
    measured with the 2 cores otherwise idle for the run alone, 49 s beside another test run
    (two processes loading the tiny model, no compile, training 2 steps), and about 20 s more
    for the checks (compiling two blocks twice); one launch instead of two saves the second
    pair of processes importing torch and diffusers."""
    folder = tmp_path_factory.mktemp("fsdp-failing")
    out = folder / "out"
    blocker = out / "samples" / "step-000002-0.png"
    (blocker / "inside").mkdir(parents=True)  # the sample of step 2 cannot be put there
    settings = {
        "general": {"cache_dir": str(tempera_cache), "device": "CPU"},
        "data": {"resolution": 64},
        "training": {"method": "FINE_TUNE", "distributed_strategy": "FSDP", "max_steps": 3,
                     "batch_size": 2, "learning_rate": 1e-4},
        "compile": {"backend": "NONE"},
        "sampling": {"prompts": ["a red circle"], "steps": 2, "every_steps": 2},
        "logging": {"tensorboard": False},
        "output": {"dir": str(out), "save_every_steps": 1, "backup_every_steps": 1},
    }
    started = time.monotonic()
    ranks = launch_two_ranks(folder, settings, port=29545, timeout=400)
    return ranks, out, time.monotonic() - started


@pytest.mark.timeout(600)
def test_a_write_rank_0_cannot_make_stops_every_rank_with_its_message(failing_ranks):
    """A sample rank 0 cannot write stops both ranks at once with the same error naming the
    file and the cause, where before rank 0 stopped alone and rank 1 waited in the next step's
    collective until the process group's timeout. The checkpoint and the backup of step 1
    stay whole."""
    ranks, out, seconds = failing_ranks
    blocker = out / "samples" / "step-000002-0.png"
    errors = [[line for line in rank.stderr.splitlines() if line.startswith("error:")]
              for rank in ranks]
    assert [rank.returncode for rank in ranks] == [1, 1], (seconds, ranks[0].stderr[-2000:],
                                                           ranks[1].stderr[-2000:])
    assert errors[0] == errors[1] and len(errors[0]) == 1  # the same message on both ranks
    [message] = errors[0]
    assert "training failed at step 2: WriteFailed: rank 0 could not write the samples of " \
           "step 2" in message
    assert "IsADirectoryError" in message and str(blocker) in message  # the cause, the file
    record = record_of(out)
    assert record["status"] == "failed" and record["error"] in message
    # what was saved before the failure is whole: the checkpoint and backup of step 1
    from diffusers import UNet2DConditionModel
    from modules.train.state.backup import load_states
    UNet2DConditionModel.from_pretrained(out / "checkpoints" / "step-000001" / "unet")
    info, states = load_states(out / "backups" / "step-000001")
    assert info["step"] == 1 and states["training"]["step"] == 1
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["step-000002-0.png"]
    assert blocker.is_dir() and (blocker / "inside").is_dir()  # left as it was


def test_an_fsdp_backup_resumes_in_one_process_under_ddp(fsdp_run, tmp_path):
    """Backups have one format: the FSDP run's step-2 backup resumes in one process with
    training.distributed_strategy=DDP (a change the resume lists, and allows). Its step 3
    differs from the 2-process one (one process reads the data unsplit), so what is checked is
    that every weight and optimizer state loaded and training went on from step 2. 10-17 s
    measured here (cores shared): one process loading the tiny model and training one step."""
    from modules.events import RecordingCallbacks
    from modules.train.trainer import train
    backup = killed_after_backup(fsdp_run, tmp_path / "out", step=2)
    config = apply_overrides(from_dict(json.loads((fsdp_run / "config.json").read_text())), [
        f"output.dir={tmp_path / 'out'}", f"training.resume_from={backup}",
        "training.distributed_strategy=DDP", "compile.backend=NONE"])
    result = train(config, RecordingCallbacks())
    assert result.status == "finished" and result.steps == 3
    record, fsdp_record = record_of(tmp_path / "out"), record_of(fsdp_run)
    assert record["resume_count"] == 1 and record["resumed_at_step"] == 2
    assert record["losses"][:2] == fsdp_record["losses"][:2]
    assert [change for change in record["resume_changed"]
            if change.startswith("training.distributed_strategy")] == [
        "training.distributed_strategy: 'FSDP' -> 'DDP'"]


def test_sharded_blocks_stay_regionally_compiled(fsdp_run):
    """REGIONAL still finds each block after FSDP renamed its class (FSDP<class>), and nothing
    recompiles after the first step (tests/train/fsdp_worker.py compares graphs and breaks
    with an unsharded compile)."""
    sharded = record_of(fsdp_run)["compile"]["unet"]
    assert sharded["scope"] == "REGIONAL" and sharded["degraded"] is None
    assert sharded["late_recompiles"] == 0 and sharded["fallbacks"] == []


def test_memory_plan_divides_what_fsdp_shards(fsdp_run, monkeypatch):
    """The plan's per-process figures for the sharded weights and gradients are the bytes of
    the largest local shard the ranks held (DTensor.to_local())."""
    from modules.train.memory.memory_plan import plan_memory
    from modules.paths import cache_dir_for
    from modules.train.setup.prepare import resolve_model_path
    config = from_dict(json.loads((fsdp_run / "config.json").read_text()))
    model = resolve_model_path(config.model.path, cache_dir_for(config.general.cache_dir))
    monkeypatch.setenv("WORLD_SIZE", "2")
    lines = dict(plan_memory(config, model, distributed=True).lines)
    shard = max(record_of(fsdp_run)["distributed"]["shard_bytes"])
    weights = [size for label, size in lines.items()
               if "trained weights (" in label and "sharded over 2" in label]
    assert len(weights) == 2 and sum(weights) == shard  # the UNet's and the text encoder's
    assert lines["gradients of the trained weights, sharded over 2 processes"] == shard
    assert not any("DistributedDataParallel" in label for label in lines)
    assert lines["optimizer state (AdamW: 2 copies of each weight), sharded over 2 processes"]
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing divided
    whole = dict(plan_memory(config, model, distributed=False).lines)
    assert whole["gradients of the trained weights"] > 1.9 * shard


@pytest.mark.timeout(600)
def test_sharded_gradients_and_compile_equal_one_process(failing_ranks):
    """tests/train/fsdp_worker.py on 2 ranks (before the failing run of `failing_ranks`, in
    the same processes): clip_sharded_gradients over DTensor shards gives the norm and the
    clipped gradients of the unsharded module, and the tiny UNet's two REGIONAL block classes
    compiled after sharding make the same graphs as unsharded, with no graph break and nothing
    new on the second pass."""
    ranks, _, _ = failing_ranks
    lines = [line for line in ranks[0].stdout.splitlines()
             if line.startswith("sharding checks: ")]
    assert len(lines) == 1, ranks[0].stderr[-3000:]
    found = json.loads(lines[0].removeprefix("sharding checks: "))
    assert found["norm"] == pytest.approx(found["reference"], rel=1e-6)
    assert found["norm"] > 0.01  # so the clipping scaled every gradient
    assert found["max_clipped_difference"] <= 1e-7
    assert found["sharded_blocks"] == 2
    assert found["local_bytes"] < found["whole_bytes"]
    sharded, unsharded = found["compile_sharded"], found["compile_unsharded"]
    assert sharded == unsharded
    assert sharded["graphs"] == 2  # one per block class: no break splits a block
    assert sharded["graph_breaks"] == 0 and sharded["graphs_after_first_pass"] == 0


class OtherRankSaw:
    """Ranks where another rank answered yes (its `any` / `any_of` are the all-reduce)."""
    sharded = enabled = True

    def __init__(self) -> None:
        self.asked: list[tuple[bool, ...]] = []

    def any(self, flag: bool) -> bool:
        self.asked.append((flag,))
        return True

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        self.asked.append(flags)
        return tuple(True for _ in flags)


def test_a_stop_one_rank_saw_while_sampling_is_every_ranks():
    """Under FSDP every rank draws the samples: Stop between denoising steps is agreed over
    the ranks (one rank leaving a sharded forward would hang the others)."""
    from modules.train.outputs.writes import agreed_stop
    run = SimpleNamespace(dist=OtherRankSaw())
    assert agreed_stop(run, lambda: False)() is True and run.dist.asked == [(False,)]
    run.dist.sharded = False  # one process or DDP: rank 0 alone samples, nothing is agreed
    assert agreed_stop(run, lambda: False)() is False and run.dist.asked == [(False,)]


@pytest.mark.parametrize("sharded", [True, False])
def test_sample_and_save_now_one_rank_took_are_every_ranks_on_the_same_step(sharded):
    """"Sample now" and "Save now" make every rank act (FSDP: all draw, all gather the
    weights; DDP: all wait for rank 0's write), so several processes agree on them with one
    all-reduce of both flags where they look for Stop (every STOP_CHECK_EVERY_STEPS steps);
    a request waits there untaken. One process takes them after every step."""
    from modules.events import TrainerCommands
    from modules.train.outputs.writes import agreed_requests, sample_due
    from modules.train.state.run import Run
    commands = TrainerCommands()
    dist = OtherRankSaw()
    dist.sharded = sharded
    run = SimpleNamespace(dist=dist, step=Run.STOP_CHECK_EVERY_STEPS + 1, config=Config(),
                          STOP_CHECK_EVERY_STEPS=Run.STOP_CHECK_EVERY_STEPS)
    commands.request_save()
    assert agreed_requests(run, commands) == (False, False) and dist.asked == []
    run.step = 2 * Run.STOP_CHECK_EVERY_STEPS  # where Stop is looked at: the save asked above
    assert agreed_requests(run, commands) == (True, True)  # another rank asked to sample
    assert dist.asked == [(False, True)]
    assert sample_due(run, True) and not sample_due(run, False)  # no collective of its own
    assert dist.asked == [(False, True)]
    dist.enabled = False  # one process: taken after every step, nothing agreed
    run.step = 3
    commands.request_sample()
    assert agreed_requests(run, commands) == (True, False)
    assert agreed_requests(run, commands) == (False, False) and dist.asked == [(False, True)]


class RankZeroSaid(Distributed):
    """Rank `rank` of 2 whose broadcast hands out `said` as rank 0's value (rank 0 keeps its
    own, as `broadcast_object_list` leaves it)."""

    def __init__(self, rank: int, said: object = None) -> None:
        super().__init__(rank=rank, world_size=2)
        self.said, self.sent = said, []

    def from_main(self, value: object) -> object:
        self.sent.append(value)
        return value if self.is_main else self.said


def test_a_failed_write_of_rank_0_is_raised_by_every_rank_with_its_message(tmp_path):
    """`agreed_write`: rank 0 writes and broadcasts how it went; each rank raises the same
    error (a full disk stays DiskFull); the other ranks never run the write. One process:
    the write's own exception, unchanged."""
    from modules.train.outputs.main_writes import WriteFailed, agreed_write
    from modules.util.disk import DiskFull
    target = tmp_path / "samples"
    target.write_text("a file where the folder must go")

    def write() -> None:
        (target / "step-000001-0.png").write_bytes(b"png")

    main = RankZeroSaid(0)
    with pytest.raises(WriteFailed) as failed:
        agreed_write(main, "the samples of step 1", write)
    message = str(failed.value)
    assert message.startswith("rank 0 could not write the samples of step 1 (NotADirectoryError")
    assert str(target) in message and isinstance(failed.value.__cause__, NotADirectoryError)
    assert main.sent == [(message, False)]
    other = RankZeroSaid(1, said=(message, False))
    with pytest.raises(WriteFailed, match="NotADirectoryError"):
        agreed_write(other, "the samples of step 1", lambda: pytest.fail("rank 1 wrote"))
    assert other.sent == [None]
    with pytest.raises(DiskFull, match="no space"):
        agreed_write(RankZeroSaid(1, said=("rank 0 could not write x (DiskFull: no space)",
                                           True)), "x", lambda: None)
    assert agreed_write(RankZeroSaid(0), "x", lambda: 7) == 7  # a write that went well
    assert agreed_write(RankZeroSaid(1), "x", lambda: 7) is None
    with pytest.raises(NotADirectoryError):  # one process: nothing wrapped, nothing sent
        agreed_write(Distributed(), "x", write)


def fsdp(*overrides: str) -> Config:
    return apply_overrides(Config(), ["training.distributed_strategy=FSDP",
                                      "sampling.prompts=[]", *overrides])


@pytest.mark.parametrize("overrides, expected, fix", [
    ((), "DDP with training.method LORA", "training.method=FINE_TUNE"),
    (("training.method=FINE_TUNE", "training.ema=true"), "DDP with training.ema",
     "turn training.ema off"),
    (("training.method=FINE_TUNE", "training.mixed_precision=FP16"),
     "DDP with training.mixed_precision FP16", "use BF16"),
])
def test_fsdp_refuses_what_it_cannot_combine_with(overrides, expected, fix):
    problems = [p for p in validate(fsdp(*overrides))
                if p.path == "training.distributed_strategy"]
    assert [p.expected for p in problems] == [expected]
    assert fix in problems[0].message


def test_lora_adapters_are_refused_with_why_ddp_fits_them():
    for adapter in ("LOKR", "LOHA"):
        [problem] = [p for p in validate(fsdp(f"training.adapter={adapter}"))
                     if p.path == "training.distributed_strategy"]
        assert f"{adapter} adapters are small" in problem.message
        assert "DDP" in problem.message


def test_textual_inversion_is_refused_with_why_ddp_fits_it():
    [problem] = [p for p in validate(fsdp("training.method=TEXTUAL_INVERSION"))
                 if p.path == "training.distributed_strategy"]
    assert "rows of the token embedding" in problem.message and "DDP" in problem.message


@pytest.mark.parametrize("optimizer, why", [
    ("ADAFACTOR", "whole rows and columns"), ("CAME", "whole rows and columns"),
    ("PRODIGY", "sums over every weight"), ("LION", "not been tested")])
def test_optimizers_that_cannot_step_a_shard_are_refused_with_why(optimizer, why):
    """A backup keeps the optimizer's state as one process's (modules/train/state/
    sharded_state.py); a factored or whole-model statistic computed on a shard would be wrong
    before it was ever saved. Only the optimizers marked in the table pass."""
    [problem] = [p for p in validate(fsdp("training.method=FINE_TUNE",
                                          f"training.optimizer={optimizer}"))
                 if p.path == "training.optimizer"]
    assert problem.given == optimizer and problem.expected == "ADAMW with FSDP"
    assert why in problem.message and "training.distributed_strategy=DDP" in problem.message


def test_a_fine_tune_under_fsdp_validates_with_samples_validation_and_resume():
    for resume in ("", "latest"):  # FSDP runs write backups and resume from them
        config = fsdp("training.method=FINE_TUNE", "sampling.prompts=[\"a red circle\"]",
                      "validation.every_steps=5", f"training.resume_from={resume}")
        assert not [p for p in validate(config) if p.path == "training.distributed_strategy"]


def test_fsdp_in_one_process_warns_that_it_does_nothing(monkeypatch):
    config = fsdp("training.method=FINE_TUNE")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    [warning] = [w for w in config_warnings(config) if "distributed_strategy" in w]
    assert "not used: this is one process" in warning and "torchrun" in warning
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not [w for w in config_warnings(config) if "distributed_strategy" in w]
    assert not [w for w in config_warnings(fsdp("training.distributed_strategy=DDP"))
                if "distributed_strategy" in w]


class RanksAgree(Distributed):
    """Rank 1 of 2 under FSDP whose `any` answers as if another rank's flag were set."""

    def __init__(self, strategy: DistributedStrategy) -> None:
        super().__init__(rank=1, world_size=2, strategy=strategy)
        self.asked: list[bool] = []

    def any(self, flag: bool) -> bool:
        self.asked.append(flag)
        return True


def backup_timing_run(dist: Distributed, minutes: float) -> SimpleNamespace:
    """What `backup_due` reads of a run: step 3 of 10, the last backup just now."""
    return SimpleNamespace(config=apply_overrides(Config(), [
        "output.backup_every_steps=0", f"output.backup_every_minutes={minutes}"]),
        step=3, budget=SimpleNamespace(total_steps=10), state=SimpleNamespace(bad_steps=0),
        last_backup_time=time.monotonic(), dist=dist)


def test_a_timed_backup_is_due_on_every_rank_when_one_ranks_clock_says_so():
    """Every rank takes part in a backup (FSDP: gathering it; DDP too: agreeing on how rank
    0's write went), so the minutes are agreed on (any rank's elapsed interval makes it due
    everywhere); without a timed schedule nothing is asked."""
    from modules.train.recipe.loop import backup_due
    for strategy in DistributedStrategy:
        ranks = RanksAgree(strategy)
        assert backup_due(backup_timing_run(ranks, 30)) and ranks.asked == [False]
        assert not backup_due(backup_timing_run(ranks, 0)) and ranks.asked == [False]


def test_no_backup_after_a_failure_under_fsdp(tmp_path):
    """A failed rank may not join the gathering a backup needs: none is tried, and the message
    and run.json say why."""
    from modules.train.outputs.record import RunRecord
    from modules.train.trainer import backup_after_failure

    class Recipe:
        def save_backup(self, reason: str):
            raise AssertionError("a backup under FSDP after a failure would wait forever")

    dist = Distributed(rank=0, world_size=2, strategy=DistributedStrategy.FSDP)
    record = RunRecord(tmp_path / "run.json")
    recipe = Recipe()
    recipe.built_run = SimpleNamespace(dist=dist, step=3, output_dir=tmp_path, optimizer=None,
                                       record=record)
    message = backup_after_failure(recipe, RuntimeError("a step failed"))
    assert "no backup after the failure (FSDP" in message and "nothing to resume" in message
    assert "gathers every process's shards" in record_of(tmp_path)["backup_after_failure"]


# ---------------------------------------------------------------- FSDP as a memory lever
def fine_tune(tiny_config, *overrides: str):
    from modules.models.tiny import ensure_builtin_model
    config = tiny_config("training.method=FINE_TUNE", *overrides)
    return config, ensure_builtin_model("builtin:tiny-sd15", config.general.cache_dir)


def gpus_visible(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def sharded_total(config, path, monkeypatch, processes: int) -> int:
    """The plan of the same run under FSDP over `processes` launched processes."""
    from modules.train.memory.memory_plan import plan_memory
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    total = plan_memory(apply_overrides(config, ["training.distributed_strategy=FSDP"]), path,
                        distributed=True).total
    monkeypatch.delenv("WORLD_SIZE")
    return total


def test_the_refusal_and_check_offer_fsdp_over_the_visible_gpus(tiny_config, monkeypatch):
    """One process that sees 2 GPUs: the refusal and `--check` offer FSDP launched as 2
    processes, with what the plan of that run saves per process; with one GPU visible it is
    not offered, and `--check` says what two would save. About 6 s: the refusal weighs every
    candidate fix (a weightless plan each), twice."""
    from modules.train.memory import memory_check
    from modules.train.memory.memory_plan import gib, plan_memory
    config, path = fine_tune(tiny_config)
    plan = plan_memory(config, path)
    saved = plan.total - sharded_total(config, path, monkeypatch, 2)
    gpus_visible(monkeypatch, 2)
    fix = ("training.distributed_strategy=FSDP (launched as 2 processes, one per visible GPU: "
           "accelerate launch --num_processes 2)")
    fixes = dict(memory_check.memory_fixes(config, path, plan))
    assert fixes[fix] == saved > 0
    line = memory_check.fsdp_state(config, path, plan, fixes, False)  # `--check`'s FSDP line
    assert line.startswith(f"off; --set {fix} saves {gib(saved)} per process")
    assert "reduce-scattered" in line
    monkeypatch.setattr(memory_check, "card_memory", lambda device: memory_check.CardMemory(
        "Test GPU", 2 ** 20, 2 ** 20))
    with pytest.raises(ConfigError) as caught:
        memory_check.check_memory(config, path, torch.device("cpu"))
    assert f"--set {fix} saves {gib(saved)}" in str(caught.value)

    gpus_visible(monkeypatch, 1)  # nothing to shard over: told, not offered
    with pytest.raises(ConfigError) as caught:
        memory_check.check_memory(config, path, torch.device("cpu"))
    assert "FSDP" not in str(caught.value)
    line = memory_check.fsdp_state(config, path, plan, {}, False)
    assert line.startswith("off; needs several GPUs, and one GPU is visible here")
    assert f"each would need {gib(saved)} less" in line


def test_fsdp_over_a_launch_of_several_processes(tiny_config, monkeypatch):
    """Launched as 3 DDP processes: FSDP over this launch's 3 (the plan also drops DDP's
    gradient buckets), named as such."""
    from modules.train.memory import memory_check
    from modules.train.memory.memory_plan import plan_memory, weightless_trainable
    config, path = fine_tune(tiny_config)
    sharded = sharded_total(config, path, monkeypatch, 3)
    monkeypatch.setenv("WORLD_SIZE", "3")
    plan = plan_memory(config, path, distributed=True)
    assert memory_check.fsdp_processes(True) == 3
    saved = memory_check.fsdp_saving(config, plan, weightless_trainable(config, path), 3)
    assert saved == plan.total - sharded > 0
    assert memory_check.fsdp_fix(3, True) == ("training.distributed_strategy=FSDP (sharded "
                                              "over this launch's 3 processes)")


@pytest.mark.parametrize("overrides, state", [
    (("training.method=LORA",), "not for this run: full fine-tunes only"),
    (("training.ema=true",), "not for this run: the EMA keeps a whole copy"),  # FSDP: no EMA
    (("training.distributed_strategy=FSDP",), "on"),
])
def test_fsdp_is_not_offered_where_it_does_not_apply(tiny_config, overrides, state):
    from modules.train.memory import memory_check
    from modules.train.memory.memory_plan import MemoryPlan
    config, path = fine_tune(tiny_config, *overrides)
    assert memory_check.fsdp_candidate(config) is None
    assert memory_check.fsdp_state(config, path, MemoryPlan(()), {}, False).startswith(state)
