"""Tiny random-weight captioners built here, so the caption tests never download: a Florence-2
and a Qwen3-VL of transformers' own classes with small tokenizers trained on the tiny corpus
(modules/models/tiny_text.py), and a WD-v3-shaped tagger: an ONNX graph built with `onnx`
that scores each tag from the image's mean colour, with its selected_tags.csv.

Each builds in well under a second or two; the tests share them through a module fixture.
`put_in_cache` lays files out as the Hugging Face cache holds a downloaded repository.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from modules.models.tiny_text import CORPUS_PATH, byte_symbols, qwen_words, train_bpe_merges

# The random tiny models may end a caption at once: they are told to write a few tokens at
# least, in their generation_config.json (the real models' own settings are left alone).
TINY_MIN_TOKENS = 4

# The tiny tagger's tags: (name, category, weights on (blue, green, red) in 0..1, bias).
# The input is BGR, as the WD taggers take it, so a red image lights the red weight.
TAGGER_TAGS = [
    ("general", 9, (0.0, 0.0, 0.0), 4.0),               # a rating: never written
    ("1girl", 0, (0.0, 0.0, 0.0), 3.0),                 # ~0.95 for every image
    ("simple_background", 0, (0.0, 0.0, 0.0), 0.0),    # 0.5: above 0.35, below 0.6
    ("red_theme", 0, (-4.0, -4.0, 8.0), -2.0),
    ("green_theme", 0, (-4.0, 8.0, -4.0), -2.0),
    ("^_^", 0, (0.0, 0.0, 0.0), 2.0),                   # a face: its underscore is kept
    ("hatsune_miku", 4, (-8.0, 12.0, -8.0), -3.0),      # a character, on green images
    ("hakurei_reimu", 4, (-8.0, -8.0, 12.0), -3.0),     # a character, on red images
]


def _bart_tokenizer():
    from transformers import RobertaTokenizer
    words: Counter[tuple[str, ...]] = Counter()
    for line in CORPUS_PATH.read_text(encoding="utf-8").splitlines():
        for word in line.split():
            words[tuple("Ġ" + word)] += 1
    merges = train_bpe_merges(words, 200)
    tokens = ["<s>", "<pad>", "</s>", "<unk>", *byte_symbols(), *(a + b for a, b in merges)]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    vocab["<image>"] = len(vocab)
    return RobertaTokenizer(vocab=vocab, merges=list(merges),  # type: ignore[arg-type]
                            extra_special_tokens={"image_token": "<image>"})


def build_tiny_florence2(dest: Path) -> Path:
    """A Florence-2 (DaViT + BART) of a few thousand weights with its processor, in `dest`."""
    import torch
    from transformers import (CLIPImageProcessorPil, Florence2Config,
                              Florence2ForConditionalGeneration, Florence2Processor)
    tokenizer = _bart_tokenizer()
    # 32 px, stride 4: 8 x 8 patches, plus the pooled one
    images = CLIPImageProcessorPil(size={"height": 32, "width": 32}, do_center_crop=False,
                                   image_seq_length=65)
    processor = Florence2Processor(image_processor=images, tokenizer=tokenizer)
    config = Florence2Config(
        text_config=dict(model_type="bart", vocab_size=len(tokenizer), max_position_embeddings=512,
                         encoder_layers=1, encoder_ffn_dim=16, decoder_layers=1,
                         decoder_ffn_dim=16, encoder_attention_heads=1,
                         decoder_attention_heads=1, d_model=16, eos_token_id=2, bos_token_id=0,
                         pad_token_id=1, decoder_start_token_id=2, forced_eos_token_id=2),
        vision_config=dict(patch_size=[7], depths=[1], patch_stride=[4], patch_padding=[3],
                           patch_prenorm=[False], embed_dim=[16], num_heads=[1], num_groups=[1],
                           window_size=4, projection_dim=16),
        image_token_id=tokenizer.image_token_id)
    torch.manual_seed(0)
    model = Florence2ForConditionalGeneration(config).eval()
    model.generation_config.min_new_tokens = TINY_MIN_TOKENS
    model.save_pretrained(dest)
    processor.save_pretrained(dest)
    return dest


# Qwen-VL's chat template, in the form its processor renders one user turn with an image
QWEN_VL_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
QWEN_VL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                    "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny_qwen_vl(dest: Path, template_beside: bool = True) -> Path:
    """A Qwen3-VL of a few thousand weights with its image processor and tokenizer; its chat
    template in chat_template.json as Qwen's repositories keep it (or in the tokenizer)."""
    import json

    import torch
    from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    merges = train_bpe_merges(qwen_words(CORPUS_PATH.read_text(encoding="utf-8").splitlines()),
                              200)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(byte_symbols() + [a + b for a, b in merges]))}
    for special in QWEN_VL_SPECIALS:
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(merges),  # type: ignore[arg-type]
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=list(QWEN_VL_SPECIALS[1:]))
    if not template_beside:
        tokenizer.chat_template = QWEN_VL_TEMPLATE
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                      min_pixels=32 * 32, max_pixels=64 * 64)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                         pad_token_id=vocab["<|endoftext|>"]),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=32, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"])
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.generation_config.pad_token_id = vocab["<|endoftext|>"]
    model.generation_config.min_new_tokens = TINY_MIN_TOKENS
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    images.save_pretrained(dest)
    if template_beside:
        (dest / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_VL_TEMPLATE}))
    return dest


def build_tiny_wd_tagger(dest: Path, size: int = 32, batch: int | str = "batch") -> Path:
    """model.onnx (NHWC BGR 0..255 in, one sigmoid score per tag out; `batch` images at a time,
    any number by default, or a fixed 1 as some exports have) and selected_tags.csv, laid out as
    SmilingWolf's WD v3 taggers are."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    weights = np.array([w for _, _, w, _ in TAGGER_TAGS], dtype=np.float32).T / 255.0  # (3, T)
    bias = np.array([b for *_, b in TAGGER_TAGS], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input", "axes"], ["mean"], keepdims=0),
         helper.make_node("MatMul", ["mean", "weights"], ["logits"]),
         helper.make_node("Add", ["logits", "bias"], ["biased"]),
         helper.make_node("Sigmoid", ["biased"], ["output"])],
        "tiny_wd_tagger",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, size, size, 3])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT,
                                       [batch, len(TAGGER_TAGS)])],
        [numpy_helper.from_array(np.array([1, 2], dtype=np.int64), "axes"),
         numpy_helper.from_array(weights, "weights"), numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    dest.mkdir(parents=True, exist_ok=True)
    onnx.save(model, dest / "model.onnx")
    lines = ["tag_id,name,category,count"] + [f"{i},{name},{category},{1000 - i}"
                                              for i, (name, category, *_) in
                                              enumerate(TAGGER_TAGS)]
    (dest / "selected_tags.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


# The commit a cached repository is laid out under (any 40 hex digits)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_cache(cache: Path, repo: str, files: dict[str, str]) -> Path:
    """Lay `files` out as huggingface_hub's cache holds a downloaded repository."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    return snapshot
