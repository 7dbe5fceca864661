"""transformers' "requires torchvision" warnings are silenced, and only those (issue 33 item 8 i)."""
from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

from modules.util.library_noise import (TORCHVISION_FALLBACK_LOGGER,
                                        silence_torchvision_fallback_warnings)
from tests.child_env import with_repo_on_pythonpath

REPO = Path(__file__).resolve().parents[2]
MESSAGE = ("`{0}` requires torchvision (not installed); falling back to `{0}Pil` for backward "
           "compatibility. Install torchvision to use the default backend, or import `{0}Pil` "
           "directly to silence this warning.")


def test_exactly_the_two_torchvision_messages_are_dropped(caplog):
    silence_torchvision_fallback_warnings()
    silence_torchvision_fallback_warnings()  # a second call adds no second filter
    logger = logging.getLogger(TORCHVISION_FALLBACK_LOGGER)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=TORCHVISION_FALLBACK_LOGGER):
        logger.warning(MESSAGE.format("CLIPImageProcessor"))
        logger.warning(MESSAGE.format("SiglipImageProcessor"))
        logger.warning(MESSAGE.format("ViTImageProcessor"))   # not ours to hide
        logger.warning("something else went wrong")
    shown = [r.getMessage() for r in caplog.records]
    assert shown == [MESSAGE.format("ViTImageProcessor"), "something else went wrong"]


def test_a_runs_output_no_longer_contains_them(tmp_path, tempera_cache):
    # A fresh process: transformers warns once per process, and sampling and the final save
    # build a diffusers pipeline, which is where the warnings came from.
    config = tmp_path / "run.json"
    config.write_text(json.dumps({
        "general": {"cache_dir": str(tempera_cache)}, "data": {"resolution": 64},
        "training": {"max_steps": 1, "batch_size": 2},
        "sampling": {"prompts": ["a red circle"], "steps": 1},
        "logging": {"tensorboard": False}, "output": {"dir": "out"}}))
    env = with_repo_on_pythonpath()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--config",
                           str(config), "--quiet"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert (tmp_path / "out" / "samples" / "step-000001-0.png").is_file()  # it did sample
    assert "requires torchvision" not in output, output[-3000:]
    if importlib.util.find_spec("torchao") is not None:  # the `memory` extra: make test has it
        for noise in ("torchao/_C", "is an Enum subclass", "Unable to import `torchao`"):
            assert noise not in output, output[-3000:]


def test_only_the_torchao_import_messages_are_dropped(monkeypatch):
    """Importing diffusers with torchao installed prints these in every process (issue 46's
    `memory` extra); a CUDA kernel library that fails to load on a CUDA build still shows."""
    import torch

    from modules.util.library_noise import silence_torchao_import_noise
    silence_torchao_import_noise()
    silence_torchao_import_noise()  # a second call adds no second filter
    kernels = logging.getLogger("torchao")
    pytree = logging.getLogger("torch.utils._pytree")  # torch's loggers do not propagate
    quantizer = logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer")
    for logger in (kernels, pytree, quantizer):  # torch keeps filters of its own on its loggers
        assert sum(type(f).__name__ == "_DropMatching" for f in logger.filters) == 1
    shown: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            shown.append(record.getMessage())

    for logger in (kernels, pytree, quantizer):
        monkeypatch.setattr(logger, "handlers", [Keep()])
        monkeypatch.setattr(logger, "propagate", False)
        monkeypatch.setattr(logger, "level", logging.WARNING)
    failed = ("Failed to load /v/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
              "Could not load this library: ...")
    monkeypatch.setattr(torch.version, "cuda", None)
    kernels.warning(failed)
    pytree.warning("<enum 'KernelPreference'> is an Enum subclass and is now natively "
                   "supported by torch.compile as an opaque value type. ...")
    quantizer.warning("Unable to import `torchao` Tensor objects. This may affect ...")
    kernels.warning("Skipping import of cpp extensions due to incompatible torch version.")
    pytree.warning("something else in pytree")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    kernels.warning(failed)  # with CUDA, a kernel that cannot load matters
    assert shown == ["Skipping import of cpp extensions due to incompatible torch version.",
                     "something else in pytree", failed]
