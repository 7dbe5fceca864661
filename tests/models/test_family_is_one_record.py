"""A model family is one record: its name appears in the code of modules/ and app/ only in its
own modules (its family record, its file-layout and tiny-model modules), the model-type list and
family table, and the short allow-list below, each entry with its reason. Everything else reads
the tables (`modules.model_types.MODEL_TYPES`, `modules.models.families.FAMILIES`); adding a
family is the list in docs/architecture.md, "Adding a model family".

What counts as a family's name, case-insensitively, with "-", "_", "." or a space allowed
between its parts: its `model.type` value (ZIMAGE, SD15: also "SD 1.5"), its labels ("Z-Image",
"Stable Diffusion 1.x", "SD 1.x"), its built-in model's name (tiny-zimage); and, as written, its
pipeline class (ZImagePipeline) and any CamelCase name starting with its name (ZImageTransformer).
Comments and docstrings are not read: they explain by example ("Z-Image's cap_feats") and hold
no behaviour; help text and messages are strings in code, and are read.
"""
from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from pathlib import Path

from modules.model_types import MODEL_TYPES, ModelType

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("modules", "app")
EVERY_FAMILY = set(ModelType)
SD_FAMILIES = {ModelType.SD15, ModelType.SD2, ModelType.SDXL}
# The places every family is named: the model-type list and the family table.
TABLES = {"modules/model_types.py": EVERY_FAMILY,
          "modules/models/families/__init__.py": EVERY_FAMILY}
# Each family's own modules: its record, its file-layout modules, its tiny model's builder.
# The SD families share theirs (one record function, one ldm layout, one tiny builder).
OWN = {
    "modules/models/families/zimage.py": {ModelType.ZIMAGE},
    "modules/models/zimage_files.py": {ModelType.ZIMAGE},
    "modules/models/tiny_zimage.py": {ModelType.ZIMAGE},
    "modules/models/families/klein.py": {ModelType.KLEIN},
    "modules/models/klein_files.py": {ModelType.KLEIN},
    "modules/models/tiny_klein.py": {ModelType.KLEIN},
    "modules/models/families/sd.py": SD_FAMILIES,
    "modules/models/families/sdxl.py": SD_FAMILIES,
    "modules/models/sd_folder.py": SD_FAMILIES,
    "modules/models/single_file.py": SD_FAMILIES,
    "modules/models/kohya.py": SD_FAMILIES,
    "modules/models/tiny_sd.py": SD_FAMILIES,
}
# What else must name a family, and why. Keep it short: a new entry needs a reason that says
# why the knowledge cannot be a field of the family's record.
ALLOWED = {
    # Help text citing the pipelines and models a setting matches (the brief allows it): the
    # user reads "Z-Image Base 6, Turbo 3" beside the setting, not a list built from records.
    "modules/config/loss.py": {ModelType.ZIMAGE, ModelType.SD15, ModelType.SDXL},
    "modules/config/schema.py": EVERY_FAMILY,
    "modules/config/validate.py": {ModelType.ZIMAGE, ModelType.SD15, ModelType.SDXL},
    # The CPU benchmark's "tiny" and "small" shapes are the demo's SD 1.5 UNet, and their
    # descriptions say so (the family's real-size model comes from its record).
    "modules/bench/models.py": {ModelType.SD15},
    # The bucket benchmark's report says which model it measured: the demo's tiny SD 1.5.
    "modules/bench/buckets.py": {ModelType.SD15},
    # The GPU validation plan is a list of experiments on named models (phases "8-zimage",
    # sizes "sd15" / "sdxl" / "zimage" with their measured step counts and time limits) and
    # its report names them as docs/benchmarks.md does: an experiment names what it measures.
    "modules/bench/gpu_phases.py": EVERY_FAMILY,
    "modules/bench/gpu_report.py": EVERY_FAMILY,
    # The warm-start measurement (issue 55 item 7) is an experiment on the two tiny models the
    # issue names, a UNet and a transformer, by their built-in names.
    "modules/bench/warm_start.py": {ModelType.SD15, ModelType.ZIMAGE},
    # The config example in the generated config reference (`model.path=~/models/sd15`).
    "modules/config/docs.py": {ModelType.SD15},
    # A1111's embedding layout for a two-encoder model (keys clip_l / clip_g), named after
    # the one family that has two: SDXL_EMBEDDING_KEYS in textual inversion and its writer.
    "modules/train/recipe/textual_inversion.py": {ModelType.SDXL},
    "modules/train/outputs/embedding_files.py": {ModelType.SDXL},
}
_SEPARATOR = "[-_ .]?"


