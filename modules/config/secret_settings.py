"""Secret-looking values in a run's settings: warned about, and masked in every record.

A warning, not an error: a prompt or a caption may legitimately hold text that looks like a
token or a `password: ...` pair (a prompt about a login screen), and refusing to train over it
would block real work on a false positive. What is never allowed is writing the value down, so
every record a run writes holds the masked form instead (`masked_config`; RunRecord and
backups mask the same way). The run itself uses the value as given.
"""
from __future__ import annotations

import re

from modules.config.loader import from_dict, path_fields, to_dict
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


def shared_name(value: str) -> str:
    """A path reduced to its last part (a folder's or a file's name; `builtin:` names and
    empty values as they are): what a shared file may say of a local path."""
    if not value or value.startswith("builtin:"):
        return value
    return re.split(r"[\\/]", value.rstrip("\\/"))[-1] or value


def shared_config(config: Config) -> dict:
    """The config as saved weights carry it (`tempera.config`): masked as every record is,
    and every path reduced to its name, since a shared file must not tell others the
    trainer's folders (or user name). run.json and config.json, local records, keep paths."""
    copy = from_dict(to_dict(config))
    for owner, name, _ in path_fields(copy):
        setattr(owner, name, shared_name(getattr(owner, name)))
    return mask_tree(to_dict(copy))
