"""Small tokenizers trained here, so tiny models need no download: the byte-pair-encoding loop
they share and the Qwen-style byte-level tokenizer (with its chat template) that the tiny
Qwen3 text encoders read. CLIP's tokenizer (modules/models/tiny_sd.py) uses the same loop.

The loop is deterministic: ties between equally frequent pairs go to the alphabetically first
(tokenizers' own BpeTrainer breaks them differently from one process to the next), so a tiny
model is byte-for-byte the same on every build.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

# The small English text the tiny tokenizers are trained on (CLIP's and Qwen's alike).
CORPUS_PATH = Path(__file__).parent / "assets" / "tiny_corpus.txt"
# Qwen's special tokens: the end of text (also the padding), a chat turn's start and end, and
# the thinking markers its chat template writes when thinking is off.
QWEN_END_OF_TEXT = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = (QWEN_END_OF_TEXT, "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# A chat template of Qwen3's form for the messages text-to-image pipelines send: each message
# as `<|im_start|>role\ncontent<|im_end|>\n`, then the assistant's turn opened; with
# `enable_thinking=False` an empty thinking block follows, as Qwen3's own template writes it.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes (CLIP and Qwen use the same), in
    the vocabulary order both use: printable bytes first, then the rest."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in printable] + [symbols[b] for b in range(256) if b not in printable]


def train_bpe_merges(words: Counter[tuple[str, ...]], max_merges: int,
                     min_frequency: int = 2) -> list[tuple[str, str]]:
    """BPE merges learned from `words` (each a tuple of symbols, with its count): the most
    frequent adjacent pair is merged, ties to the alphabetically first, until `max_merges`
    or no pair occurs `min_frequency` times."""
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for symbols, n in words.items():
            for pair in zip(symbols, symbols[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < min_frequency:
            break
        merges.append(best)
        words = Counter({merge_pair(symbols, best): n for symbols, n in words.items()})
    return merges


def merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """`symbols` with every adjacent occurrence of `pair`, left to right, joined into one."""
    out: list[str] = []
    i = 0
    while i < len(symbols):
        if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == pair:
            out.append(symbols[i] + symbols[i + 1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def qwen_words(corpus: list[str]) -> Counter[tuple[str, ...]]:
    """How often each word occurs in `corpus`, split as Qwen2Tokenizer splits text (its
    normalizer and pre-tokenizer, taken from the class itself) into byte-level symbols."""
    from transformers import Qwen2Tokenizer

    backend = Qwen2Tokenizer()._tokenizer
    words: Counter[tuple[str, ...]] = Counter()
    normalizer = backend.normalizer if backend is not None else None
    pre_tokenizer = backend.pre_tokenizer if backend is not None else None
    if normalizer is None or pre_tokenizer is None:
        raise RuntimeError("transformers' Qwen2Tokenizer has no normalizer or pre-tokenizer: "
                           "the tiny Qwen tokenizer cannot be trained like it")
    for line in corpus:
        text = normalizer.normalize_str(line)
        words.update(tuple(piece) for piece, _ in pre_tokenizer.pre_tokenize_str(text))
    return words


def build_qwen_tokenizer(dest: Path, vocab_size: int, corpus_path: Path = CORPUS_PATH) -> Any:
    """Train a small Qwen-style tokenizer (byte-level BPE, Qwen's specials and a chat template
    of Qwen3's form) and save it into `dest`; returns the loaded `Qwen2Tokenizer`.

    Padding goes on the right, as Qwen3's tokenizer pads: with a causal encoder the hidden
    states of the real tokens are then the same whatever padding follows them.
    """
    from transformers import Qwen2Tokenizer

    base = 256 + len(QWEN_SPECIAL_TOKENS)
    if vocab_size <= base:
        raise ValueError(f"vocab_size must exceed {base} (bytes + specials), got {vocab_size}")
    corpus = corpus_path.read_text(encoding="utf-8").splitlines()
    merges = train_bpe_merges(qwen_words(corpus), vocab_size - base)
    tokens = byte_symbols() + [a + b for a, b in merges]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    for special in QWEN_SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    # transformers annotates merges as strings; the tokenizers backend takes pairs too
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=list(merges),  # type: ignore[arg-type]
                               eos_token="<|im_end|>", pad_token=QWEN_END_OF_TEXT,
                               additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
                               model_max_length=32768, padding_side="right")
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(dest)
    return tokenizer
