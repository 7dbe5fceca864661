"""Secret-looking values in a run's settings: warned about, and masked in every record.

A warning, not an error: a prompt or a caption may legitimately hold text that looks like a
token or a `password: ...` pair (a prompt about a login screen), and refusing to train over it
would block real work on a false positive. What is never allowed is writing the value down, so
every record a run writes holds the masked form instead (`masked_config`; RunRecord and
backups mask the same way). The run itself uses the value as given.
"""
from __future__ import annotations

from modules.config.loader import to_dict
from modules.config.schema import Config
from modules.util.secrets import mask_tree, tree_secrets


def secret_warnings(config: Config) -> list[str]:
    """One line per setting that holds a secret-looking value, naming the field and what the
    value looks like (masked), never the value."""
    return [f"warning: {path} looks like it holds a {kind} [{masked}]; it is used as given, but "
            "masked in config.json, run.json, backups and saved weights' metadata (secrets "
            "belong in environment variables or a secrets file, docs/cloud.md)"
            for path, kind, masked in tree_secrets(to_dict(config))]


def masked_config(config: Config) -> dict:
    """The config as a dict (`to_dict`) with every secret-looking value masked: what records
    hold."""
    return mask_tree(to_dict(config))
