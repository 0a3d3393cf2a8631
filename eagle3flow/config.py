"""The workflow's configuration: the schema is the one home of every default.

``schemas/config.schema.yaml`` describes every key and holds its default; the stages'
modules read their defaults from it (:func:`schema_defaults`), so a default cannot
differ between the workflow and a stage called by hand.

``snakemake --config key=value`` parses a nested value with YAML's BaseLoader, so every
scalar inside it arrives as a string (``--config "train={epochs: 5}"`` gives
``{"epochs": "5"}``) and the schema would refuse it. :func:`coerce_to_schema` turns such
strings into what the schema says the key holds (integer, number, boolean, null, array,
object) before validation; a string where the schema wants a string stays one.
"""
from __future__ import annotations

import functools
from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "config.schema.yaml"
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
        # what still is a string is left for the schema's validation to refuse
        return value if isinstance(parsed, str) else coerce_to_schema(parsed, schema)
    return value


def coerce_config(config: dict, schema_path: str) -> None:
    """In place, for the Snakefile: the config as the schema types it."""
    with open(schema_path) as f:
        schema = yaml.safe_load(f)
    config.update(coerce_to_schema(dict(config), schema))


@functools.cache
def _schema() -> dict:
    with open(SCHEMA) as f:
        return yaml.safe_load(f)


def schema_defaults(section: str) -> dict:
    """``{key: default}`` of one top-level section of the schema (a fresh copy)."""
    import copy

    properties = _schema()["properties"][section]["properties"]
    return {key: copy.deepcopy(spec.get("default")) for key, spec in properties.items()}
