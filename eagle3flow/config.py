"""The workflow's configuration: typed from the command line, validated against the schema.

``snakemake --config key=value`` parses a nested value with YAML's BaseLoader, so every
scalar inside it arrives as a string (``--config "train={epochs: 5}"`` gives
``{"epochs": "5"}``) and the schema would refuse it. :func:`coerce_to_schema` turns such
strings into what the schema says the key holds (integer, number, boolean, null, array,
object) before validation; a string where the schema wants a string stays one.
"""
from __future__ import annotations

import yaml

SCALARS = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None)}


def _types(schema: dict) -> list[str]:
    kind = schema.get("type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def coerce_to_schema(value, schema: dict):
    """``value`` with strings the schema does not allow parsed as YAML, recursively."""
    kinds = _types(schema)
    if isinstance(value, dict):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        return {k: coerce_to_schema(v, properties.get(k) or (extra if isinstance(extra, dict) else {}))
                for k, v in value.items()}
    if isinstance(value, list):
        return [coerce_to_schema(v, schema.get("items") or {}) for v in value]
    if isinstance(value, str) and kinds and "string" not in kinds:
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return coerce_to_schema(parsed, schema)
    return value


def coerce_config(config: dict, schema_path: str) -> None:
    """In place, for the Snakefile: the config as the schema types it."""
    with open(schema_path) as f:
        schema = yaml.safe_load(f)
    config.update(coerce_to_schema(dict(config), schema))
