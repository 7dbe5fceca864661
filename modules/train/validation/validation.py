"""Validation: the held-out images (train/validation/validation_set.py) scored with the training loss,
every `validation.every_steps` steps and at the end of a finished run.

Comparable from step to step: each image has its own noise (and VAE posterior sample), drawn
once from a generator seeded by (training.seed, image), and is scored at the same evenly
spaced timesteps every pass, without caption dropout and with a center crop. The score is the
mean of `forward_loss` (the function the training step differentiates) over images and
timesteps, taken of the weights that are saved (the EMA's or schedule-free AdamW's averaged
weights when those are on), with every module in eval mode and no gradients.

Compile: validation runs with compiled code bypassed (eager), as sampling does. Running it
through the compiled denoiser would compile another graph (grad mode, eval mode and the batch
size are guarded), or with CUDA graphs record another tree; eager costs a slower forward for
a few images and never touches the training graphs. run.json says so.

Nothing validation does changes training: its generators are its own, the live weights come
back bit for bit, and its history is part of the training state a backup holds, so a resumed
run continues the same history.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import torch

from modules.train.recipe.placement import borrowed
from modules.data.buckets import assign_buckets
from modules.data.dataset import ImageCaptionDataset, collate_examples
from modules.data.seeds import derive_seed
from modules.events import ValidationScore
from modules.train.outputs.best_weights import keep_if_best
from modules.train.recipe.builders import Draws, autocast_context, draw_randomness, latent_shape
from modules.train.outputs.writes import averaged_weights
from modules.train.state.run import Run
from modules.train.recipe.step_inputs import encode_latents  # the training step's own encoder
from modules.train.validation.validation_set import Validator

LossFn = Callable[[Run, dict, Draws], torch.Tensor]  # recipe.forward_loss
COMPILE_NOTE = ("eager: compiled code is bypassed while validating, so the training graphs "
                "are never recompiled (validation's forwards run uncompiled)")


def validator_of(run: Run) -> Validator:
    """The run's validation set; what follows runs only when validation is on."""
    if run.validator is None:
        raise RuntimeError("validation is off in this run (no validation images)")
    return run.validator


def fixed_timesteps(count: int, train_timesteps: int, low: int = 0,
                    high: int | None = None) -> list[int]:
    """`count` evenly spaced timesteps: the middles of `count` equal parts of the timesteps
    training draws from, [low, high) within the schedule (4 of 1000: 125, 375, 625, 875)."""
    high = train_timesteps if high is None else min(high, train_timesteps)
    return [min(high - 1, low + int((k + 0.5) * (high - low) / count)) for k in range(count)]


def run_timesteps(run: Run) -> list[int]:
    """The run's fixed validation timesteps, inside its loss.min/max_timestep range."""
    loss = run.config.loss
    return fixed_timesteps(validator_of(run).timestep_count,
                           run.family.objective.train_timesteps(run.bundle),
                           loss.min_timestep, loss.max_timestep)


def validation_due(run: Run) -> bool:
    """A scheduled pass is due after this step."""
    every = run.config.validation.every_steps
    return run.validator is not None and bool(every) and run.step % every == 0


def last_validated_step(run: Run) -> int | None:
    history = run.state.validation
    return history[-1][0] if history else None


def best_point(history: list[list]) -> tuple[int | None, float | None]:
    """(step, loss) of the lowest finite loss; the earliest step on a tie."""
    finite = [(loss, step) for step, loss in history if loss is not None]
    if not finite:
        return None, None
    loss, step = min(finite)
    return step, loss


def validation_record(run: Run) -> dict:
    """run.json's `validation` section, from the training state's history."""
    validator = validator_of(run)
    step, loss = best_point(run.state.validation)
    return {"every_steps": run.config.validation.every_steps, "images": validator.count,
            "origin": validator.images.origin,
            "timesteps": run_timesteps(run),
            "compile": COMPILE_NOTE,
            "history": [list(point) for point in run.state.validation],
            "best": None if step is None else {"step": step, "loss": loss}}


