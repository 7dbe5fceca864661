"""The captioning models, one class per kind, each loaded from a folder of weights and run on a
batch of PIL images (the `BatchModel` of modules/data/prep/job.py):

- `Florence2Captioner`: Florence-2 through transformers' native Florence2ForConditionalGeneration;
  the prompt is one of its task tokens (`<DETAILED_CAPTION>`, ...).
- `QwenVLCaptioner`: a Qwen-VL chat model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: whichever class the
  folder's config names) with a free instruction as the prompt.
- `WDTagger`: a WD v3 booru tagger (SmilingWolf's `model.onnx` + `selected_tags.csv`) through
  onnxruntime; character and general tags are scored against their own thresholds.

Which class serves which captioner name is the table `CAPTIONERS` in modules/data/prep/caption.py.
A load problem the user can fix (a damaged model file, a missing file) raises JobRefused.
"""
from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from modules.data.prep.job import JobRefused, describe_error

# The caption task tokens of Florence-2 (the others, detection and OCR, write no caption).
FLORENCE_CAPTION_TASKS = ("<CAPTION>", "<DETAILED_CAPTION>", "<MORE_DETAILED_CAPTION>")
# WD taggers' selected_tags.csv categories
WD_GENERAL, WD_CHARACTER, WD_RATING = 0, 4, 9
# Tags written with underscores that are faces, not words (kept as they are, e.g. `^_^`)
_KAOMOJI = frozenset({"0_0", "(o)_(o)", "+_+", "+_-", "._.", "<o>_<o>", "<|>_<|>", "=_=", ">_<",
                      "3_3", "6_9", ">_o", "@_@", "^_^", "o_o", "u_u", "x_x", "|_|", "||_||"})


@dataclass(frozen=True)
class RunOptions:
    """What every captioner is told: the device, the prompt, how long a caption may be, and
    the tagger's thresholds and excluded tags."""
    device: str = "cpu"                 # "cpu" or "cuda"
    prompt: str = ""
    max_tokens: int = 120
    general_threshold: float = 0.35
    character_threshold: float = 0.85
    exclude_tags: tuple[str, ...] = ()
    keep_separator: bool = False        # tags: "characters ||| general" (captions.py's KEEP)


@dataclass(frozen=True)
class Caption:
    """One image's caption; a tagger also fills the two groups of tags it came from."""
    text: str
    characters: tuple[str, ...] = ()
    general: tuple[str, ...] = ()


def _torch_dtype(device: str) -> Any:
    import torch
    if device != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class Florence2Captioner:
    """Florence-2: small (0.23 B / 0.77 B) and fast, on small cards and the CPU."""

    def __init__(self, folder: Path, options: RunOptions) -> None:
        from transformers import AutoProcessor, Florence2ForConditionalGeneration
        self.options = options
        self.dtype = _torch_dtype(options.device)
        try:
            self.processor = AutoProcessor.from_pretrained(folder)
            model = Florence2ForConditionalGeneration.from_pretrained(folder, dtype=self.dtype)
            # transformers' PreTrainedModel.to is typed as the unbound nn.Module.to
            self.model = model.to(options.device).eval()  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:
            raise JobRefused(f"cannot load Florence-2 from {folder}: {describe_error(exc)}") from exc

    def process(self, images: Sequence[Image.Image]) -> list[Caption]:
        import torch
        inputs = self.processor(text=[self.options.prompt] * len(images), images=list(images),
                                return_tensors="pt", padding=True)
        inputs = inputs.to(self.options.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=self.options.max_tokens,
                                      num_beams=3, do_sample=False)
        texts = self.processor.batch_decode(out, skip_special_tokens=True)
        return [Caption(" ".join(text.split())) for text in texts]


