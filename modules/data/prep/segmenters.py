"""The two mask makers, each a `BatchModel` for the folder job (job.py): one image in, the
probability (H, W, in [0, 1]) that each pixel belongs to what is kept.

- **CLIPSeg** (transformers' `CLIPSegForImageSegmentation`): a text prompt says what to keep
  ("person", "the dog"); several prompts keep the union (each pixel's highest probability).
  Weights: a folder, or a Hugging Face repository from the user's cache (hub.py).
- **A background remover** (rembg, on onnxruntime): keeps the salient subject, no prompt. Its
  models are rows of `BACKGROUND_MODELS`; rembg downloads one into its own folder (~/.rembg)
  on first use, or `model_file` names an .onnx file of that kind already on disk.

Loading raises `JobRefused` for what the user must fix (weights not there while offline, a
damaged model file), before any mask is written.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from modules.data.prep.job import JobRefused, describe_error

DEFAULT_CLIPSEG = "CIDAS/clipseg-rd64-refined"


@dataclass(frozen=True)
class BackgroundModel:
    """One of rembg's models: its session name there, what it is for, its download size."""
    name: str
    use: str
    megabytes: int


# rembg's session names (rembg.sessions.sessions), with what each is good at. The first is the
# default: a good general model of moderate size.
BACKGROUND_MODELS: tuple[BackgroundModel, ...] = (
    BackgroundModel("isnet-general-use", "any subject; sharp edges; the default", 179),
    BackgroundModel("u2net", "any subject; the classic, softer edges", 176),
    BackgroundModel("u2netp", "any subject; small and fast, rougher", 5),
    BackgroundModel("u2net_human_seg", "people", 176),
    BackgroundModel("isnet-anime", "anime and illustrated characters", 176),
    BackgroundModel("birefnet-general", "any subject; the finest edges, slow", 973),
    BackgroundModel("birefnet-portrait", "portraits, with hair", 973),
)
BACKGROUND_NAMES = tuple(model.name for model in BACKGROUND_MODELS)


class ClipSegMasker:
    """CLIPSeg with its prompts encoded once: `process(images)` -> one probability map each."""

    def __init__(self, model: Any, processor: Any, prompts: Sequence[str], device: str) -> None:
        import torch

        self.model, self.processor, self.device = model, processor, device
        self.prompts = list(prompts)
        text = processor.tokenizer(self.prompts, padding=True, return_tensors="pt")
        with torch.inference_mode():
            self.prompt_embeddings = model.get_conditional_embeddings(
                batch_size=len(self.prompts), input_ids=text["input_ids"].to(device),
                attention_mask=text["attention_mask"].to(device))

    def process(self, images: Sequence[Image.Image]) -> list[np.ndarray]:
        import torch

        pixels = self.processor.image_processor(list(images), return_tensors="pt")
        pixels = pixels["pixel_values"].to(self.device, self.model.dtype)
        n_prompts = len(self.prompts)
        with torch.inference_mode():
            logits = self.model(pixel_values=pixels.repeat_interleave(n_prompts, dim=0),
                                conditional_embeddings=self.prompt_embeddings.repeat(
                                    len(images), 1)).logits
        probabilities = torch.sigmoid(logits.float()).reshape(len(images), n_prompts,
                                                                *logits.shape[-2:])
        # Several prompts: a pixel is kept when any prompt keeps it.
        return list(probabilities.amax(dim=1).cpu().numpy())

    def close(self) -> None:
        self.model = self.processor = self.prompt_embeddings = None


def load_clipseg(model: str, prompts: Sequence[str], status: Callable[[str], None], *,
                 offline: bool = False, device: str | None = None,
                 cache_dir: Path | None = None) -> ClipSegMasker:
    """CLIPSeg from a folder or a Hugging Face repository id, on `device` (the GPU when there
    is one), ready for `prompts`. Raises JobRefused."""
    import torch
    from transformers import CLIPSegForImageSegmentation, CLIPSegProcessor

    from modules.data.prep.hub import model_folder

    if not [p for p in prompts if p.strip()]:
        raise JobRefused("CLIPSeg needs a prompt that says what to keep, e.g. --prompt person")
    folder = model_folder(model, status, offline=offline, cache_dir=cache_dir)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    status(f"loading CLIPSeg from {folder} on {device}")
    try:
        processor = CLIPSegProcessor.from_pretrained(folder)
        network = CLIPSegForImageSegmentation.from_pretrained(
            folder, dtype=torch.float16 if device.startswith("cuda") else torch.float32)
    except Exception as exc:  # noqa: BLE001 - any load failure is the model files' problem
        raise JobRefused(f"cannot load CLIPSeg from {folder}: {describe_error(exc)}; the "
                         "files may be damaged or not a CLIPSeg model: download them again "
                         "(delete the folder from the Hugging Face cache) or pick another "
                         "folder") from exc
    # transformers types PreTrainedModel.to as nn.Module.to unbound (functools.wraps)
    network.to(device).eval()  # type: ignore[arg-type]
    return ClipSegMasker(network, processor, [p.strip() for p in prompts if p.strip()], device)


