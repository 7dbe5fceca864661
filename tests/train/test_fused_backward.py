"""The fused backward pass (training.fused_backward, issue 46 item 4): each weight's optimizer
steps inside backward and its gradient is freed; what it refuses, what it decides (per-weight
clipping, per-weight NaN guard, the run's LR schedule), exact resume and compile."""
from __future__ import annotations

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.problems import ConfigError
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.train.recipe import fused
from modules.train.recipe.fused import FusedBackward, fused_record
from modules.train.setup.prepare import check_run
from modules.train.trainer import train
from tests.train.test_resume import (assert_resumed_as, final_tensors, run_json,
                                     stop_then_resume)

FUSED = ("training.method=FINE_TUNE", "training.fused_backward=true")
# a schedule whose rate changes every step, no clipping: the fused run must equal the plain one
SCHEDULE = ("training.lr_scheduler=LINEAR", "training.lr_warmup_steps=1",
            "training.max_grad_norm=0", "training.learning_rate=1e-4")


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory):
    """The shared 3-step runs on the tiny model: fused under REGIONAL AOT_EAGER (dynamo's
    counters cleared before it, the rates each weight's optimizer took recorded), the same
    stopped at step 2 and resumed, and the plain optimizer step eager. Over 10 s in all: four
    short trainings, three compiled (about 20 s on 2 quiet cores, the tiny model build
    included)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    root = tmp_path_factory.mktemp("fused")

    def config(name: str, *settings: str):
        return apply_overrides(Config(), [
            f"general.cache_dir={tempera_cache}", f"output.dir={root / name}",
            "data.resolution=64", "training.max_steps=3", "training.batch_size=2",
            "sampling.prompts=[]", "logging.tensorboard=false", *SCHEDULE, *settings])

    applied: list[float] = []  # the rate each per-weight optimizer took, in order
    real_set_lr = fused.set_lr

    def recording_set_lr(optimizer, lr):
        applied.append(lr)
        real_set_lr(optimizer, lr)

    compiled = (*FUSED, "compile.backend=AOT_EAGER", "compile.scope=REGIONAL",
                "compile.denoiser=true")
    torch._dynamo.reset()
    counters.clear()
    fused.set_lr = recording_set_lr
    try:
        progress = RecordingCallbacks()
        train(config("fused", *compiled), progress)
        breaks, recompiles = dict(counters["graph_break"]), dict(counters["recompiles"])
    finally:
        fused.set_lr = real_set_lr
    try:
        stop_then_resume(config("resumed", *compiled), at=2)
    finally:
        torch._dynamo.reset()
    train(config("plain", "training.method=FINE_TUNE"), RecordingCallbacks())
    return root, applied, progress.progress, breaks, recompiles


def test_fused_run_equals_the_plain_optimizer_step(runs):
    """Per-weight AdamW inside backward is the same maths as one AdamW after it: same losses,
    same final weights (to float32 rounding of the fused kernels and the compiled blocks)."""
    root, *_ = runs
    fused_run, plain = run_json(root / "fused"), run_json(root / "plain")
    assert fused_run["fused_backward"]["on"] and "fused_backward" not in plain
    assert fused_run["fused_backward"]["stochastic_rounding"] is False
    assert fused_run["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    want, have = final_tensors(root / "plain"), final_tensors(root / "fused")
    assert want.keys() == have.keys() and want
    for key in want:
        assert torch.allclose(want[key], have[key], rtol=1e-4, atol=1e-6), key


def test_each_weight_follows_the_runs_learning_rate(runs):
    """The rate each per-weight optimizer applied at steps 2 and 3 is the schedule's (the
    rate progress reported after steps 1 and 2), and it changed between them."""
    _, applied, progress, _, _ = runs
    weights = len(applied) // 3
    assert weights and len(applied) == 3 * weights
    per_step = [set(applied[i * weights:(i + 1) * weights]) for i in range(3)]
    assert all(len(rates) == 1 for rates in per_step), per_step
    step2, step3 = per_step[1].pop(), per_step[2].pop()
    assert step2 == pytest.approx(progress[0].lr) and step3 == pytest.approx(progress[1].lr)
    assert step2 != step3


def test_fused_run_resumes_bit_for_bit(runs):
    root, *_ = runs
    whole, parts = run_json(root / "fused"), run_json(root / "resumed")
    assert parts["losses"] == whole["losses"] and parts["resume_count"] == 1
    want, have = final_tensors(root / "fused"), final_tensors(root / "resumed")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)


def test_hooks_add_no_graph_break_or_recompile_under_regional_aot_eager(runs):
    root, _, _, breaks, recompiles = runs
    report = run_json(root / "fused")["compile"]["unet"]
    assert report["effective"] == "AOT_EAGER" and report["scope"] == "REGIONAL", report
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert breaks == {} and recompiles == {}, (breaks, recompiles)
    # dynamo (torch 2.13) no longer counts recompiles in counters["recompiles"]: the compile
    # engine's own count is the check that can fail (none at steps 2 and 3)
    assert report["late_recompiles"] == 0, report
    assert len(run_json(root / "fused")["losses"]) == 3


# ------------------------------------------------------------------ bfloat16, stochastic rounding
BF16 = (*FUSED, "model.train_dtype=BFLOAT16")


def torchao_steps_compiled() -> int:
    """How many variants of torchao's per-weight AdamW step dynamo holds: torchao compiles it
    (inductor, fullgraph, dynamic=False) once per weight shape it meets."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torchao.optim.adam import single_param_adam

    return len(_debug_get_cache_entry_list(single_param_adam.__code__))