class QwenVLCaptioner:
    """A Qwen-VL chat model: detailed captions that follow an instruction.

    The prompt is built as Qwen's processor builds it (the folder's chat template, each image's
    `<|image_pad|>` repeated once per merged patch, the tokens' modality ids), from the image
    processor and tokenizer alone: transformers' Qwen-VL processor class also wants a video
    processor, which needs torchvision, and captions need no video."""

    def __init__(self, folder: Path, options: RunOptions) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
        self.options = options
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(folder)
            self.tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
            model = AutoModelForImageTextToText.from_pretrained(
                folder, dtype=_torch_dtype(options.device))
            # transformers' PreTrainedModel.to is typed as the unbound nn.Module.to
            self.model = model.to(options.device).eval()  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:
            raise JobRefused(f"cannot load the Qwen-VL model from {folder}: "
                             f"{describe_error(exc)}") from exc
        self.template = self.tokenizer.chat_template or _processor_chat_template(folder)
        if not self.template:
            raise JobRefused(f"{folder} holds no chat template (chat_template.json or the "
                             "tokenizer's): is it a Qwen-VL chat (Instruct) model?")
        self.image_token = "<|image_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)

    def prompt_text(self) -> str:
        messages: Any = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": self.options.prompt}]}]
        return str(self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=True))

    def process(self, images: Sequence[Image.Image]) -> list[Caption]:
        import torch
        pixels = self.image_processor(images=list(images), return_tensors="pt")
        merge = int(self.image_processor.merge_size) ** 2
        prompt = self.prompt_text()
        texts = [prompt.replace(self.image_token, self.image_token * int(grid.prod() // merge), 1)
                 for grid in pixels["image_grid_thw"]]
        tokens = self.tokenizer(texts, return_tensors="pt", padding=True)
        device = self.options.device
        inputs = {"input_ids": tokens["input_ids"].to(device),
                  "attention_mask": tokens["attention_mask"].to(device),
                  "mm_token_type_ids": (tokens["input_ids"] == self.image_token_id).int().to(device),
                  "pixel_values": pixels["pixel_values"].to(device, self.model.dtype),
                  "image_grid_thw": pixels["image_grid_thw"].to(device)}
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=self.options.max_tokens,
                                      do_sample=False)
        new = out[:, inputs["input_ids"].shape[1]:]
        return [Caption(" ".join(text.split()))
                for text in self.tokenizer.batch_decode(new, skip_special_tokens=True)]


def _processor_chat_template(folder: Path) -> str:
    """The chat template a processor keeps beside the model (chat_template.json / .jinja)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        data = json.loads((folder / "chat_template.json").read_text(encoding="utf-8"))
        return str(data.get("chat_template", "")) if isinstance(data, dict) else ""
    return ""


class WDTagger:
    """A WD v3 tagger: booru tags above a threshold, character tags apart from general ones."""

    def __init__(self, folder: Path, options: RunOptions) -> None:
        import onnxruntime as ort
        self.options = options
        model_file, tags_file = folder / "model.onnx", folder / "selected_tags.csv"
        for needed in (model_file, tags_file):
            if not needed.is_file():
                raise JobRefused(f"{folder} has no {needed.name}: is it a WD v3 tagger?")
        self.names, self.categories = read_selected_tags(tags_file)
        providers = (["CUDAExecutionProvider", "CPUExecutionProvider"]
                     if options.device == "cuda" else ["CPUExecutionProvider"])
        available = set(ort.get_available_providers())
        try:
            self.session = ort.InferenceSession(
                str(model_file), providers=[p for p in providers if p in available])
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types for a bad file
            raise JobRefused(f"the tagger's model file {model_file} is damaged or not an ONNX "
                             f"model ({describe_error(exc)}): delete it (or its cache folder) "
                             "and run again to download it again") from exc
        # said to the user by the job (caption.py): a tagger asked for the GPU that runs on the
        # CPU is a degradation, never silent
        self.notes = ([] if options.device != "cuda"
                      or "CUDAExecutionProvider" in self.session.get_providers() else
                      ["the tagger runs on the CPU: this onnxruntime has no CUDA provider "
                       "(install onnxruntime-gpu in place of onnxruntime for the GPU)"])
        shape = self.session.get_inputs()[0].shape  # [batch, height, width, 3]
        self.size = int(shape[1]) if isinstance(shape[1], int) else 448
        self.fixed_batch = shape[0] if isinstance(shape[0], int) else None
        outputs = self.session.get_outputs()[0].shape[-1]
        if isinstance(outputs, int) and outputs != len(self.names):
            raise JobRefused(f"{tags_file} lists {len(self.names)} tags but {model_file} scores "
                             f"{outputs}: the two files are from different taggers")
        self.exclude = {normalise_tag(tag) for tag in options.exclude_tags}

    def pixels(self, image: Image.Image) -> np.ndarray:
        """The tagger's input: the image padded to a white square, resized, BGR, 0..255."""
        side = max(image.size)
        square = Image.new("RGB", (side, side), (255, 255, 255))
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        resized = square.resize((self.size, self.size), Image.Resampling.BICUBIC)
        return np.asarray(resized, dtype=np.float32)[:, :, ::-1]

    def process(self, images: Sequence[Image.Image]) -> list[Caption]:
        batch = np.stack([self.pixels(image) for image in images])
        name = self.session.get_inputs()[0].name
        if self.fixed_batch == 1:
            scores = np.concatenate([self.session.run(None, {name: batch[i:i + 1]})[0]
                                     for i in range(len(batch))])
        else:
            scores = self.session.run(None, {name: batch})[0]
        return [self.caption(row) for row in np.asarray(scores, dtype=np.float32)]

    def caption(self, scores: np.ndarray) -> Caption:
        def chosen(category: int, threshold: float) -> tuple[str, ...]:
            picked = [(float(score), self.names[i]) for i, score in enumerate(scores)
                      if self.categories[i] == category and score >= threshold]
            picked.sort(key=lambda pair: (-pair[0], pair[1]))
            return tuple(name for _, name in picked if name not in self.exclude)

        characters = chosen(WD_CHARACTER, self.options.character_threshold)
        general = chosen(WD_GENERAL, self.options.general_threshold)
        if self.options.keep_separator and characters:
            text = ", ".join(characters) + " ||| " + ", ".join(general)
        else:
            text = ", ".join(characters + general)
        return Caption(text.strip(), characters, general)


def normalise_tag(tag: str) -> str:
    """A booru tag as a caption writes it: underscores to spaces (faces like ^_^ kept)."""
    tag = tag.strip()
    return tag if tag in _KAOMOJI else tag.replace("_", " ")


def read_selected_tags(path: Path) -> tuple[list[str], list[int]]:
    """(tag names, their categories) from a WD tagger's selected_tags.csv, in output order."""
    try:
        with open(path, encoding="utf-8", newline="") as file:
            rows = list(csv.DictReader(file))
        names = [normalise_tag(row["name"]) for row in rows]
        categories = [int(row["category"]) for row in rows]
    except (OSError, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise JobRefused(f"{path} is not a WD tagger's tag list (columns name and category): "
                         f"{describe_error(exc)}") from exc
    if not names:
        raise JobRefused(f"{path} lists no tags")
    return names, categories
