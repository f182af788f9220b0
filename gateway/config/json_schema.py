"""The config's JSON Schema (``python -m gateway --print-config-schema``), describing what users
write: msgspec's schema of ``Config`` (types, constraints, defaults and every key's description
come from the Structs), widened to the shapes the loader accepts before it converts:

- null for any key that has a default (the loader drops it: null means the default), and for
  the value of a map entry;
- an endpoint given as its URL string, in ``endpoints``, ``prefill``, ``decode`` and ``combined``;
- a roleset without ``name`` (it is named ``rs-<i>`` by position);
- an empty file;
- the older flat P/D keys (``pd.abort_timeout_s`` for ``pd.sglang.abort_timeout_s``), marked
  deprecated.

What a schema cannot say (a key that needs another, a tokenizer directory that must exist, a
strategy name) is checked by ``python -m gateway --check-config FILE``.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec

from gateway.config.deprecated import MOVED_PD_KEYS, REMOVED_IN
from gateway.config.schema import Config

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ENDPOINT_LISTS = {"ModelConfig": ("endpoints",), "RolesetConfig": ("prefill", "decode", "combined")}
# keys about a property rather than its type: they stay outside when null is added to the type
_ANNOTATIONS = ("description", "default", "deprecated", "title", "examples")
_NULL = {"type": "null"}


def config_schema() -> dict[str, Any]:
    schema = msgspec.json.schema(Config)
    defs: dict[str, dict[str, Any]] = schema["$defs"]
    for d in defs.values():
        d.pop("description", None)      # the Structs' docstrings are written for developers
    for name, keys in ENDPOINT_LISTS.items():
        for key in keys:
            prop = defs[name]["properties"][key]
            prop["items"] = {"anyOf": [{"type": "string", "pattern": "^https?://",
                                        "description": "The endpoint's URL; its other keys keep their defaults."},
                                       prop["items"]]}
    defs["RolesetConfig"]["required"] = [k for k in defs["RolesetConfig"]["required"] if k != "name"]
    pd = defs["PDConfig"]["properties"]
    for key, engine in MOVED_PD_KEYS.items():
        engine_def = defs[pd[engine]["$ref"].rsplit("/", 1)[1]]
        moved = copy.deepcopy(engine_def["properties"][key])
        moved.update(description=f"Deprecated, removed in {REMOVED_IN}: write pd.{engine}.{key}.", deprecated=True)
        moved.pop("default", None)
        pd[key] = moved
    for d in defs.values():
        required = set(d.get("required", ()))
        for key, prop in d.get("properties", {}).items():
            if key not in required:
                d["properties"][key] = prop = _nullable(prop)
            _nullable_entries(prop)
    defs["Config"]["type"] = ["object", "null"]     # an empty file: every default
    out = {"$schema": DIALECT, "title": "Switchyard configuration",
           "description": "The YAML config file of the Switchyard gateway (python -m gateway --config FILE).",
           "$ref": schema["$ref"], "$defs": defs}
    return msgspec.json.decode(msgspec.json.encode(out))     # plain JSON data: lists, not tuples


def _accepts_null(s: dict[str, Any]) -> bool:
    t = s.get("type")
    return t == "null" or (isinstance(t, list) and "null" in t) or any(_accepts_null(a) for a in s.get("anyOf", ()))


def _nullable(prop: dict[str, Any]) -> dict[str, Any]:
    if _accepts_null(prop):
        return prop
    outer = {k: v for k, v in prop.items() if k in _ANNOTATIONS}
    inner = {k: v for k, v in prop.items() if k not in _ANNOTATIONS}
    if isinstance(inner.get("type"), str) and not {"enum", "$ref", "anyOf"} & inner.keys():
        return {**prop, "type": [inner["type"], "null"]}
    if "enum" in inner and not {"type", "$ref", "anyOf"} & inner.keys():
        return {**prop, "enum": [*inner["enum"], None]}
    if list(inner) == ["anyOf"]:
        return {**outer, "anyOf": [*inner["anyOf"], _NULL]}
    return {**outer, "anyOf": [inner, _NULL]}


def _nullable_entries(prop: dict[str, Any]) -> None:
    """A map's entry may be null too (dropped, like any null mapping value)."""
    for s in (prop, *prop.get("anyOf", ())):
        extra = s.get("additionalProperties")
        if isinstance(extra, dict):
            s["additionalProperties"] = _nullable(extra)