class BackgroundMasker:
    """A rembg session: `process(images)` -> one probability map each (rembg's models take one
    image at a time)."""

    def __init__(self, session: Any) -> None:
        self.session = session

    def process(self, images: Sequence[Image.Image]) -> list[np.ndarray]:
        out = []
        for image in images:
            predicted = self.session.predict(image)[0]  # an 8-bit L image of the image's size
            out.append(np.asarray(predicted, dtype=np.float32) / 255.0)
        return out

    def close(self) -> None:
        self.session = None


def background_model(name: str) -> BackgroundModel:
    """The row of `BACKGROUND_MODELS` called `name`; JobRefused listing them when none is."""
    for model in BACKGROUND_MODELS:
        if model.name == name:
            return model
    raise JobRefused(f"unknown background model {name!r}; pick one of "
                     f"{', '.join(BACKGROUND_NAMES)}")


def load_background(name: str, status: Callable[[str], None], *, model_file: Path | None = None,
                    offline: bool = False, device: str | None = None) -> BackgroundMasker:
    """rembg's model `name` (downloaded into rembg's folder on first use), or the .onnx file
    `model_file` of that kind. On the GPU when onnxruntime has CUDA (the onnxruntime-gpu
    package) unless `device` is "cpu". Raises JobRefused."""
    row = background_model(name)
    from rembg.sessions import sessions

    session_class = sessions[row.name]
    if model_file is not None:
        model_file = Path(model_file).expanduser()
        if not model_file.is_file():
            raise JobRefused(f"the background model file {model_file} does not exist")
        session_class = local_file_session(session_class, model_file)
        source = str(model_file)
    else:
        source = _rembg_model_path(session_class, row, status, offline)
    status(f"loading the background remover {row.name} from {source}")
    try:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # rembg's constructor downloads when the file is missing; it is there by now.
        # rembg picks CUDA when onnxruntime offers it; a list of providers overrides that.
        providers = {"providers": ["CPUExecutionProvider"]} if device == "cpu" else {}
        session = session_class(row.name, options, **providers)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's load errors are the file's
        raise JobRefused(f"cannot load the background model {source}: {describe_error(exc)}; "
                         "the file may be damaged or of another kind: delete it and run again "
                         "to download it anew, or name a good copy") from exc
    on_gpu = "CUDAExecutionProvider" in session.inner_session.get_providers()
    status(f"the background remover runs on {'the GPU' if on_gpu else 'the CPU'}")
    return BackgroundMasker(session)


def local_file_session(session_class: type, model_file: Path) -> type:
    """`session_class` loading `model_file` instead of rembg's own download: rembg refuses a
    custom model outside its folder (~/.rembg), and a dataset's tool should take any path."""
    path = str(model_file)

    def download_models(cls: type, *args: Any, **kwargs: Any) -> str:
        return path

    return type(f"Local{session_class.__name__}", (session_class,),
                {"download_models": classmethod(download_models)})


def _rembg_model_path(session_class: Any, row: BackgroundModel, status: Callable[[str], None],
                      offline: bool) -> str:
    """Where rembg keeps model `row`, downloading it there first (rembg's own download, with
    its checksum) unless offline."""
    from huggingface_hub import constants

    fname = f"{row.name}.onnx"
    existing = session_class.resolve_existing(fname)
    if existing is not None:
        return str(existing)
    folder = session_class.model_dir()
    if offline or constants.HF_HUB_OFFLINE:
        raise JobRefused(f"the background model {row.name} is not downloaded ({folder} holds "
                         "no copy) and downloads are off: run once with a network, or copy "
                         f"{fname} there from a machine that has it, or name the file with "
                         "--model-file")
    status(f"downloading the background model {row.name} ({row.megabytes} MB) into {folder} "
           "once")
    try:
        return str(session_class.download_models())
    except Exception as exc:  # noqa: BLE001 - every download failure becomes one refusal
        raise JobRefused(f"could not download the background model {row.name}: "
                         f"{describe_error(exc)}; check the network, or copy {fname} into "
                         f"{folder} from a machine that has it") from exc