class CountCompiledSteps(RecordingCallbacks):
    """Records, after each optimizer step, how many torchao step variants are compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[int] = []

    def on_progress(self, progress) -> None:
        super().on_progress(progress)
        self.compiled.append(torchao_steps_compiled())


@pytest.fixture(scope="module")
def bf16_runs(tempera_cache, tmp_path_factory):
    """bfloat16 weights, fused pass with stochastic rounding, REGIONAL AOT_EAGER: 2 steps
    unbroken (dynamo's counters cleared before it), and the same stopped at step 1 and
    resumed; then the rounding's draws, on one weight. Over 10 s: torchao compiles its
    per-weight AdamW step with inductor once per weight shape (16 shapes in the tiny UNet:
    about 35 s of CPU, cold); the stopped and resumed runs reuse those compiles (no dynamo reset
    between the runs)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    root = tmp_path_factory.mktemp("fused-bf16")

    def config(name: str):
        return apply_overrides(Config(), [
            f"general.cache_dir={tempera_cache}", f"output.dir={root / name}",
            "data.resolution=64", "training.max_steps=2", "training.batch_size=2",
            "sampling.prompts=[]", "logging.tensorboard=false", *SCHEDULE, *BF16,
            "compile.backend=AOT_EAGER", "compile.scope=REGIONAL", "compile.denoiser=true"])

    torch._dynamo.reset()
    counters.clear()
    try:
        progress = CountCompiledSteps()
        train(config("whole"), progress)
        breaks = dict(counters["graph_break"])
        stop_then_resume(config("parts"), at=1)
        draws = rounding_draws()
    finally:
        torch._dynamo.reset()
    return root, progress.compiled, breaks, draws


def rounding_draws() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bfloat16 weight (a shape the runs compiled) stepped three times from the same
    value: twice from the same torch random state, once from another."""
    from torchao.optim import _AdamW

    results = []
    for seed in (1, 1, 2):
        weight = torch.nn.Parameter(torch.full((4, 32, 3, 3), 1.0, dtype=torch.bfloat16))
        weight.grad = torch.full_like(weight, 1e-3)
        optimizer = _AdamW([weight], lr=1e-4, weight_decay=Config().training.weight_decay,
                           bf16_stochastic_round=True)  # the runs' settings: no new compile
        torch.manual_seed(seed)
        optimizer.step()
        results.append(weight.detach().clone())
    return results[0], results[1], results[2]


@pytest.mark.inductor
def test_bf16_stochastic_rounding_resumes_bit_for_bit(bf16_runs):
    """The rounding draws its random numbers from torch's global generator (on CUDA, the
    device's), whose state a backup holds: the run stopped after step 1 and resumed rounds
    step 2 with the draws of the unbroken run, so its weights are the same bit for bit. The
    draws do decide the weights: the same update rounds differently from another state."""
    root, _, _, (first, again, other) = bf16_runs
    record = run_json(root / "whole")["fused_backward"]
    assert record["stochastic_rounding"] is True
    assert record["per_weight_optimizer"] == "torchao.optim._AdamW"
    assert_resumed_as(root / "whole", root / "parts")
    assert torch.equal(first, again) and not torch.equal(first, other)
    # an update of 1e-4 on 1.0 is below bfloat16's spacing there (2**-7): only rounding moves it
    assert first.unique().tolist() != [1.0]


@pytest.mark.inductor
def test_bf16_fused_pass_adds_no_graph_break_or_recompile(bf16_runs, runs):
    """Under REGIONAL AOT_EAGER the stochastic-rounding pass breaks no graph and recompiles
    the UNet's blocks exactly as the float32 fused run does (the blocks' own warm-up, at step
    1); torchao's compiled step is compiled during step 1 only (a per-weight rate set as a
    float, not filled into torchao's tensor, would recompile it at step 2)."""
    root, compiled, breaks, _ = bf16_runs
    fp32_root, *_ = runs
    report = run_json(root / "whole")["compile"]["unet"]
    fp32 = run_json(fp32_root / "fused")["compile"]["unet"]
    assert report["effective"] == "AOT_EAGER" and report["scope"] == "REGIONAL", report
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert breaks == {}, breaks
    assert report["late_recompiles"] == 0 and report["recompiles"] == fp32["recompiles"], (
        report, fp32)
    assert len(compiled) == 2 and compiled[0] > 0 and compiled[1] == compiled[0], compiled