def _spelling(name: str) -> str:
    """`name` as a pattern: its letter runs and digits, any of "-_ ." or nothing between."""
    return _SEPARATOR.join(re.escape(part) for part in re.findall(r"[A-Za-z]+|[0-9]", name))


def family_pattern(model_type: ModelType) -> re.Pattern[str]:
    spec = MODEL_TYPES[model_type]
    names = {model_type.value, spec.label, spec.short_label,
             spec.builtin.removeprefix("builtin:").removeprefix("tiny-")}
    either = "|".join(sorted({_spelling(n) for n in names}, key=len, reverse=True))
    return re.compile(rf"(?i:(?<![a-z0-9])(?:{either})(?![a-z0-9]))"  # a word of its own
                      rf"|(?i:{either})(?=[A-Z])"                     # a CamelCase prefix
                      rf"|{re.escape(spec.pipeline_class)}")


def code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, token) of each token of `path` but its comments and docstrings."""
    source = path.read_text(encoding="utf-8")
    docstrings = {(node.lineno, node.col_offset) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                  and isinstance(node.value.value, str)}
    return [(token.start[0], token.string)
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type != tokenize.COMMENT
            and not (token.type == tokenize.STRING and token.start in docstrings)]


@functools.cache
def named_families() -> dict[str, dict[ModelType, list[int]]]:
    """path -> family -> the lines of its code that name it."""
    patterns = {t: family_pattern(t) for t in ModelType}
    found: dict[str, dict[ModelType, list[int]]] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, text in code_strings(path):
                for model_type, pattern in patterns.items():
                    if pattern.search(text):
                        found.setdefault(rel, {}).setdefault(model_type, []).append(line)
    return found


def test_a_family_is_named_only_by_its_record_its_files_and_the_allow_list():
    found = named_families()
    stray = [f"{path}:{lines[0]}: names {model_type.value} ({len(lines)} lines)"
             for path, families in found.items() for model_type, lines in families.items()
             if model_type not in TABLES.get(path, set()) | OWN.get(path, set())
             | ALLOWED.get(path, set())]
    assert not stray, ("a family's name outside its record (move the knowledge to a field of "
                       "its record, or allow it with a reason):\n" + "\n".join(stray))


def test_every_allowance_is_still_needed():
    """An allow-list entry whose file no longer names the family goes (a stale allowance would
    let the next one through unseen)."""
    found = named_families()
    stale = [f"{path}: {model_type.value}" for path, families in ALLOWED.items()
             for model_type in families - set(found.get(path, {}))
             if not (path.startswith("modules/bench/gpu_") and families == EVERY_FAMILY)]
    assert not stale, "allowed but no longer named:\n" + "\n".join(stale)


def test_the_check_sees_each_spelling():
    """The patterns catch the spellings users and code write, and not neighbouring words."""
    zimage, sd15, sdxl = (family_pattern(t) for t in (ModelType.ZIMAGE, ModelType.SD15,
                                                       ModelType.SDXL))
    for text in ("zimage", "ZIMAGE", "z_image", "Z-Image", "tiny-zimage", "ZImagePipeline",
                 "diffusers.ZImageTransformer2DModel", "Z Image"):
        assert zimage.search(text), text
    for text in ("sd15", "SD15", "SD 1.5", "SD 1.x", "Stable Diffusion 1.x", "builtin:tiny-sd15"):
        assert sd15.search(text), text
    assert sdxl.search("SDXL_EMBEDDING_KEYS") and sdxl.search("sdxl")
    for text in ("sd_family", "families/sd.py", "zimages_of_cats", "imagezimage"):
        assert not (zimage.search(text) or sd15.search(text)), text


def test_the_record_says_which_pipelines_take_the_negative_prompt_encoded_only():
    """Sampling reads `negative_prompt_encoded_only` from the record instead of inspecting the
    pipeline's signature: each record says what its pipeline's `__call__` takes."""
    import inspect

    import diffusers

    from modules.models.families import FAMILIES
    for model_type, family in FAMILIES.items():
        pipeline = getattr(diffusers, MODEL_TYPES[model_type].pipeline_class)
        takes_text = "negative_prompt" in inspect.signature(pipeline.__call__).parameters
        assert family.negative_prompt_encoded_only is not takes_text, model_type
        if family.negative_prompt_encoded_only:
            assert family.pipeline_text_arguments is not None, model_type