def validation_pass(run: Run, loss_fn: LossFn,
                    should_stop: Callable[[], bool] = lambda: False) -> float | None:
    """Score the validation images now; record it in the history, run.json, TensorBoard and
    the front end (the main process), and say it in the status line. Returns the loss.

    `should_stop` (Stop) is asked before each forward (a batch at one timestep), as sampling
    asks between denoising steps: a pass cut short is not a score, so it is left out of the
    history and run.json says how much of it was done (`validation.cut_short`)."""
    validator = validator_of(run)  # validation_due / the end of a finished run ask first
    if run.dist.is_main:
        run.callbacks.on_status(f"validating at step {run.step} ({validator.count} images "
                                f"at {validator.timestep_count} timesteps)")
    started = time.perf_counter()
    # Several processes finish the pass: a forward one of them skipped could leave the
    # others waiting in a collective.
    loss, done = score(run, loss_fn, should_stop if not run.dist.enabled else lambda: False)
    if done.scored < done.total:
        cut_short(run, done)
        return None
    loss, ranks = agreed_loss(run, loss)
    seconds = time.perf_counter() - started  # the first pass also loads and encodes the images
    validator.last_seconds = seconds
    run.state.validation.append([run.step, loss])
    if not run.dist.is_main:  # best/: every rank takes part (FSDP gathers the weights,
        keep_if_best(run)     # and rank 0's write is agreed by all)
        return loss
    best_step, best_loss = best_point(run.state.validation)
    ranks_scored = {"last_pass_ranks": ranks} if run.dist.enabled else {}
    run.record.write(validation={**validation_record(run), **ranks_scored,
                                 "last_pass_seconds": round(seconds, 3)})
    if run.writer and loss is not None:
        run.writer.add_scalar("validation/loss", loss, run.step)
    run.callbacks.on_validation(ValidationScore(run.step, loss, best_step, best_loss,
                                                validator.count))
    shown = "not finite" if loss is None else f"{loss:.5f}"
    best = "none finite" if best_step is None else f"step {best_step}"
    run.callbacks.on_status(f"validation loss {shown} at step {run.step} (best: {best})")
    keep_if_best(run)  # validation.save_best: best/ follows the history's best
    return loss


def agreed_loss(run: Run, loss: float | None) -> tuple[float | None, list[float | None]]:
    """Several processes: rank 0's score on every rank, and each rank's own (one collective
    per pass; run.json's `validation.last_pass_ranks`).

    Every rank scores the whole validation set (not a share of it): under FSDP each forward
    is a collective every rank must run, and a share would leave a rank with fewer images
    (or none) waiting in a forward the others never make; scoring it whole also keeps the
    score the one a single process gets, whatever the number of processes. The ranks hold
    the same weights and inputs, so their scores agree; taking rank 0's makes the history
    (and best/, which all ranks decide on under FSDP) the same on every rank even where a
    device's kernels are not bit-reproducible."""
    if not run.dist.enabled:
        return loss, [loss]
    scores = [_finite(value) for value in run.dist.gather(math.nan if loss is None else loss)]
    return scores[0], scores


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class PassDone:
    """How much of a validation pass was scored: forwards (a batch at one timestep)."""
    scored: int
    total: int


def score(run: Run, loss_fn: LossFn, should_stop: Callable[[], bool] = lambda: False
          ) -> tuple[float | None, PassDone]:
    """The mean loss over the validation images at the fixed timesteps (None if not finite),
    and how many of the pass's forwards were scored (all, unless `should_stop` said stop
    before one); one host sync for the whole pass."""
    validator = validator_of(run)
    timesteps = run_timesteps(run)
    total = torch.zeros((), dtype=torch.float64, device=run.device)
    count = scored = 0
    with torch.no_grad(), run.outside_training(), eval_mode(run), averaged_weights(run):
        if validator.batches is None:  # a VAE kept on the CPU (placement.py) encodes them
            with borrowed({"vae": run.bundle.vae}, run.device):
                validator.batches = fixed_batches(run, validator)
        forwards = len(validator.batches) * len(timesteps)
        for batch, draws in validator.batches:
            size = len(batch["caption"])
            for t in timesteps:
                if should_stop():
                    return None, PassDone(scored, forwards)
                at_t = dataclasses.replace(draws, timesteps=torch.full((size,), t,
                                                                        dtype=torch.long))
                total += loss_fn(run, batch, at_t).double() * size
                count += size
                scored += 1
    value = float(total / count)  # the pass's one host sync
    return (value if math.isfinite(value) else None), PassDone(scored, forwards)


