"""A preparation model's weights: a local folder, or a Hugging Face repository from the user's
cache, downloaded into that cache (with progress) on first use.

    folder = model_folder("microsoft/Florence-2-base", status=print, offline=False)

- A path to an existing folder is used as it is (weights copied from another machine).
- A repository id is looked up in the Hugging Face cache first (`cache_dir`, else the one the
  user's huggingface_hub uses: `HF_HUB_CACHE` / `HF_HOME`, by default
  ~/.cache/huggingface/hub), so a model any other tool downloaded is not fetched again.
- Not cached: downloaded into that cache, `status` told the progress every few seconds
  ("downloading microsoft/Florence-2-base: 120 MB of 460 MB"). Not cached and offline
  (`offline=True`, or huggingface_hub's own `HF_HUB_OFFLINE=1`), or the download fails:
  `JobRefused` saying how to get the weights.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from modules.data.prep.job import JobRefused, describe_error

_SAY_EVERY = 2.0  # seconds between download progress lines


def model_folder(model: str, status: Callable[[str], None], *, offline: bool = False,
                 cache_dir: Path | None = None,
                 allow_patterns: Sequence[str] | None = None) -> Path:
    """The folder holding `model`'s files (see the module docstring); raises JobRefused."""
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if local.is_absolute() or model.startswith((".", "~")) or model.count("/") != 1:
        raise JobRefused(f"model {model!r} is neither a folder nor a Hugging Face repository "
                         "id such as 'microsoft/Florence-2-base'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    patterns = list(allow_patterns) if allow_patterns else None
    try:
        return Path(snapshot_download(model, cache_dir=cache_dir, local_files_only=True,
                                      allow_patterns=patterns))
    except LocalEntryNotFoundError:
        pass
    where = cache_dir or constants.HF_HUB_CACHE
    if offline or constants.HF_HUB_OFFLINE:
        raise JobRefused(offline_advice(model, where, "HF_HUB_OFFLINE is set" if not offline
                                        else "downloads are off (--offline)"))
    status(f"{model} is not in the Hugging Face cache ({where}): downloading it once")
    try:
        return Path(snapshot_download(model, cache_dir=cache_dir, allow_patterns=patterns,
                                      tqdm_class=download_bar(model, status)))
    except LocalEntryNotFoundError as exc:  # huggingface_hub found no network
        raise JobRefused(offline_advice(model, where, "there is no network")) from exc
    except Exception as exc:  # noqa: BLE001 - every download failure becomes one refusal
        raise JobRefused(f"could not download {model}: {describe_error(exc)}. Check the name "
                         "and the network (a gated model needs `hf auth login`), or "
                         f"download it where there is a network (`hf download {model}`) and "
                         f"copy the cache folder ({where}) here") from exc


def offline_advice(model: str, where: Path | str, why: str) -> str:
    """The refusal for weights that are not cached while nothing can be downloaded."""
    return (f"{model} is not in the Hugging Face cache ({where}) and cannot be downloaded "
            f"now ({why}). Run once with a network (unset HF_HUB_OFFLINE) to download it, or "
            f"on a machine with a network run `hf download {model}` and copy its cache folder "
            "here, or pass the path of a folder holding the model")


def download_bar(model: str, status: Callable[[str], None]) -> type:
    """A tqdm class for huggingface_hub's download that reports to `status` at most every
    few seconds instead of drawing on a terminal (a window has none)."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class StatusBar(hub_tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True  # no terminal drawing; `update` below reports
            super().__init__(*args, **kwargs)
            self._unit = kwargs.get("unit", "it")
            self._said = 0.0
            self._count = 0.0

        def update(self, n: float | None = 1) -> bool | None:
            self._count += n or 0
            now = time.monotonic()
            if now - self._said >= _SAY_EVERY:
                self._said = now
                status(download_line(model, self._count, self.total, self._unit))
            return super().update(n)

    return StatusBar


def download_line(model: str, done: float, total: float | None, unit: str) -> str:
    """`downloading org/name: 120 MB of 460 MB`, or in files when the bar counts files."""
    if unit == "B":
        size = f"{done / 1e6:,.0f} MB" + (f" of {total / 1e6:,.0f} MB" if total else "")
    else:
        size = f"{done:,.0f}" + (f" of {total:,.0f}" if total else "") + f" {unit}"
    return f"downloading {model}: {size}"
