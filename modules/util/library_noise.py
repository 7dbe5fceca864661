"""Library messages that mean nothing to a Tempera user, silenced one by one in named functions
that the front ends (the CLI, the desktop app) call explicitly. Nothing here runs at import."""
from __future__ import annotations

import logging
import re

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
