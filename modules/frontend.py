"""What the front ends ask the engine: one module for the GUI (`app/`), the CLI (`modules/cli`)
and cloud runs (`modules/cloud`).

Check a config, start a run, a folder's resume points and how its run ended, explain a
compilation, what a compile is expected to cost: each is a thin delegation to the one function
that decides it (no logic lives here), so a front end names this module instead of the engine's
files. The GUI imports it before torch: what would import torch (the trainer, the compile
engine) is imported inside the function that needs it, and the two names that are not
functions (`TrainingError`, `BACKENDS`) are read through `__getattr__` on first use.

The rule for `app/` (tests/test_layers.py): from `modules/` it imports only this module,
`modules.config` (the config types, loading and saving) and `modules.events` (the trainer
protocol); the Benchmark section and the Cloud tab also import the front ends they show,
`modules.bench` and `modules.cloud`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# Resume points (`list_backups`, `resume_offer`, `finished_run_problem`), how a run ended
# (`read_run_status`), what a fresh start would remove (`previous_run`, `free_sibling`), the
# earlier run a resume continues (`earlier_losses`, `latest_samples`),
# where the caches are (`cache_dir_for`, `compile_cache_folder`), which settings the config
# leaves unused (`unused_fields`, greyed in the GUI) and which a model type allows one value of
# (`only_values`): file-system or config only, re-exported.
from modules.compile.backends import BACKENDS  # the backend rows: torch-free
from modules.config import Config, Problem, validate
# The caption editor's tables, saving and find-and-replace: torch-free.
from modules.data.caption_edit import (CAPTION_STATES, FILTERS, MASK_STATES,
                                       CaptionEditError, save_caption)
from modules.data.caption_replace import apply_replace, plan_replace, undo_replace
# The Data tab's preparation tools (captions, masks): their buttons; a tool's row on first use.
from modules.data.prep.tools import prep_actions, prep_tool
from modules.config.field_rules import RULED_PATHS, only_values, unused_fields
from modules.events import TrainerCallbacks, TrainerCommands
from modules.lora_tools.errors import LoraToolError  # torch-free: the LoRA tools tab's refusals
from modules.model_types import BUILTIN_DEMO, MODEL_TYPES, ModelType
from modules.paths import cache_dir_for, compile_cache_folder
from modules.train.state.backup_files import list_backups
from modules.train.state.earlier_run import (LossPoint, earlier_losses, earlier_validation,
                                             latest_samples)
from modules.train.setup.inputs import check_inputs
from modules.train.outputs.previous_run import PreviousRun, free_sibling, previous_run
from modules.train.outputs.record import read_run_status
from modules.train.state.resume_offer import ResumeOffer, finished_run_problem, resume_offer
from modules.train.recipe.schedules import schedule_curve
from modules.util.atomic import atomic_write_text
from modules.util.duration import format_duration
from modules.util.library_noise import (silence_library_noise,
                                         silence_torchvision_fallback_warnings)

# Names read on first use (`__getattr__`): importing them imports torch.
_LAZY = {"TrainingError": "modules.train.trainer", "TrainingAborted": "modules.train.trainer",
         "COMPONENT_LABELS": "modules.compile.plan", "BundleError": "modules.compile.bundle"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lora_tool(command: str, loras: list[str], **options: Any) -> str:
    """Run one LoRA tool (merge, merge-loras, extract, resize, convert; docs/lora_tools.md)
    and return its report: `modules.lora_tools.operations.run_tool`, the LoRA files given as
    `file[:weight]` texts, `progress(done, total, what)` called after each layer of resize and
    extract. Bad input raises LoraToolError, naming the file or the input (its field key: the
    caller says it in its own words, `LoraToolError.text`)."""
    from modules.lora_tools.operations import parse_lora_arg, run_tool
    return run_tool(command, loras=[parse_lora_arg(text) for text in loras], **options).text()


def final_weights_step(output_dir: Path) -> int | None:
    """The step of the weights in `<output_dir>/final/` (None: nothing saved there, or saved
    without the step marker): `modules.train.state.resume_offer.saved_step`."""
    from modules.train.state.resume_offer import saved_step
    return saved_step(Path(output_dir) / "final")


# --- data ---------------------------------------------------------------------------------
def dataset_preview(config: Config, index: int, draw: int = 0) -> Any:
    """The Data tab's preview of dataset `index`: one caption after its caption rules (draw
    `draw` of the shuffles), and with masked loss its first image with the mask over it
    (modules/data/preview.py; torch-free). A built-in dataset is shown once a run has
    generated it: a preview writes nothing."""
    from modules.data.preview import preview_dataset

    def builtin_folder(path: str):
        from modules.data.shapes import BUILTIN_SHAPES, shapes_dataset_dir
        return (shapes_dataset_dir(cache_dir_for(config.general.cache_dir))
                if path == BUILTIN_SHAPES else None)

    return preview_dataset(config, index, draw, builtin_folder=builtin_folder)


def dataset_folder(config: Config, index: int) -> Path | None:
    """Dataset `index`'s folder: its path, or a built-in dataset's generated folder (None
    until a run has generated it)."""
    path = config.data.datasets[index].path
    if path.startswith("builtin:"):
        from modules.data.shapes import BUILTIN_SHAPES, shapes_dataset_dir
        return (shapes_dataset_dir(cache_dir_for(config.general.cache_dir))
                if path == BUILTIN_SHAPES else None)
    return Path(path) if path.strip() else None


def image_thumbnail(image: Path, mask: Path | None, size: int) -> Any:
    """A `size`-pixel thumbnail of `image` (PIL) with the part its mask leaves out tinted, as
    the dataset preview draws it (modules/data/preview.py). Raises for an unreadable file."""
    from modules.data.preview import mask_overlay
    return mask_overlay(image, mask, size)[0]


def caption_listing(config: Config, index: int, progress: Any = None) -> Any:
    """The caption editor's list of dataset `index`'s images, captions and mask states
    (modules/data/caption_edit.py; imports torch: call it off the Tk thread)."""
    from modules.data.caption_edit import list_captions
    data = config.data
    return list_captions(data.datasets[index], dataset_folder(config, index),
                         data.caption_extension, data.recursive, progress)


# --- check ----------------------------------------------------------------------------------
def check(config: Config) -> list[Problem]:
    """Every problem a start finds before it loads anything: the config's combinations
    (`validate`) and the model, datasets and output folder on disk (`check_inputs`)."""
    from modules.compile.ahead_rules import ahead_problems  # the backends' table: torch-free
    return validate(config) + ahead_problems(config) + check_inputs(config)


def check_run(config: Config, callbacks: TrainerCallbacks) -> Any:
    """Every check a start runs, short of loading the model and training (the CLI's --check):
    a `CheckedRun`, or ConfigError with the problems."""
    from modules.train.setup.prepare import check_run as engine_check_run
    return engine_check_run(config, callbacks)


# --- start ----------------------------------------------------------------------------------
def load_engine() -> None:
    """Import torch and the compile engine now (the GUI does it once its window is shown)."""
    import modules.compile.engine  # noqa: F401 - imported now so torch is loaded before use


def train(config: Config, callbacks: TrainerCallbacks | None = None,
          commands: TrainerCommands | None = None) -> Any:
    """Run the training the config describes (`modules.train.trainer.train`): a `TrainResult`;
    ConfigError before anything is written, TrainingError when the run failed."""
    from modules.train.trainer import train as engine_train
    return engine_train(config, callbacks, commands)


def storage_summaries(config: Config) -> list[str]:
    """The 8-bit storages' one-line summaries on the configured device (what each saves and
    costs, or why this machine cannot run it); imports torch."""
    from modules.train.memory.levers import device_ability, storage_summaries as summaries
    from modules.train.recipe.builders import pick_device
    return summaries(device_ability(pick_device(config.general.device)))


# --- explain, the compile plan and expected compile time ------------------------------------
def machine_capabilities(config: Config) -> Any:
    """What the configured device can compile with (imports torch and triton)."""
    from modules.train.recipe.compile_guard import machine_capabilities as engine_capabilities
    return engine_capabilities(config)


def compile_plans(config: Config, machine: Any = None) -> Any:
    """The compile plan of each component, as training will apply it on `machine` (the one
    plan every front end shows: modules.train.recipe.compile_guard.compile_plans)."""
    from modules.train.recipe.compile_guard import compile_plans as engine_plans
    return engine_plans(config, machine)


def compile_cost(config: Config, machine: Any = None) -> Any:
    """What the batch shapes of several resolutions or aspect buckets cost the compiled
    denoiser, before any image is read: a `CompileCost` counting every bucket each resolution
    allows (an upper bound; `--check` counts what the scan found), or None when batches keep
    one shape or the denoiser is not compiled."""
    from modules.config.data import shapes_vary
    if not shapes_vary(config.data):
        return None
    from modules.train.recipe.compile_guard import denoiser_compile_cost
    return denoiser_compile_cost(config, capabilities=machine)


def explain(config: Config) -> str:
    """What compiling with this config does here, as text (*Check compilation*,
    scripts/explain_compile.py): traces the model once."""
    from modules.train.setup.explain_run import explain_text
    return explain_text(config)


def expected_compile(config: Config) -> Any:
    """What earlier runs with these settings here, and a compile bundle made for them, say
    about this compile (a `CompileExpectation`; None: no record, or nothing compiles)."""
    if config.compile.backend.value == "NONE":
        return None
    from modules.compile.bundle import bundle_cold_seconds
    from modules.train.recipe.builders import pick_device
    from modules.train.state.history import compile_expectation, with_measured
    device = pick_device(config.general.device).type
    return with_measured(compile_expectation(config, device,
                                             bundle_cold_seconds(matching_bundle(config))),
                         config, device)


def matching_bundle(config: Config, machine: Any = None) -> Any:
    """What a run of ``config`` would find of its compile bundle on ``machine`` (a
    `modules.compile.bundle.Lookup`: status hit/miss/mismatch/damaged, path, why), or None
    when bundles are off or nothing compiles with inductor (docs/compilation.md)."""
    from modules.train.recipe.compile_guard import matching_bundle as lookup
    return lookup(config, machine)


def import_bundle(source: str | Path, config: Config) -> Any:
    """Copy a compile bundle file into ``config``'s bundles folder, where runs look; raises
    `BundleError` (naming the file and what is wrong with it) unless it is a whole bundle."""
    from modules.compile.bundle import import_bundle as copy_in
    from modules.train.recipe.compile_guard import bundle_folder
    return copy_in(Path(source), bundle_folder(config))


def export_bundle(source: str | Path, target: str | Path) -> Path:
    """Copy a compile bundle to ``target``, whole or not at all (`BundleError` says why)."""
    from modules.compile.bundle import export_bundle as copy_out
    return copy_out(Path(source), Path(target))


# COMPONENT_LABELS, TrainingError and TrainingAborted are loaded on first use by __getattr__
# (they import torch).
__all__ = [  # noqa: F822 - the lazy names come from __getattr__ below
    "BACKENDS", "BUILTIN_DEMO", "BundleError", "COMPONENT_LABELS", "LossPoint", "MODEL_TYPES", "ModelType", "RULED_PATHS",
    "ResumeOffer", "TrainingAborted", "TrainingError", "atomic_write_text", "cache_dir_for",
    "check", "check_inputs", "check_run", "compile_cache_folder", "compile_cost", "compile_plans", "earlier_losses",
    "earlier_validation",
    "expected_compile", "explain", "export_bundle", "final_weights_step", "import_bundle",
    "matching_bundle",
    "finished_run_problem", "format_duration", "free_sibling", "latest_samples", "list_backups",
    "load_engine", "machine_capabilities", "only_values", "PreviousRun", "previous_run",
    "read_run_status", "resume_offer", "schedule_curve",
    "silence_library_noise", "silence_torchvision_fallback_warnings", "train", "unused_fields",
    "LoraToolError", "lora_tool",
    # the caption editor (modules/data/caption_edit.py, caption_replace.py)
    "CAPTION_STATES", "CaptionEditError", "FILTERS", "MASK_STATES", "apply_replace",
    "caption_listing", "dataset_folder", "image_thumbnail", "plan_replace", "save_caption", "undo_replace",
    # dataset preparation (modules/data/prep/tools.py)
    "prep_actions", "prep_tool",
]
