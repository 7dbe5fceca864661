"""What `tempera-lora` says and where it writes: a refusal names the input by its flag (the
engine names it by a field key, each front end in its own words), a `builtin:` base is the
built-in tiny model training uses, the report starts with what was written, resize and
extract show each layer as they go, and an output that cannot be written (a read-only
folder, a full disk, before or during the write) is refused in one line naming it, with
nothing left behind."""
from __future__ import annotations

import errno
import io
import os
import re
import shutil
import tokenize
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.cli.lora import main
from modules.config.schema import ModelType
from modules.lora_tools.errors import LoraToolError
from modules.model_types import MODEL_TYPES
from modules.models.tiny import ensure_builtin_model
from modules.util.disk import megabytes
from tests.lora_tools.random_lora import random_unet_lora

TINY = MODEL_TYPES[ModelType.SD15].builtin
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def tiny(tempera_cache, tmp_path_factory):
    """The tiny SD 1.5 (the demo's model) and a random kohya LoRA on its UNet's attention."""
    base = ensure_builtin_model(TINY, tempera_cache)
    lora = random_unet_lora(base, tmp_path_factory.mktemp("lora") / "lora.safetensors")
    return {"base": Path(base), "lora": lora, "cache": tempera_cache}


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- the inputs in each front end's words -------------------------------------------------
def test_the_engine_names_inputs_by_key_and_the_command_line_by_flag(tiny, tmp_path, capsys):
    from modules.lora_tools.operations import run_tool
    with pytest.raises(LoraToolError) as refused:
        run_tool("resize", output=tmp_path / "r.safetensors", base=tiny["base"],
                 loras=[(tiny["lora"], 1.0)], rank=0)
    assert refused.value.fields == ("rank",) and "--" not in str(refused.value)
    assert refused.value.text({"rank": "Rank"}) == "Rank 0: must be at least 1"
    assert main(["resize", "--base", str(tiny["base"]), "--lora", str(tiny["lora"]), "--rank",
                 "0", "-o", str(tmp_path / "r.safetensors")]) == 2
    assert capsys.readouterr().err == "tempera-lora resize: --rank 0: must be at least 1\n"
    with pytest.raises(LoraToolError) as refused:
        run_tool("convert", output=tmp_path / "c.safetensors", loras=[(tiny["lora"], 1.0)],
                 layout="diffusers")
    assert refused.value.fields == ("base", "model_type")
    assert main(["convert", "--lora", str(tiny["lora"]), "--layout", "diffusers", "-o",
                 str(tmp_path / "c.safetensors")]) == 2
    assert "--base or --model-type is needed" in capsys.readouterr().err


