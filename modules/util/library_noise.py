"""Library messages that mean nothing to a Tempera user, silenced one by one in named functions
that the front ends (the CLI, the desktop app) call explicitly. Nothing here runs at import."""
from __future__ import annotations

import logging
import re
import sys

# transformers' lazy module logs this (logger.warning_once) when a pipeline import touches
# `CLIPImageProcessor` / `SiglipImageProcessor` (diffusers' Stable Diffusion pipelines import
# the safety checker's feature extractor, and the IP-adapter's image encoder) and torchvision is
# not installed: it then uses the PIL version of the same processor. Tempera never runs an image
# processor (it trains from its own dataset code and samples without the safety checker), and
# torchvision is no dependency of ours, so the advice to install it only worries the user.
TORCHVISION_FALLBACK_LOGGER = "transformers.utils.import_utils"
TORCHVISION_FALLBACK = re.compile(
    r"`(CLIPImageProcessor|SiglipImageProcessor)` requires torchvision \(not installed\); "
    r"falling back to `\1Pil`")


class _DropTorchvisionFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return TORCHVISION_FALLBACK.match(record.getMessage()) is None


def silence_torchvision_fallback_warnings() -> None:
    """Drop exactly transformers' "CLIPImageProcessor / SiglipImageProcessor requires
    torchvision" warnings (see above); every other message of that logger still shows."""
    logger = logging.getLogger(TORCHVISION_FALLBACK_LOGGER)
    if not any(isinstance(f, _DropTorchvisionFallback) for f in logger.filters):
        logger.addFilter(_DropTorchvisionFallback())


# Importing diffusers imports torchao when it is installed (the `memory` extra, for
# model.weight_storage=FLOAT8), and that import prints, in every process, before Tempera does
# anything: one "Failed to load .../torchao/_C*.so" per CUDA kernel library when torch is a CPU
# build (those kernels cannot load without CUDA; the float8 weight storage Tempera uses needs
# none of them), torch's deprecation note about torchao registering its enums with pytree, and
# diffusers' "Unable to import `torchao` Tensor objects" (it concerns loading checkpoints saved
# as torchao tensors, which Tempera never loads). With CUDA, a kernel library that fails to
# load still shows.
TORCHAO_NOISE = (
    ("torchao", re.compile(r"Failed to load \S*torchao[/\\]_C\w*[.\w-]*\.so: ")),
    ("torch.utils._pytree", re.compile(r"<enum '\w+'> is an Enum subclass and is now natively "
                                       r"supported by torch\.compile")),
    ("diffusers.quantizers.torchao.torchao_quantizer",
     re.compile(r"Unable to import `torchao` Tensor objects")),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern[str], only_without_cuda: bool) -> None:
        super().__init__()
        self.pattern, self.only_without_cuda = pattern, only_without_cuda

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pattern.match(record.getMessage()) is None:
            return True
        if self.only_without_cuda:  # torch is imported by then: torchao imports it first
            torch = sys.modules.get("torch")
            return torch is not None and torch.version.cuda is not None
        return False


def silence_torchao_import_noise() -> None:
    """Drop exactly the messages importing torchao prints (see above); a CUDA kernel library
    that fails to load is still shown on a CUDA build of torch. Imports nothing."""
    for name, pattern in TORCHAO_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern is pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern, only_without_cuda=name == "torchao"))


def silence_library_noise() -> None:
    """Everything above: what the front ends (CLI, desktop app) call before loading a model."""
    silence_torchvision_fallback_warnings()
    silence_torchao_import_noise()
