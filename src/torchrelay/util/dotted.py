"""Nested mappings as dotted keys: {'a': {'b': 1}} <-> {'a.b': 1}."""

from __future__ import annotations

from typing import Any


def flatten(obj: dict[str, Any], prefix: str = "", *, keep_empty: bool = True) -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values; an empty mapping stays a value unless keep_empty=False."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and (value or not keep_empty):
            out.update(flatten(value, name + ".", keep_empty=keep_empty))
        else:
            out[name] = value
    return out
