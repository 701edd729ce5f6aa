"""Typed dataclasses as the one validation layer: plain data (YAML, JSON, `--set`) checked against the field
annotations, errors located (`plan.train.nproc_per_node: expected int, got 'two'`), a "did you mean" for a
misspelt field, rules as field metadata, and the JSON schema editors read.

Why our own and not pydantic or msgspec: docs/CONFIG.md (import time and messages, measured). The metadata keys:

- `doc`: what the field means (the schema's description);
- `min`, `max`: the lowest and highest allowed number (`why`: the reason, shown when one is broken);
- `choices`: the allowed values (`hint`: what they mean, shown when another is given);
- `as_str`: scalars (and list items, mapping keys and values) are accepted and turned into strings (argv, env);
- `runtime`: the field may change between segments (config/relay.py: not part of the resume contract);
- `json_schema`: the field's schema, where its annotation is `Any`.

Whatever the metadata, a number is finite (YAML's `.nan` and `.inf` are refused) and an int fits in 64 bits
(INT_LIMIT): no field means anything by them, and a value past them only fails later, as a traceback.

A dataclass validates itself in `__post_init__` with `check(self, "plan.smoke")`, so direct construction is
checked too; `build(cls, mapping, where)` reads plain data into it, nested sections and lists of them included.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchrelay.errors import ConfigError

# An int field's magnitude at most: it is written as JSON and read back as an int64 by other tools.
INT_LIMIT = 2**63 - 1
_PLAIN = re.compile(r"^[A-Za-z_][\w.\[\]]*$")
_HINTS: dict[type, dict[str, Any]] = {}


def child(where: str, name: str) -> str:
    """The location of `name` inside `where`: `plan.train`, or `plan runs/p.yaml: train` after a file name."""
    if not where:
        return name
    return f"{where}.{name}" if _PLAIN.match(where) or ": " in where else f"{where}: {name}"


def did_you_mean(name: str, known: typing.Iterable[str]) -> str:
    """'; did you mean 'x'?' for the closest known name, or ''."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of a dataclass (cached: `from __future__ import annotations` makes them
    strings)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def fields_with(cls: type, key: str) -> tuple[str, ...]:
    """The names of the fields whose metadata sets `key` (e.g. the runtime-only fields)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get(key))


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def check(obj: Any, where: str) -> None:
    """Check (and normalize, per `as_str`) every field of a dataclass instance against its annotation."""
    types_ = hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        new = value_of(value, types_[f.name], f.metadata, child(where, f.name))
        if new is not value:
            setattr(obj, f.name, new)


def build(cls: type, data: Any, where: str, hint: str | None = None) -> Any:
    """An instance of dataclass `cls` from a mapping, naming unknown (with a did-you-mean), missing and
    mistyped fields by their location; `hint` replaces the default "known fields" hint."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        first = str(unknown[0])
        more = f" (and {len(unknown) - 1} more: {unknown[1:]})" if len(unknown) > 1 else ""
        raise ConfigError(
            f"{child(where, first)}: unknown field{did_you_mean(first, fields)}{more}",
            hint=hint or f"known fields: {', '.join(sorted(fields))}",
        )
    missing = [name for name, f in fields.items() if name not in data and _required(f)]
    if missing:
        more = f" (and {len(missing) - 1} more: {missing[1:]})" if len(missing) > 1 else ""
        why = _why(fields[missing[0]].metadata)
        raise ConfigError(f"{child(where, missing[0])}: required field missing{why}{more}")
    types_ = hints(cls)
    kwargs = {k: value_of(v, types_[k], fields[k].metadata, child(where, k)) for k, v in data.items()}
    return cls(**kwargs)


