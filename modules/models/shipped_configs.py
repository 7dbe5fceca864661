"""The architecture configs shipped in modules/models/configs/<folder>/ (each family's
`FileConventions.single_file_configs`), read as plain dicts for building random-weight models
of the real size (the benchmark's) and checking against the real architectures in tests."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"

# Keys of a shipped text encoder config that the builder fills in itself (from the locally
# trained tokenizer) or that are metadata, not architecture.
TEXT_CONFIG_DROP = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
                    "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}


def shipped_config(folder: str, component: str) -> dict[str, Any] | None:
    path = CONFIGS_DIR / folder / component / "config.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def real_component_config(folder: str, component: str,
                          fallback: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
                          fallback_source: str = "") -> tuple[dict[str, Any], str]:
    """(config, source) of a real architecture: the shipped config if present, else
    `fallback[folder][component]` (named `fallback_source`)."""
    shipped = shipped_config(folder, component)
    if shipped is not None:
        if component.startswith("text_encoder"):
            shipped = {k: v for k, v in shipped.items() if k not in TEXT_CONFIG_DROP}
        return shipped, f"modules/models/configs/{folder}/{component}/config.json"
    if fallback is None or component not in fallback.get(folder, {}):
        raise FileNotFoundError(f"{CONFIGS_DIR / folder / component / 'config.json'}: not there")
    return dict(fallback[folder][component]), fallback_source


def shipped_scheduler(folder: str) -> dict[str, Any]:
    path = CONFIGS_DIR / folder / "scheduler" / "scheduler_config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}