# ------------------------------------------------------------------ the decisions, on one layer
def two_weights():
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))
    return first, second


def test_a_non_finite_gradient_holds_back_only_its_weight():
    """A weight whose gradient is NaN keeps its value and optimizer state; the other steps;
    the step's norm is not finite, so the loop counts it as a non-finite step."""
    first, second = two_weights()
    opt = FusedBackward([{"params": [first, second], "lr": 0.1}],
                        lambda group: torch.optim.AdamW([group]), max_grad_norm=0)
    (first * 2.0).sum().add((second * float("nan")).sum()).backward()
    assert opt.held_back == 1 and not torch.isfinite(opt.gradient_norm())
    assert not torch.equal(first, torch.ones(4)) and torch.equal(second, torch.ones(3))
    assert opt.weights[1][0].state == {} and first.grad is None and second.grad is None
    opt.step()
    assert opt.held_back == 0 and opt.norms == []
    opt.close()


def test_max_grad_norm_clips_each_weight_on_its_own():
    """Each gradient is clipped to max_grad_norm by its own norm; the recorded norm is the
    global one before clipping."""
    first, second = two_weights()
    opt = FusedBackward([{"params": [first, second], "lr": 1.0}],
                        lambda group: torch.optim.SGD([group]), max_grad_norm=1.0)
    (first * 3.0).sum().add((second * 0.1).sum()).backward()
    # first's gradient (3, 3, 3, 3) has norm 6, clipped to 1; second's (norm 0.17) is kept
    assert torch.allclose(first, torch.full((4,), 1 - 0.5), atol=1e-5)
    assert torch.allclose(second, torch.full((3,), 1 - 0.1))
    assert opt.gradient_norm().item() == pytest.approx((36 + 0.03) ** 0.5, rel=1e-5)
    opt.close()


