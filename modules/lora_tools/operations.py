"""The five LoRA tools, each one function that checks its input, writes its output atomically
(never over an existing path) and returns a report of what it did.

Which adapter kinds each tool takes (docs/lora_tools.md): merging into a base computes each
layer's full update, which is defined for LoRA, LoCon, LoHa, LoKr and DoRA; merging several
LoRAs into one concatenates their ranks and converting renames their tensors, both defined
for LoRA / LoCon only (a LoHa or LoKr is no product of two matrices, a DoRA's magnitude
depends on the base); resizing takes LoRA / LoCon (an SVD of their update).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modules.lora_tools.architecture import LayerKey, Location, ModelLayout, weight_locations
from modules.lora_tools.errors import LoraToolError, input_error
from modules.lora_tools.lora_files import (
    LAYOUTS, AdapterLayer, delta, lora, read_lora, write_lora)
from modules.lora_tools.low_rank import low_rank, low_rank_of_factors
from modules.lora_tools.output import check_new_output, writing
from modules.lora_tools.streaming import copy_tree_except, rewrite, write_streamed
from modules.models.families import family_files
from modules.util.atomic import atomic_file, atomic_write_dir

LINEAR_ONLY = ("lora",)
REFUSED = {  # operation -> why LoHa / LoKr / DoRA are refused
    "merge-loras": "their updates are not a product of two matrices (LoHa, LoKr) or depend on "
                   "the base weight (DoRA), so ranks cannot be concatenated: merge each into "
                   "the base model instead (merge), then extract a LoRA from it",
    "resize": "resizing is an SVD of a LoRA's up @ down; LoHa / LoKr / DoRA have no rank to cut "
              "that way",
    "convert": "the diffusers/peft layout has no LoHa / LoKr, and a DoRA's text-encoder "
               "magnitudes are not read back by diffusers (docs/adapters.md): keep the kohya file",
}


# Called once per layer by resize and extract: (layers done, layers in all, what was done).
Progress = Callable[[int, int, str], None]


def _no_progress(done: int, total: int, what: str) -> None:
    return None


@dataclass
class Report:
    """What a tool did: the file or folder written, what it is (`summary`), and one line per
    layer (`lines`) with its number in `per_layer`, and the overall one."""
    output: Path
    lines: list[str] = field(default_factory=list)
    per_layer: dict[str, float] = field(default_factory=dict)
    overall: float | None = None
    summary: list[str] = field(default_factory=list)

    def text(self) -> str:
        """The result first (what was written, and what it is), then the inputs and layers."""
        return "\n".join([f"written: {self.output}", *self.summary, *self.lines])


def check_weight(value: float, what: str) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoraToolError(f"{what}: weight {value!r} is not a finite number")
    return float(value)


def _refuse_kinds(path: Path, layers: dict[LayerKey, AdapterLayer], operation: str,
                  allowed: tuple[str, ...] = LINEAR_ONLY) -> None:
    kinds = sorted({layer.kind for layer in layers.values()} - set(allowed))
    if kinds:
        raise LoraToolError(f"{path}: {', '.join(k.upper() for k in kinds)} layers cannot be "
                            f"used by {operation}: {REFUSED[operation]}")


def _label(key: LayerKey) -> str:
    return f"{key[0]}.{key[1]}"


# --- merge into a base --------------------------------------------------------------------
def merge_into_base(layout: ModelLayout, loras: list[tuple[Path, float]], output: Path) -> Report:
    """Add each LoRA's update times its weight to the base's weights, one tensor at a time;
    write a diffusers folder (from a folder base, `output` without .safetensors) or an ldm
    single file (`output` .safetensors, from either kind of base)."""
    assert layout.path is not None
    output = check_new_output(output, _merge_bytes(layout, Path(output)))
    updates: dict[LayerKey, list[tuple[AdapterLayer, float]]] = {}
    report = Report(output)
    for path, weight in loras:
        kind, layers = read_lora(path, layout)
        check_weight(weight, str(path))
        report.lines.append(f"{path}: {kind} layout, {len(layers)} layers, weight {weight:g}")
        for key, layer in layers.items():
            updates.setdefault(key, []).append((layer, weight))
    locations = weight_locations(layout, list(updates))
    by_file: dict[Path, dict[str, list[tuple[Location, LayerKey]]]] = {}
    for key, location in locations.items():
        by_file.setdefault(location.file, {}).setdefault(location.key, []).append((location, key))
    changes = {file: {name: _change(parts, updates) for name, parts in keys.items()}
               for file, keys in by_file.items()}
    if layout.is_single_file:
        if output.suffix.lower() != ".safetensors":
            raise input_error("{output} {path}: a single-file base is merged into a "
                              ".safetensors file", path=output)
        with writing(output), atomic_file(output) as tmp:
            rewrite(layout.path, tmp, changes.get(layout.path, {}),
                    {"tempera.merged_loras": ", ".join(p.name for p, _ in loras)})
    elif output.suffix.lower() == ".safetensors":  # a folder written as one file
        from modules.lora_tools.to_single_file import denoiser_file_entries, single_file_entries
        # the family's lone denoiser file where it has one (Z-Image's ComfyUI diffusion
        # model: the text encoder and VAE are not changed, their own files still serve), else
        # the whole model as one ldm checkpoint
        lone = family_files(layout.model_type).denoiser_file_key is not None
        entries = (denoiser_file_entries if lone else single_file_entries)(layout, changes)
        with writing(output), atomic_file(output) as tmp:
            write_streamed(tmp, entries, {"tempera.merged_loras":
                                          ", ".join(p.name for p, _ in loras)})
    else:
        base = layout.path

        def write(tmp: Path) -> None:
            copy_tree_except(base, tmp, set(changes))
            for file, file_changes in changes.items():
                rewrite(file, tmp / file.relative_to(base), file_changes)
        with writing(output):
            atomic_write_dir(output, write)
    report.summary.append(f"a new model: {layout.source} with {len(loras)} LoRA(s) merged into "
                          f"{len(updates)} of its layers; {layout.source} itself is unchanged")
    return report


def _merge_bytes(layout: ModelLayout, output: Path) -> int:
    """About what a merge writes: the base's size (a merged tensor keeps its dtype), or its
    denoiser's where a folder becomes the family's lone denoiser file (Z-Image's)."""
    assert layout.path is not None
    if layout.is_single_file:
        return layout.path.stat().st_size
    folder = layout.path
    if (output.suffix.lower() == ".safetensors"
            and family_files(layout.model_type).denoiser_file_key is not None):
        folder = folder / layout.denoiser
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _change(parts: list[tuple[Location, LayerKey]],
            updates: dict[LayerKey, list[tuple[AdapterLayer, float]]]):
    def apply(weight: torch.Tensor) -> torch.Tensor:
        merged = weight.float()
        for location, key in parts:
            rows = slice(*location.rows) if location.rows else slice(None)
            base = location.read(merged)
            update = torch.zeros_like(base)
            for layer, w in updates[key]:
                update += w * delta(layer, base).reshape(base.shape)
            merged[rows] = location.stored(base + update) if location.stored else base + update
        return merged
    return apply


# --- merge several LoRAs into one ----------------------------------------------------------
def merge_loras(layout: ModelLayout, loras: list[tuple[Path, float]], output: Path,
                file_layout: str) -> Report:
    """One LoRA whose update is the weighted sum of the inputs' updates, exactly: each layer's
    ranks are concatenated (down stacked, up side by side with its scale and weight folded in),
    so the result's rank at a layer is the sum of the inputs' ranks there (`resize` cuts it)."""
    output = _check_lora_output(output, file_layout)
    collected: dict[LayerKey, list[tuple[AdapterLayer, float]]] = {}
    report = Report(output)
    for path, weight in loras:
        check_weight(weight, str(path))
        _, layers = read_lora(path, layout)
        _refuse_kinds(path, layers, "merge-loras")
        for key, layer in layers.items():
            collected.setdefault(key, []).append((layer, weight))
    merged = {}
    for key, parts in collected.items():
        down = torch.cat([layer.tensors["lora_down.weight"].float() for layer, _ in parts])
        up = torch.cat([layer.tensors["lora_up.weight"].float() * layer.scale * weight
                        for layer, weight in parts], dim=1)
        merged[key] = lora(down, up, float(down.shape[0]))  # alpha = rank: scale 1
    with writing(output):
        write_lora(merged, output, file_layout, layout)
    ranks = sorted({layer.rank for layer in merged.values()})
    report.summary.append(f"a new LoRA: {len(loras)} LoRAs merged exactly (ranks "
                          f"concatenated), {len(merged)} layers, rank "
                          f"{'/'.join(map(str, ranks))}")
    return report


def _check_lora_output(output: Path, file_layout: str) -> Path:
    if file_layout not in LAYOUTS:
        raise input_error("{layout} {value!r}: expected one of {known}", value=file_layout,
                          known=", ".join(LAYOUTS))
    output = check_new_output(output)
    if output.suffix.lower() != ".safetensors":
        raise input_error("{output} {path}: a LoRA file is written as .safetensors",
                          path=output)
    return output


# --- SVD: resize and extract ---------------------------------------------------------------
def _as_lora(shape: tuple[int, ...], factors: tuple[torch.Tensor, torch.Tensor, float],
             rank: int) -> tuple[AdapterLayer, float]:
    """A LoRA layer of a layer's weight shape from low-rank factors; and the share kept."""
    up, down, share = factors
    if len(shape) == 4:
        down = down.reshape(rank, *shape[1:])
        up = up.reshape(shape[0], rank, 1, 1)
    return lora(down.contiguous(), up.contiguous(), float(rank)), share


def resize(layout: ModelLayout, source: Path, output: Path, rank: int,
           file_layout: str | None = None, progress: Progress = _no_progress) -> Report:
    """The LoRA at a lower rank, each layer its update's best approximation at that rank,
    computed from the layer's own factors (`low_rank_of_factors`: the dense SVD's result
    without forming the update); the report gives each layer's relative error
    ‖ΔW − ΔW_r‖ / ‖ΔW‖. `progress` is called after each layer."""
    if rank < 1:
        raise input_error("{rank} {value}: must be at least 1", value=rank)
    kind, layers = read_lora(source, layout)
    output = _check_lora_output(output, file_layout or kind)
    _refuse_kinds(source, layers, "resize")
    too_big = [f"{_label(k)} (rank {layer.rank})" for k, layer in layers.items()
               if rank > layer.rank]
    if too_big:
        raise input_error("{rank} {value}: larger than the rank of {count} layer(s) of {path}, "
                          "e.g. {example}; resizing only lowers a rank", value=rank,
                          count=len(too_big), path=source, example=too_big[0])
    report = Report(output)
    out = {}
    for done, (key, layer) in enumerate(layers.items(), start=1):
        up = layer.tensors["lora_up.weight"].flatten(1).double() * layer.scale
        down = layer.tensors["lora_down.weight"].flatten(1).double()
        out[key], share = _as_lora(layout.shapes[key], low_rank_of_factors(up, down, rank), rank)
        error = math.sqrt(max(0.0, 1.0 - share))
        report.per_layer[_label(key)] = error
        report.lines.append(f"{_label(key)}: rank {layer.rank} -> {rank}, error {error:.2%}")
        progress(done, len(layers), report.lines[-1])
    worst = max(report.per_layer, key=report.per_layer.__getitem__)
    report.summary.append(f"a new LoRA: {source} at rank {rank}, {len(out)} layers; the largest "
                          f"error is {report.per_layer[worst]:.2%} ({worst})")
    with writing(output):
        write_lora(out, output, file_layout or kind, layout)
    return report


def extract(layout: ModelLayout, tuned: ModelLayout, output: Path, rank: int,
            conv_rank: int = 0, file_layout: str = "kohya", threshold: float = 0.0,
            progress: Progress = _no_progress) -> Report:
    """A LoRA of the difference tuned − base, each changed layer at `rank` (convolutions at
    `conv_rank`; 0 leaves them out), by a dense SVD of the difference; the report gives the
    share of each layer's difference kept (of its squared Frobenius norm) and overall.
    `progress` is called after each layer is compared, and after each SVD."""
    from safetensors import safe_open
    output = _check_lora_output(output, file_layout)
    if rank < 1 or conv_rank < 0:
        raise input_error("{rank} {value} / {conv_rank} {conv}: the rank must be at least 1, "
                          "the conv rank at least 0", value=rank, conv=conv_rank)
    if tuned.model_type != layout.model_type or tuned.shapes != layout.shapes:
        raise input_error("{tuned} {path}: is not the same architecture as the {base} "
                          "{source} ({found} vs {expected})", path=tuned.source,
                          source=layout.source, found=tuned.model_type.value,
                          expected=layout.model_type.value)
    # the text projection is left out: no LoRA format adapts it (kohya's and ComfyUI's SDXL
    # maps name the encoders' attention and MLP layers), and an OpenCLIP single file (SDXL's
    # second encoder) holds it transposed, as a bare parameter, not as a layer's weight
    wanted = [k for k, s in layout.shapes.items()
              if (conv_rank if len(s) == 4 else rank) > 0 and not k[1].endswith(".conv_in")
              and not k[1].endswith("text_projection")]
    base_at, tuned_at = weight_locations(layout, wanted), weight_locations(tuned, wanted)

    def difference(key: LayerKey) -> torch.Tensor:
        return _read(tuned_at[key], safe_open) - _read(base_at[key], safe_open)

    # two passes, one layer at a time: which layers changed, then their SVDs (a full
    # fine-tune's differences would not fit in memory all at once)
    changed = []
    for done, key in enumerate(wanted, start=1):
        if float(difference(key).abs().max()) > threshold:
            changed.append(key)
        progress(done, len(wanted), f"compared {_label(key)}")
    too_big = [f"{_label(k)} {layout.shapes[k]}" for k in changed
               if (conv_rank if len(layout.shapes[k]) == 4 else rank)
               > min(layout.shapes[k][0], math.prod(layout.shapes[k][1:]))]
    if too_big:
        raise input_error("{rank} {value} / {conv_rank} {conv}: larger than {count} changed "
                          "layer(s) allow, e.g. {example} (a layer's rank is at most min(out, "
                          "in x kernel))", value=rank, conv=conv_rank, count=len(too_big),
                          example=too_big[0])
    if not changed:
        raise input_error("{tuned} {path}: no layer differs from the {base} {source}",
                          path=tuned.source, source=layout.source)
    report, out = Report(output), {}
    kept_energy = total_energy = 0.0
    for done, key in enumerate(changed, start=1):
        shape = layout.shapes[key]
        layer_rank = conv_rank if len(shape) == 4 else rank
        matrix = difference(key).flatten(1)
        out[key], share = _as_lora(shape, low_rank(matrix, layer_rank), layer_rank)
        energy = float(matrix.double().pow(2).sum())
        kept_energy, total_energy = kept_energy + share * energy, total_energy + energy
        report.per_layer[_label(key)] = share
        report.lines.append(f"{_label(key)}: rank {layer_rank}, kept {share:.2%}")
        progress(done, len(changed), report.lines[-1])
    report.overall = kept_energy / total_energy
    report.summary.append(f"a new LoRA of {tuned.source} - {layout.source}: {len(out)} layers "
                          f"differ; it keeps {report.overall:.2%} of the difference (squared "
                          "Frobenius norm)")
    with writing(output):
        write_lora(out, output, file_layout, layout)
    return report


def _read(location: Location, safe_open) -> torch.Tensor:
    with safe_open(str(location.file), "pt") as f:
        weight = f.get_tensor(location.key)
    return location.read(weight).float()


# --- convert -------------------------------------------------------------------------------
def convert(layout: ModelLayout, source: Path, output: Path, file_layout: str) -> Report:
    """The same LoRA / LoCon in the other layout (exact: the same tensors, renamed)."""
    kind, layers = read_lora(source, layout)
    output = _check_lora_output(output, file_layout)
    _refuse_kinds(source, layers, "convert")
    with writing(output):
        write_lora(layers, output, file_layout, layout)
    return Report(output, summary=[f"a new LoRA: {source} in the {file_layout} layout (it was "
                                   f"{kind}), {len(layers)} layers, the same updates"])


# --- one entry for every front end -------------------------------------------------------------
TOOLS = ("merge", "merge-loras", "extract", "resize", "convert")


def parse_lora_arg(text: str) -> tuple[Path, float]:
    """`file.safetensors[:weight]` (weight 1 when none is given); the weight must be a finite
    number."""
    path, sep, weight = text.strip().rpartition(":")
    if not sep or "/" in weight or weight.endswith(".safetensors"):
        return Path(text.strip()), 1.0
    try:
        value = float(weight)
    except ValueError:
        raise LoraToolError(f"{text}: the weight after ':' ({weight!r}) is not a number") from None
    if not math.isfinite(value):
        raise LoraToolError(f"{text}: the weight {weight!r} is not finite")
    return Path(path), value


def run_tool(command: str, *, output: str | Path, base: str | Path | None = None,
             model_type: str | None = None, config_folder: str | Path | None = None,
             loras: Sequence[tuple[Path, float]] = (), tuned: str | Path | None = None,
             rank: int = 0, conv_rank: int = 0, threshold: float = 0.0,
             layout: str | None = None, cache_dir: str | Path | None = None,
             progress: Progress = _no_progress) -> Report:
    """Run one tool by name, as `tempera-lora <command>` and the app's LoRA tools tab ask.
    A base or tuned model may be a built-in tiny model (`builtin:tiny-sd15`), built into
    `cache_dir` (the platform's cache folder when None) as training builds it; `progress` is
    called after each layer of resize and extract."""
    from modules.config.schema import ModelType
    from modules.lora_tools.architecture import model_layout
    from modules.paths import cache_dir_for

    if command not in TOOLS:
        raise LoraToolError(f"unknown tool {command!r}; expected one of {', '.join(TOOLS)}")
    if not loras and command != "extract":
        raise input_error("{command}: at least one LoRA file is needed ({loras})",
                          command=command)
    if command in ("merge", "extract") and not base:
        raise input_error("{command}: the base model is needed ({base})", command=command)
    if not str(output).strip():
        raise input_error("{command}: the path to write is needed ({output})", command=command)
    cache = cache_dir_for(str(cache_dir or ""))
    kind = ModelType(model_type.upper()) if model_type else None
    found = model_layout(base or None, kind, config_folder or None, cache)
    output = Path(output)
    if command == "merge":
        return merge_into_base(found, list(loras), output)
    if command == "merge-loras":
        return merge_loras(found, list(loras), output, layout or "kohya")
    if command == "extract":
        if not tuned:
            raise input_error("extract: the fine-tuned model is needed ({tuned})")
        other = model_layout(tuned, found.model_type, config_folder or None, cache, "tuned")
        return extract(found, other, output, rank, conv_rank, layout or "kohya", threshold,
                       progress)
    (source, _), *more = loras
    if more:
        raise input_error("{command}: takes one LoRA file ({loras}), {count} were given",
                          command=command, count=len(loras))
    if command == "resize":
        return resize(found, source, output, rank, layout, progress)
    if layout is None:
        raise input_error("convert: the layout to write is needed ({layout})")
    return convert(found, source, output, layout)
