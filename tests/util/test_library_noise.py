"""transformers' "requires torchvision" warnings are silenced, and only those (issue 33 item 8 i)."""
from __future__ import annotations

import importlib.util
import logging

from modules.util.library_noise import (TORCHVISION_FALLBACK_LOGGER,
                                        silence_torchvision_fallback_warnings)

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


def assert_no_library_noise(output: str) -> None:
    """A training process's output (stdout and stderr) holds none of the messages silenced
    here. Checked on the output of the training processes of
    tests/cli/test_secret_settings_cli.py (fresh processes that sample and save: a sample and
    the final save build a diffusers pipeline, which is where the warnings came from, and
    transformers warns once per process), so no process of its own is started for it."""
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
