"""Flux.2 Klein's folders checked before anything is written (no weights loaded): the tiny
model's folder passes; another family's folder, a folder missing a component, a transformer
with the other size's text encoder and a step-distilled Klein are each refused, naming the
file and what to do; the file layouts Klein has no writer for yet are refused up front."""
from __future__ import annotations

import json
import shutil

import pytest

from modules.config import Config, apply_overrides
from modules.model_types import MODEL_TYPES, ModelType
from modules.train.recipe.loss_checks import family_problems
from modules.train.setup.inputs import check_inputs


@pytest.fixture(scope="module")
def klein_folder(tempera_cache):
    from modules.models.tiny import ensure_builtin_model
    return ensure_builtin_model(MODEL_TYPES[ModelType.KLEIN].builtin, tempera_cache)


@pytest.fixture
def copy(klein_folder, tmp_path):
    """A copy of the tiny Klein's folder to break (configs and weights: 2 MB)."""
    target = tmp_path / "FLUX.2-klein-base-tiny"
    shutil.copytree(klein_folder, target)
    return target


def _model_problems(path, *overrides: str) -> dict[str, str]:
    config = apply_overrides(Config(), ["model.type=KLEIN", f"model.path={path}", *overrides])
    return {p.path: str(p) for p in check_inputs(config) if p.path.startswith("model.")}


def _edit(path, **changes) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


def test_the_tiny_folder_passes(copy):
    assert _model_problems(copy) == {}


def test_another_familys_folder_names_the_model_type_to_set(copy):
    _edit(copy / "model_index.json", _class_name="ZImagePipeline")
    problems = _model_problems(copy)
    assert problems.keys() == {"model.type"}
    assert "ZIMAGE" in problems["model.type"] and "ZImagePipeline" in problems["model.type"]


def test_a_missing_component_is_named(copy):
    shutil.rmtree(copy / "vae")
    problems = _model_problems(copy)
    assert problems.keys() == {"model.path"} and "vae" in problems["model.path"]


def test_a_transformer_with_the_other_sizes_encoder_is_refused(copy):
    """A 9B transformer (caption features 3 x 4096) beside Qwen3-4B (2560), here in miniature."""
    _edit(copy / "text_encoder" / "config.json", hidden_size=24)
    problems = _model_problems(copy)
    assert problems.keys() == {"model.path"}
    message = problems["model.path"]
    assert "transformer/config.json" in message and "text_encoder/config.json" in message
    assert "48 = 3 layers x 16" in message and "24 wide" in message


def test_a_distilled_klein_is_refused_with_what_to_train_instead(copy):
    _edit(copy / "model_index.json", is_distilled=True)
    problems = _model_problems(copy)
    assert problems.keys() == {"model.path"}
    message = problems["model.path"]
    assert '"is_distilled": true' in message.replace("is_distilled: true",
                                                     '"is_distilled": true')
    assert "FLUX.2-klein-base-4B" in message and "model.train_distilled=true" in message
    assert _model_problems(copy, "model.train_distilled=true") == {}


def test_a_single_file_is_refused_until_klein_reads_them(tmp_path):
    path = tmp_path / "flux-2-klein-base-4b.safetensors"
    path.write_bytes(b"")
    problems = _model_problems(path)
    assert problems.keys() == {"model.path"} and "not supported yet" in problems["model.path"]


@pytest.mark.parametrize("method,fmt", [("LORA", "KOHYA"), ("FINE_TUNE", "SINGLE_FILE")])
def test_the_layouts_klein_has_no_writer_for_are_refused_up_front(method, fmt):
    config = apply_overrides(Config(), ["model.type=KLEIN", f"training.method={method}",
                                        f'output.formats=["DIFFUSERS", "{fmt}"]'])
    problems = {p.path: str(p) for p in family_problems(config)}
    assert problems.keys() == {"output.formats[1]"} and "Flux.2 Klein" in str(problems)
