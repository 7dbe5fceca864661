"""The secret table below the config and the engine: finding and masking secret-looking values
in a run's settings, never echoing them."""
from __future__ import annotations

from modules.util.secrets import find_secrets, mask_secrets, mask_tree, tree_secrets

HF = "hf_" + "a1B2" * 9           # 39 characters, the shape of a Hugging Face token
OPENAI = "sk-" + "Zy9x" * 10


def test_masking_replaces_each_secret_and_keeps_the_rest():
    text = f"a castle at dusk {HF}, password=hunter22, {OPENAI} and ${{HF_TOKEN}}"
    masked = mask_secrets(text)
    assert HF not in masked and OPENAI not in masked and "hunter22" not in masked
    assert masked == ("a castle at dusk [masked Hugging Face token], password=[masked secret], "
                      "[masked OpenAI-style API key] and ${HF_TOKEN}")


def test_ordinary_prompts_are_left_alone():
    for text in ("a red circle on a blue background", "tokenizer_path=/models/clip",
                 "password: ${PASSWORD}", "commit 0123456789abcdef0123456789abcdef01234567"):
        assert mask_secrets(text) == text and not find_secrets(text)


def test_tree_secrets_name_the_field_and_never_the_value():
    tree = {"sampling": {"prompts": ["a cat", f"a dog {HF}"]}, "model": {"path": "/m"}}
    found = tree_secrets(tree)
    assert found == [("sampling.prompts[1]", "Hugging Face token", "hf_…(39 chars)")]
    assert HF not in repr(found)
    assert mask_tree(tree) == {"sampling": {"prompts": ["a cat", "a dog [masked Hugging Face "
                                                       "token]"]}, "model": {"path": "/m"}}