# ------------------------------------------------------------------ refusals
REFUSALS = {
    "lora": (("training.fused_backward=true",), "training.method=FINE_TUNE"),
    "accumulation": ((*FUSED, "training.gradient_accumulation=2"),
                     "training.gradient_accumulation=1"),
    "fp16": ((*FUSED, "training.mixed_precision=FP16"), "training.mixed_precision=BF16"),
    "prodigy": ((*FUSED, "training.optimizer=PRODIGY", "training.learning_rate=1.0"),
                "training.optimizer=ADAMW"),
    "schedule-free": ((*FUSED, "training.optimizer=SCHEDULE_FREE_ADAMW"),
                      "training.optimizer=ADAMW"),
    "bf16-lion": ((*FUSED, "model.train_dtype=BFLOAT16", "training.optimizer=LION"),
                  "model.train_dtype=FLOAT32"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_name_the_field_and_the_fix(tiny_config, case):
    settings, fix = REFUSALS[case]
    problems = [p for p in validate(tiny_config(*settings))
                if p.path == "training.fused_backward"]
    assert len(problems) == 1, problems
    assert fix in problems[0].message and "training.fused_backward=false" in problems[0].message


def test_accepted_combinations_validate(tiny_config):
    for settings in (FUSED, (*FUSED, "model.train_dtype=BFLOAT16"),
                     (*FUSED, "training.optimizer=LION", "training.ema=true")):
        assert not [p for p in validate(tiny_config(*settings))
                    if p.path == "training.fused_backward"], settings


def test_several_processes_and_cuda_graphs_are_refused_at_start(tiny_config):
    config = tiny_config(*FUSED)
    for world, graphs, fix in ((2, False, "train on one process"),
                               (1, True, "compile.mode DEFAULT")):
        with pytest.raises(ConfigError) as refused:
            fused_record(config, world, graphs)
        assert "training.fused_backward" in str(refused.value) and fix in str(refused.value)
    assert fused_record(config, 1, False)["on"]


# ------------------------------------------------------------------ the memory plan
def test_plan_counts_the_largest_single_gradient_of_the_real_model(tiny_config):
    """Fused, the gradients line is the largest trained weight's gradient (the real tiny
    model's, loaded), and the rest of the plan is unchanged."""
    from tests.train.test_memory_plan import lines, tiny_model

    checked, bundle = tiny_model(tiny_config(*FUSED))
    plain = check_run(tiny_config("training.method=FINE_TUNE"), RecordingCallbacks())
    largest = max(p.numel() * p.element_size() for p in bundle.denoiser.parameters())
    got = lines(checked.memory.plan)
    assert got["gradients, one weight's at a time"] == largest
    assert "gradients of the trained weights" not in got
    unet = lines(plain.memory.plan)["gradients of the trained weights"]
    assert checked.memory.plan.total == plain.memory.plan.total - unet + largest


def test_a_fine_tune_too_big_is_offered_the_fused_pass(tiny_config, monkeypatch):
    from tests.train.test_memory_plan import MIB, fake_card

    config = tiny_config("training.method=FINE_TUNE")
    fake_card(monkeypatch, 1 * MIB)
    with pytest.raises(ConfigError) as caught:
        train(config, RecordingCallbacks())
    assert "--set training.fused_backward=true saves" in str(caught.value)
    # not offered where it cannot combine (gradient accumulation)
    with pytest.raises(ConfigError) as caught:
        train(tiny_config("training.method=FINE_TUNE", "training.gradient_accumulation=2"),
              RecordingCallbacks())
    assert "training.fused_backward" not in str(caught.value)


def test_a_non_finite_loss_skips_backward(monkeypatch):
    """micro_step reads the loss before backward under the fused pass: a NaN loss runs no
    backward, so no weight steps and no gradient is made; a finite one steps them."""
    from types import SimpleNamespace

    from modules.train.recipe import recipe

    first, second = two_weights()
    opt = FusedBackward([{"params": [first, second], "lr": 0.1}],
                        lambda group: torch.optim.AdamW([group]), max_grad_norm=0)
    run = SimpleNamespace(optimizer=opt, scaler=None, offload=None,
                          config=SimpleNamespace(training=SimpleNamespace(
                              gradient_accumulation=1)))
    scale = {"value": float("nan")}
    monkeypatch.setattr(recipe, "forward_loss",
                        lambda run, batch, draws: (first.sum() + second.sum()) * scale["value"])
    loss = recipe.micro_step(run, {}, None)
    assert not torch.isfinite(loss) and opt.norms == [] and opt.held_back == 0
    assert torch.equal(first, torch.ones(4)) and first.grad is None
    scale["value"] = 1.0
    recipe.micro_step(run, {}, None)
    assert len(opt.norms) == 2 and not torch.equal(first, torch.ones(4))
    opt.close()


def test_the_step_after_a_non_finite_one_is_clean():
    """optimizer_step closes a fused step even when it was not finite: the next step's norm
    and held-back count start afresh (a stale NaN norm would skip every later step)."""
    from types import SimpleNamespace

    from modules.train.recipe.recipe import optimizer_step

    first, second = two_weights()
    opt = FusedBackward([{"params": [first, second], "lr": 0.1}],
                        lambda group: torch.optim.AdamW([group]), max_grad_norm=0)
    statuses: list[str] = []
    record = SimpleNamespace(data={}, write=lambda **kw: record.data.update(kw))
    run = SimpleNamespace(optimizer=opt, scaler=None, ema=None, step=0, record=record,
                          lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                          guard=SimpleNamespace(persistent_grads=False),
                          callbacks=SimpleNamespace(on_status=statuses.append))
    (first.sum() + (second * float("nan")).sum()).backward()
    optimizer_step(run, finite=False)
    assert record.data["fused_backward"]["weights_held_back"] == 1
    assert "1 of 2 weights had non-finite gradients" in statuses[0]
    (first.sum() + second.sum()).backward()
    assert torch.isfinite(opt.gradient_norm()) and opt.held_back == 0
    opt.close()


def test_no_backup_after_a_failure_part_way_through_a_fused_step(tmp_path):
    """A failure after some weights of the step in flight were stepped (the fused pass steps
    them inside backward) leaves the weights half a step on: a backup then would be resumed as
    a whole step. None is written, and the message and run.json say why; a failure between
    steps still writes one."""
    import json
    from types import SimpleNamespace

    from modules.train.outputs.record import RunRecord
    from modules.train.recipe.distributed import Distributed
    from modules.train.trainer import backup_after_failure

    weights = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    optimizer = FusedBackward([{"params": weights, "lr": 0.1}],
                              lambda group: torch.optim.SGD(group["params"], lr=group["lr"]),
                              0.0)
    (weights[2] * weights[2]).sum().backward()  # one weight's hook has stepped it

    class Recipe:
        saved: list[str] = []

        def save_backup(self, reason: str, agreed: bool = True) -> None:
            self.saved.append(reason)

    recipe = Recipe()
    recipe.built_run = SimpleNamespace(optimizer=optimizer, dist=Distributed(), step=3,
                                       output_dir=tmp_path, record=RunRecord(tmp_path / "run.json"))
    message = backup_after_failure(recipe, RuntimeError("a step failed"))
    assert recipe.saved == [] and "no backup after the failure" in message
    assert "updated 1 of 3 weights" in message
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["backup_after_failure"].startswith("not written: the fused backward pass")
    optimizer.step()  # the step closed: the weights are whole again
    backup_after_failure(recipe, RuntimeError("sampling failed"))
    assert recipe.saved == ["after a failure"]
    optimizer.close()