def add_flags(parser: Any, cls: type, names: typing.Iterable[str]) -> None:
    """argparse options for fields of dataclass `cls` (`copy_mode` is `--copy-mode`): the type, default and
    choices from the field, the help (`doc`) and `metavar` from its metadata, so the options are declared once."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f, hint = fields[name], hints(cls)[name]
        options = [h for h in typing.get_args(hint) if h is not type(None)] or [hint]
        kw: dict[str, Any] = {"help": f.metadata.get("doc")}
        if options[0] is bool:
            kw["action"] = "store_true"
        else:
            kw.update(type=None if options[0] is str else options[0], choices=f.metadata.get("choices"))
            kw.update({"metavar": f.metadata["metavar"]} if "metavar" in f.metadata else {})
        if _required(f):
            kw["required"] = True
        else:
            kw["default"] = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        parser.add_argument("--" + name.replace("_", "-"), **kw)


def from_namespace(cls: type, namespace: Any, **given: Any) -> Any:
    """An instance of dataclass `cls` from parsed command-line flags: each field the namespace holds under its own
    name (argparse's `--copy-mode` is `copy_mode`), and `given` for the rest (a flag named otherwise)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{**{k: v for k, v in vars(namespace).items() if k in names}, **given})


def _why(meta: Mapping[str, Any]) -> str:
    text = meta.get("why") or meta.get("doc")
    return f" ({text})" if text else ""


def _name(hint: Any) -> str:
    if hint is type(None):
        return "None"
    if hint is float:
        return "a number"
    if hint is bool:
        return "true or false"
    if dataclasses.is_dataclass(hint) or typing.get_origin(hint) in (dict, Mapping):
        return "a mapping"
    if typing.get_origin(hint) is list:
        return "a list"
    return getattr(hint, "__name__", str(hint))


def value_of(value: Any, hint: Any, meta: Mapping[str, Any], where: str) -> Any:
    """`value` checked against annotation `hint` and metadata `meta` (normalized per `as_str`)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None) and _fits(value, option, meta):
                return value_of(value, option, meta, where)
        raise ConfigError(f"{where}: expected {' or '.join(map(_name, options))}, got {value!r}")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        return build(hint, {} if value is None else value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [value_of(v, item, meta, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_t, item_t = typing.get_args(hint)
        return {
            (value_of(k, key_t, meta, where) if meta.get("as_str") else k): value_of(
                v, item_t, meta, child(where, str(k))
            )
            for k, v in value.items()
        }
    if not _fits(value, hint, meta):
        raise ConfigError(f"{where}: expected {_name(hint)}, got {value!r}")
    if hint is str and not isinstance(value, str):
        value = str(value)  # as_str
    elif hint is Path and not isinstance(value, Path):
        value = Path(value)
    _bounds(value, meta, where)
    return value


def _fits(value: Any, hint: Any, meta: Mapping[str, Any]) -> bool:
    """Whether `value` is of the scalar (or container) kind `hint`; bool is never an int or a number."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str) or (bool(meta.get("as_str")) and isinstance(value, int | float))
    if hint is Path:
        return isinstance(value, str | os.PathLike)
    origin = typing.get_origin(hint) or hint
    if dataclasses.is_dataclass(origin):
        return isinstance(value, origin | Mapping)
    if origin is Mapping:
        origin = dict
    return isinstance(value, origin) if isinstance(origin, type) else True


def _bounds(value: Any, meta: Mapping[str, Any], where: str) -> None:
    why = f" ({meta['why']})" if meta.get("why") else ""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value!r}")
    low, high = meta.get("min"), meta.get("max")
    if low is not None and isinstance(value, int | float) and value < low:
        raise ConfigError(f"{where}: must be >= {low}{why}, got {value!r}")
    if high is not None and isinstance(value, int | float) and value > high:
        raise ConfigError(f"{where}: must be <= {high}{why}, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
        raise ConfigError(f"{where}: must be within +-{INT_LIMIT} (64 bits), got {value!r}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        close = did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ConfigError(
            f"{where}: must be one of {', '.join(map(repr, choices))}, got {value!r}{close}",
            hint=meta.get("hint"),
        )


# ------------------------------------------------------------------------------------------------ JSON schema
def json_schema(cls: type, title: str, description: str) -> dict[str, Any]:
    """A JSON schema (draft 2020-12) of dataclass `cls` and the dataclasses it holds, for editors."""
    defs: dict[str, Any] = {}
    root = _object_schema(cls, defs)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "description": description,
        **root,
        **({"$defs": dict(sorted(defs.items()))} if defs else {}),
    }


def _object_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    types_ = hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        prop = _schema_of(types_[f.name], f.metadata, defs)
        if f.metadata.get("doc"):
            prop = {"description": f.metadata["doc"], **prop}
        default = _default(f)
        if default is not dataclasses.MISSING:
            prop["default"] = default
        props[f.name] = prop
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    required = [f.name for f in dataclasses.fields(cls) if _required(f)]
    if cls.__doc__:
        out = {"description": cls.__doc__.strip(), **out}
    return {**out, "required": required} if required else out


def _default(f: dataclasses.Field[Any]) -> Any:
    value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(value):
        return dataclasses.MISSING  # a section's defaults are in its own properties
    return (
        value if value is dataclasses.MISSING or isinstance(value, str | int | float | list | dict) else None
    )


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "string"}


def _schema_of(hint: Any, meta: Mapping[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "json_schema" in meta:
        return dict(meta["json_schema"])
    origin = typing.get_origin(hint)
    if hint is Any:
        return {}
    if origin in (types.UnionType, typing.Union):
        return {"anyOf": [_schema_of(h, meta, defs) for h in typing.get_args(hint)]}
    if hint is type(None):
        return {"type": "null"}
    if dataclasses.is_dataclass(hint):
        name = typing.cast(type, hint).__name__
        if name not in defs:
            defs[name] = {}  # a placeholder first: a dataclass that holds itself terminates
            defs[name] = _object_schema(typing.cast(type, hint), defs)
        return {"$ref": f"#/$defs/{name}"}
    if origin is list:
        return {"type": "array", "items": _schema_of(typing.get_args(hint)[0], meta, defs)}
    if origin in (dict, Mapping):
        return {"type": "object", "additionalProperties": _schema_of(typing.get_args(hint)[1], meta, defs)}
    out: dict[str, Any] = {"type": _JSON_TYPES[hint]}
    if hint is str and meta.get("as_str"):
        out["type"] = ["string", "integer", "number"]
    if meta.get("min") is not None:
        out["minimum"] = meta["min"]
    if meta.get("max") is not None:
        out["maximum"] = meta["max"]
    if meta.get("choices") is not None:
        out["enum"] = list(meta["choices"])
    return out