def cut_short(run: Run, done: PassDone) -> None:
    """A pass Stop cut short: said, and recorded in run.json (not in the history: a part of
    the images is not a score comparable with the others)."""
    if not run.dist.is_main:
        return
    run.record.write(validation={**validation_record(run), "cut_short": {
        "step": run.step, "forwards_scored": done.scored, "forwards": done.total}})
    run.callbacks.on_status(f"validation at step {run.step} cut short by Stop ({done.scored} "
                            f"of {done.total} batches scored, each a batch of images at one "
                            "timestep); not recorded as a score")


@contextlib.contextmanager
def eval_mode(run: Run):
    """Every component in eval mode (no dropout), and back to its own mode afterwards."""
    modes = {name: m.training for name, m in run.bundle.components().items()}
    for module in run.bundle.components().values():
        module.eval()
    try:
        yield
    finally:
        for name, module in run.bundle.components().items():
            module.train(modes[name])


def fixed_batches(run: Run, validator: Validator) -> list[tuple[dict, Draws]]:
    """The validation batches, once: images of one size together (aspect buckets), each
    image's draws from its own generator, the latents encoded with its fixed VAE sample and
    kept on the CPU (the VAE is never trained, so they do not change)."""
    config = run.config
    items = list(validator.images.items)
    sizes = (assign_buckets(items, config.data.resolution, config.data.bucket_max_aspect)
             if config.data.aspect_buckets else None)
    dataset = ImageCaptionDataset(items, resolution=config.data.resolution, center_crop=True,
                                  random_flip=False, seed=config.training.seed,
                                  target_sizes=sizes, caption_rules=validator.images.rules,
                                  masked_loss=config.data.masked_loss)
    by_size: dict[tuple[int, int], list[int]] = {}
    for index, size in enumerate(dataset.target_sizes):
        by_size.setdefault(size, []).append(index)
    batches = []
    for indices in by_size.values():
        for start in range(0, len(indices), validator.batch_size):
            chunk = indices[start:start + validator.batch_size]
            batch = collate_examples([dataset[i] for i in chunk])
            draws = image_draws(run, validator.seed, chunk, run.pixel_shape(batch))
            batches.append((latent_batch(run, batch, draws), draws))
    return batches


def image_draws(run: Run, seed: int, indices: list[int],
                pixel_shape: tuple[int, int, int]) -> Draws:
    """The batch's draws, each image's from a generator of its own (so the score does not
    depend on the validation batch size), captions never dropped."""
    _, height, width = pixel_shape
    shape = latent_shape(run.bundle.vae, 1, height, width)
    steps = run.family.objective.train_timesteps(run.bundle)
    # No loss options: input perturbation and pyramid noise are training-time augmentations,
    # and the score is of the model, made with the plain noise (and the noise offset).
    singles = [draw_randomness(torch.Generator("cpu").manual_seed(
        derive_seed("validation", seed, index)), shape, (0, steps), need_vae_eps=True)
        for index in indices]
    joined = {f.name: join_draws([getattr(d, f.name) for d in singles])
              for f in dataclasses.fields(Draws)}
    joined["caption_dropout"] = torch.ones(len(indices))  # never under a dropout probability
    return Draws(**joined)


def join_draws(values: list):
    """One field of several images' draws along the batch: None and () (an option that is
    off, such as the pyramid noise's levels) stay as they are."""
    first = values[0]
    if first is None or (isinstance(first, tuple) and not first):
        return first
    return torch.cat(values)


def latent_batch(run: Run, batch: dict, draws: Draws) -> dict:
    """`batch` with its pixels encoded into latents (on the CPU), as the training step would
    encode them with these draws: a posterior sample, or with `data.cache_latents` (training
    then reads cached posterior means) the mean."""
    eps = draws.vae_eps
    assert eps is not None  # image_draws draws it for every image
    if run.config.data.cache_latents:
        eps = torch.zeros_like(eps)
    with autocast_context(run.config, run.device):
        latents = encode_latents(run, batch, eps)
    kept = {k: v for k, v in batch.items() if k != "pixel_values"}
    return {**kept, "latents": latents.cpu()}
