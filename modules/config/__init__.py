"""The typed config tree (schema), its strict loader, migrations, overrides and validation."""
from modules.config.loader import (
    from_dict,
    load_config,
    relativize_paths,
    resolve_paths,
    save_config,
    sparse_dict,
    to_dict,
)
from modules.config.overrides import apply_overrides
from modules.config.problems import ConfigError, Problem
from modules.config.schema import Config
from modules.config.validate import validate

__all__ = [
    "Config", "ConfigError", "Problem", "apply_overrides", "from_dict", "load_config",
    "relativize_paths", "resolve_paths", "save_config", "sparse_dict", "to_dict", "validate",
]