def test_no_engine_message_names_a_command_line_flag():
    """The engine's messages name inputs as placeholders ({output}), never as a front end's
    word: no string in modules/lora_tools/ but a docstring holds a `--flag`."""
    folder = Path(__file__).parents[2] / "modules" / "lora_tools"
    # f-strings are one STRING token up to Python 3.11, FSTRING_MIDDLE parts from 3.12
    kinds = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    found = []
    for path in sorted(folder.glob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        found += [f"{path.name}:{t.start[0]}: {t.string}" for t in tokens
                  if t.type in kinds and not t.string.startswith(('"""', "'''"))
                  and re.search(r"--[a-z]", t.string)]
    assert len(list(folder.glob("*.py"))) >= 8 and found == []


# --- builtin: bases -------------------------------------------------------------------------
def test_a_builtin_base_is_the_built_in_model_training_uses(tiny, tmp_path, capsys):
    from_builtin, from_folder = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    common = ["--lora", str(tiny["lora"]), "--layout", "diffusers"]
    assert main(["convert", "--base", TINY, "--cache-dir", str(tiny["cache"]), *common,
                 "-o", str(from_builtin)]) == 0
    assert main(["convert", "--base", str(tiny["base"]), *common, "-o", str(from_folder)]) == 0
    ours, expected = load_file(str(from_builtin)), load_file(str(from_folder))
    layers = len(load_file(str(tiny["lora"]))) // 3  # kohya: down, up and alpha of each
    assert ours.keys() == expected.keys() and len(ours) == 2 * layers > 0
    assert all(torch.equal(ours[key], expected[key]) for key in ours)
    capsys.readouterr()
    assert main(["convert", "--base", "builtin:tiny-nothing", "--cache-dir",
                 str(tiny["cache"]), *common, "-o", str(tmp_path / "c.safetensors")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tempera-lora convert: --base 'builtin:tiny-nothing': no such "
                            "built-in model") and TINY in error
    assert not (tmp_path / "c.safetensors").exists()


def test_extract_from_a_builtin_base_shows_each_layer_as_it_goes(tiny, tmp_path, capsys):
    tuned = tmp_path / "tuned"
    shutil.copytree(tiny["base"], tuned)
    tensors = load_file(str(tuned / UNET_FILE))
    changed = ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight",
               "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k.weight"]
    for key in changed:
        tensors[key] = tensors[key] + 0.1
    save_file(tensors, str(tuned / UNET_FILE), metadata={"format": "pt"})
    out = tmp_path / "extracted.safetensors"
    assert main(["extract", "--base", TINY, "--cache-dir", str(tiny["cache"]), "--tuned",
                 str(tuned), "--rank", "2", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    steps = [re.fullmatch(r"\[(\d+)/(\d+)\] (.*)", line) for line in _lines(captured.err)]
    assert all(steps)
    compared = [m for m in steps if m and m[3].startswith("compared ")]
    svds = [m for m in steps if m and not m[3].startswith("compared ")]
    # every Linear layer of the UNet and text encoder compared, one line each, in order
    assert [int(m[1]) for m in compared] == list(range(1, len(compared) + 1)) and \
        {int(m[2]) for m in compared} == {len(compared)} and len(compared) > 50
    assert [m[3].split(":")[0] for m in svds] == sorted(
        f"unet.{key.removesuffix('.weight')}" for key in changed)
    assert [m[2] for m in svds] == ["2", "2"]
    report = _lines(captured.out)
    assert report[0] == f"written: {out}" and "2 layers differ" in report[1]


# --- the report ---------------------------------------------------------------------------------
def test_a_merge_report_says_it_wrote_a_new_model_and_left_the_base_alone(tiny, tmp_path,
                                                                         capsys):
    out = tmp_path / "merged"
    before = (tiny["base"] / UNET_FILE).read_bytes()
    assert main(["merge", "--base", str(tiny["base"]), "--lora", f"{tiny['lora']}:0.5", "-o",
                 str(out)]) == 0
    report = _lines(capsys.readouterr().out)
    assert report[0] == f"written: {out}"
    assert report[1].startswith("a new model:") and report[1].endswith(
        f"{tiny['base']} itself is unchanged")
    assert (tiny["base"] / UNET_FILE).read_bytes() == before
    assert (out / UNET_FILE).read_bytes() != before


# --- an output that cannot be written --------------------------------------------------------
def _refused_in_one_line(argv: list[str], capsys) -> str:
    """The refusal: one line on stderr (after the progress lines of the layers done)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    said = [line for line in captured.err.splitlines() if not re.match(r"\[\d+/\d+\] ", line)]
    assert captured.out == "" and len(said) == 1
    return said[0] + "\n"


def test_a_read_only_output_folder_is_refused_before_any_work(tiny, tmp_path, capsys,
                                                               monkeypatch):
    """Checked as the trainer checks its output folder (a test as root cannot make a folder
    it may not write: os.access and the read-only flag are what is asked)."""
    import modules.lora_tools.operations as operations
    import modules.lora_tools.output as output

    def no_work(*args, **kwargs):
        raise AssertionError("a LoRA was read before the output was checked")
    monkeypatch.setattr(output.os, "access", lambda path, mode: False)
    monkeypatch.setattr(output, "_read_only", lambda path: True)
    monkeypatch.setattr(operations, "read_lora", no_work)
    out = tmp_path / "merged.safetensors"
    error = _refused_in_one_line(["merge", "--base", str(tiny["base"]), "--lora",
                                  str(tiny["lora"]), "-o", str(out)], capsys)
    assert error == (f"tempera-lora merge: --output {out}: cannot be written: {tmp_path}: it "
                     "is on a read-only file system; nothing was written\n")
    assert list(tmp_path.iterdir()) == []


def test_an_output_disk_without_room_for_the_merge_is_refused_before_any_work(
        tiny, tmp_path, capsys, monkeypatch):
    import modules.lora_tools.operations as operations
    import modules.lora_tools.output as output

    def no_work(*args, **kwargs):
        raise AssertionError("a LoRA was read before the output was checked")
    monkeypatch.setattr(output, "free_bytes", lambda path: 1000)
    monkeypatch.setattr(operations, "read_lora", no_work)
    out = tmp_path / "merged"
    error = _refused_in_one_line(["merge", "--base", str(tiny["base"]), "--lora",
                                  str(tiny["lora"]), "-o", str(out)], capsys)
    size = sum(p.stat().st_size for p in tiny["base"].rglob("*") if p.is_file())
    assert size > 2**20 and error == (f"tempera-lora merge: --output {out}: about "
                                      f"{megabytes(size)} needed, 0 MB free on the disk of "
                                      f"{tmp_path}; nothing was written\n")
    assert list(tmp_path.iterdir()) == []


def _write_then_fill_the_disk(target, *args, **kwargs):
    """A write that puts some bytes down and then finds the disk full, as the OS says it."""
    name = target if isinstance(target, (str, os.PathLike)) else None
    if name is not None:
        Path(name).write_bytes(b"partial")
    else:
        target.write(b"partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_disk_that_fills_during_a_merge_leaves_nothing_and_names_the_output(
        tiny, tmp_path, capsys, monkeypatch):
    import modules.lora_tools.streaming as streaming
    monkeypatch.setattr(streaming, "_copy", lambda src, dst, size:
                        _write_then_fill_the_disk(dst))  # the base's untouched tensors
    out = tmp_path / "merged"
    error = _refused_in_one_line(["merge", "--base", str(tiny["base"]), "--lora",
                                  str(tiny["lora"]), "-o", str(out)], capsys)
    assert error.startswith(f"tempera-lora merge: --output {out}: the disk ran out of space "
                            "while writing it (")
    assert error.endswith("free now); nothing was written\n")
    assert list(tmp_path.iterdir()) == []  # no partial folder, no temporary one


def test_a_disk_that_fills_while_writing_a_lora_leaves_nothing(tiny, tmp_path, capsys,
                                                              monkeypatch):
    """safetensors reports a full disk as its own error type, the OS error in its text."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                              "StorageFull, message: \"No space left on device\" })")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "small.safetensors"
    error = _refused_in_one_line(["resize", "--base", str(tiny["base"]), "--lora",
                                  str(tiny["lora"]), "--rank", "2", "-o", str(out)], capsys)
    assert error.startswith(f"tempera-lora resize: --output {out}: the disk ran out of space")
    assert list(tmp_path.iterdir()) == []
