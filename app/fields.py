"""The GUI reads the schema through the engine's walker (`modules.config.introspect`)."""
from modules.config.introspect import KINDS, FieldInfo, container_labels, field_map, iter_fields

__all__ = ["KINDS", "FieldInfo", "container_labels", "field_map", "iter_fields"]
