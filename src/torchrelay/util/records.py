"""The one reader of every record torchrelay keeps on disk: JSON and JSONL lines here, YAML plans in yaml_records.py,
safetensors headers in safetensors_records.py.

Every byte of a run directory, a bundle or a plan may come from elsewhere (another cluster, a hand edit, a
forger), so a reader here opens the file through `safepath.read_regular` (no symlink out of its root, no pipe or
device, bounded size), parses it within bounds (size, line length, nesting depth) and checks it against the
record's small schema before a caller touches a field. Whatever is wrong is one `RecordError` naming the file (and
the line and field) and what to do: exit 2, never a RecursionError, TypeError or SafetensorError traceback.

The bounds (docs/FORMATS.md):
- a JSON file at most JSON_LIMIT bytes, a JSONL line at most LINE_LIMIT, a YAML plan at most YAML_LIMIT;
- a YAML plan's aliases (`*name`) add at most ALIAS_LIMIT values to the document, and none holds itself; no key
  is repeated in a mapping (YAML would keep the last silently);
- a field a schema checks holds no integer past 64 bits (schema.INT_LIMIT);
- nesting at most DEPTH_LIMIT deep (torchrelay's deepest record, a stateful's tree, is a few dozen levels);
- a safetensors header at most SAFETENSORS_HEADER_LIMIT bytes (safetensors' own bound), its tensors laid out
  back to back exactly as safetensors writes them, each of its dtype's size, inside the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrelay.errors import RecordError
from torchrelay.util.safepath import read_regular
from torchrelay.util.schema import INT_LIMIT

JSON_LIMIT = 256 << 20  # no JSON file torchrelay writes comes near this
LINE_LIMIT = 64 << 20  # nor a JSONL line
YAML_LIMIT = 16 << 20  # a plan is a page
DEPTH_LIMIT = (
    200  # below Python's recursion limit with room for the recursive readers of a tree (state/trees.py)
)
# What aliases may add to a plan: a page's worth of reuse (`<<: *defaults`); 700 bytes of nested aliases expand to
# 10^9 values, which every reader of the plan (the depth check first) would walk.
ALIAS_LIMIT = 100_000
SAFETENSORS_HEADER_LIMIT = 100_000_000  # what safetensors itself refuses above
DAMAGED_HINT = "the file is damaged or not what it should be; restore it from a copy"


# --- JSON -----------------------------------------------------------------------------------------------------


def parse_json(data: bytes | str, *, source: str, depth: int = DEPTH_LIMIT) -> Any:
    """JSON from bytes or text that may come from elsewhere: one RecordError naming `source` for bytes that are
    not UTF-8, bad syntax, numbers too long to convert, or nesting deeper than `depth`."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise RecordError(
            source, f"not UTF-8 text ({exc.reason} at byte {exc.start})", hint=DAMAGED_HINT
        ) from None
    try:
        doc = json.loads(text)
    except RecursionError:  # nesting past the C parser's own bound: the same refusal as past ours
        raise RecordError(source, f"nested deeper than {depth} levels", hint=DAMAGED_HINT) from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more digits than Python converts
        raise RecordError(source, f"not valid JSON ({str(exc)[:200]})", hint=DAMAGED_HINT) from None
    # A document with fewer brackets than the bound cannot be deeper: most are, and cost one count.
    if text.count("[") + text.count("{") > depth and depth_of(doc, depth) > depth:
        raise RecordError(source, f"nested deeper than {depth} levels", hint=DAMAGED_HINT)
    return doc


def depth_of(doc: Any, limit: int) -> int:
    """How deep containers nest in `doc` (iteratively, stopping past `limit`)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children: Iterable[Any] = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, level)
        if deepest > limit:
            return deepest
        stack.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def read_bounded(
    path: str | os.PathLike[str], limit: int, *, what: str, root: str | os.PathLike[str] | None = None
) -> bytes:
    """The bytes of the regular file `path` (at most `limit`), opened the one safe way (safepath.read_regular)."""
    return read_regular(path, limit, what=what, root=root)


def read_json(
    path: str | os.PathLike[str],
    *,
    what: str,
    limit: int = JSON_LIMIT,
    root: str | os.PathLike[str] | None = None,
    schema: Mapping[str, Any] | None = None,
) -> Any:
    """A JSON file read as untrusted input: opened safely, bounded, parsed within depth, and, with `schema`, an
    object whose fields have their types (`check`). A missing file raises FileNotFoundError for the caller."""
    source = f"{path} ({what})"
    doc = parse_json(read_regular(path, limit, what=what, root=root), source=source)
    return check(doc, schema, source=source) if schema is not None else doc


def read_json_or_none(
    path: str | os.PathLike[str],
    *,
    what: str,
    root: str | os.PathLike[str] | None = None,
    limit: int = 1 << 24,
) -> Any:
    """A JSON file whose absence or damage only means "unknown" (a cache, a note): None then, read the same
    guarded way (no link, no pipe, bounded) otherwise."""
    from torchrelay.errors import RelayError

    try:
        return read_json(path, what=what, root=root, limit=limit)
    except (OSError, RelayError):
        return None


# --- schemas: the fields a record must have, their types and their ranges ---------------------------------------

# A string field's length at most, unless its rule says otherwise: an id, a name, a digest, a host, a line of text.
STRING_LIMIT = 4096
# An array field's items at most, unless its rule says otherwise.
ITEMS_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class Optional:
    """A field that may be absent (and, when it is there, has one of `types`, or follows a `Field`)."""

    types: Any  # a type, a tuple of types, [type] or a Field


@dataclass(frozen=True, slots=True)
class Field:
    """A field's whole rule: its types and what its value may be. A number is finite, within [low, high] and
    above `above`; a string at most `length` characters (and with `path`, a relative path that stays inside its
    root: no absolute path, no `..`, no NUL); an array at most `items` items, each following this rule; an object
    at most `size` bytes of JSON, its own fields checked by `fields` (a Schema), or, as a map of at most `items`
    entries, each key by `keys` and each value by `values`. Types as in `check`."""

    types: Any
    low: float | None = None
    high: float | None = None
    above: float | None = None
    length: int = STRING_LIMIT
    items: int = ITEMS_LIMIT
    path: bool = False
    size: int | None = None
    fields: Mapping[str, Any] | None = None
    choices: tuple[Any, ...] | None = None
    keys: Field | None = None  # an object that maps names (at most `items`) to values: each key's rule
    values: Field | None = None  # and each value's


class Schema(dict[str, Any]):
    """A record's fields and their rules (see `check`), with its required fields worked out once: a log of
    200,000 records is checked at the cost of the fields each holds. `prefixes`: the rule of a field not named
    but whose name starts with one of them (a contract's `params.lr`, `versions.numpy`)."""

    def __init__(self, fields: Mapping[str, Any], prefixes: Mapping[str, Any] | None = None) -> None:
        super().__init__(fields)
        self.required = tuple(name for name, rule in fields.items() if not isinstance(rule, Optional))
        self.prefixes = dict(prefixes or {})


def check(
    doc: Any, schema: Mapping[str, Any], *, source: str, line: int | None = None, prefix: str = ""
) -> dict[str, Any]:
    """`doc` as a JSON object with every field of `schema` present and of its type, else one RecordError naming
    `source`, `line` and the field. A rule is a type, a tuple of types, `[type]` (an array of such values), a
    `Field` (types and range) or `Optional(rule)` (may be absent); an int is never a bool, a float may be an int.
    `prefix`: where `doc` lies in its record (`layout_change.to.`), for the field's name."""
    if not isinstance(doc, dict):
        if prefix:
            raise RecordError(
                source,
                f"a JSON {kind_of(doc)}, not an object",
                line=line,
                field=prefix[:-1],
                hint=DAMAGED_HINT,
            )
        raise RecordError(source, f"holds a JSON {kind_of(doc)}, not an object", line=line, hint=DAMAGED_HINT)
    required = schema.required if isinstance(schema, Schema) else Schema(schema).required
    for name in required:
        if name not in doc:
            raise RecordError(source, "missing", line=line, field=prefix + name, hint=DAMAGED_HINT)
    prefixes = schema.prefixes if isinstance(schema, Schema) else {}
    for name in doc if prefixes or len(doc) <= len(schema) else schema:
        rule = schema.get(name) if name in doc else None
        if rule is None and prefixes and name in doc:
            rule = next((r for p, r in prefixes.items() if name.startswith(p)), None)
        if rule is None:
            continue
        types = rule.types if isinstance(rule, Optional) else rule
        value, where = doc[name], prefix + name
        if isinstance(types, Field):
            _check_field(value, types, source=source, line=line, where=where)
            continue
        if _past_64_bits(value):
            raise RecordError(
                source,
                f"an integer of {len(str(abs(value)))} digits, past 64 bits",
                line=line,
                field=where,
                hint=DAMAGED_HINT,
            )
        if not _is(value, types):
            raise RecordError(
                source,
                f"a JSON {kind_of(value)}, not {_names(types)}",
                line=line,
                field=where,
                hint=DAMAGED_HINT,
            )
    return doc


def _check_field(value: Any, rule: Field, *, source: str, line: int | None, where: str) -> None:
    """One value against its Field rule: RecordError naming the field and what is wrong with the value."""

    def refuse(problem: str) -> RecordError:
        return RecordError(source, problem, line=line, field=where, hint=DAMAGED_HINT)

    if _past_64_bits(value):
        raise refuse(f"an integer of {len(str(abs(value)))} digits, past 64 bits")
    types = rule.types
    if isinstance(types, list):  # an array of values, each following the rest of the rule
        if not isinstance(value, list):
            raise refuse(f"a JSON {kind_of(value)}, not {_names(types)}")
        if len(value) > rule.items:
            raise refuse(f"an array of {len(value)} items, more than {rule.items}")
        item = dataclasses.replace(rule, types=types[0])
        for i, v in enumerate(value):
            _check_field(v, item, source=source, line=line, where=f"{where}[{i}]")
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise refuse(f"{value!r}, not a finite number")
    if not _is(value, types):
        raise refuse(f"a JSON {kind_of(value)}, not {_names(types)}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if rule.low is not None and value < rule.low:
            raise refuse(f"{value!r}, below its least {rule.low:g}")
        if rule.above is not None and value <= rule.above:
            raise refuse(f"{value!r}, not above {rule.above:g}")
        if rule.high is not None and value > rule.high:
            raise refuse(f"{value!r}, above its most {rule.high:g}")
    elif isinstance(value, str):
        if len(value) > rule.length:
            raise refuse(f"a string of {len(value):,} characters, longer than {rule.length:,}")
        if rule.path:
            problem = path_problem(value)
            if problem:
                raise refuse(f"{shown(value)} {problem}")
    elif isinstance(value, dict):
        if rule.size is not None:
            size = len(json.dumps(value))
            if size > rule.size:
                raise refuse(f"an object of {size:,} bytes of JSON, more than {rule.size:,}")
        if rule.fields is not None:
            check(value, rule.fields, source=source, line=line, prefix=where + ".")
        if rule.keys is not None or rule.values is not None:
            if len(value) > rule.items:
                raise refuse(f"an object of {len(value)} entries, more than {rule.items}")
            for key, v in value.items():
                if rule.keys is not None:
                    _check_field(key, rule.keys, source=source, line=line, where=f"{where}[{shown(key, 40)}]")
                if rule.values is not None:
                    _check_field(v, rule.values, source=source, line=line, where=f"{where}[{shown(key, 40)}]")
    elif isinstance(value, list) and rule.size is not None:
        size = len(json.dumps(value))
        if size > rule.size:
            raise refuse(f"an array of {size:,} bytes of JSON, more than {rule.size:,}")
    if rule.choices is not None and value not in rule.choices:
        raise refuse(f"{shown(value)}, not one of {', '.join(map(repr, rule.choices))}")


def fit(doc: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `doc`, a record about to be written, cut into what `check` accepts of it under `schema`: a string
    past its length clipped, an array past its items cut, an object past its size kept as the clipped JSON text of
    its values, as many as fit. A writer calls it on what it echoes from elsewhere (another segment's numerics, a
    command line, a message), so that no record it writes is one its own reader refuses. Types and numbers are the
    writer's own: left as they are."""
    out = dict(doc)
    for name, value in doc.items():
        rule = schema.get(name)
        if rule is None and isinstance(schema, Schema):
            rule = next((r for p, r in schema.prefixes.items() if name.startswith(p)), None)
        rule = rule.types if isinstance(rule, Optional) else rule
        if isinstance(rule, Field):
            out[name] = _fitted(value, rule)
    return out


def _fitted(value: Any, rule: Field) -> Any:
    if isinstance(value, str):
        return clip(value, rule.length)
    if isinstance(value, list):
        item = dataclasses.replace(rule, types=rule.types[0] if isinstance(rule.types, list) else rule.types)
        value = [_fitted(v, item) for v in value[: rule.items]]
        while rule.size is not None and value and len(json.dumps(value)) > rule.size:
            value = value[: len(value) // 2]
        return value
    if isinstance(value, dict):
        if rule.fields is not None:
            value = fit(value, rule.fields)
        if rule.size is not None and len(json.dumps(value)) > rule.size:
            kept: dict[str, Any] = {}
            budget = rule.size - 2
            for key, v in value.items():
                # a scalar kept (a string cut), a container as its text, cut: a segment's code keeps its commit
                kept_value = clip(v, 200) if isinstance(v, str) else v
                if isinstance(v, dict | list):
                    kept_value = clip(json.dumps(v), 200)
                entry = {clip(str(key), 200): kept_value}
                budget -= len(json.dumps(entry))
                if budget < 0:
                    break
                kept.update(entry)
            return kept
    return value


def path_problem(value: str) -> str | None:
    """Why `value` is no path relative to and inside its root (absolute, `..`, NUL, empty), or None."""
    if not value or "\x00" in value:
        return "is no path (empty, or holds a NUL)"
    if value.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[/\\]", value):
        return "is an absolute path; a record names a file relative to its root"
    if ".." in re.split(r"[/\\]", value):
        return "climbs out of its root (`..`)"
    return None


def shown(value: Any, limit: int = 80) -> str:
    """A value as a message shows it: repr, cut to `limit` characters (a record's string may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: str, limit: int = STRING_LIMIT) -> str:
    """`text` cut to at most `limit` characters (ending in "..." when cut): what a writer echoes of a value it
    read, so that what it writes stays within what its reader accepts."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _past_64_bits(value: Any) -> bool:
    """An integer no field of a record means anything by (JSON reads up to 4300 digits; no float holds them)."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT


def _is(value: Any, types: Any) -> bool:
    if isinstance(types, list):  # [type]: an array of such values
        return isinstance(value, list) and all(_is(v, types[0]) for v in value)
    if _past_64_bits(value):
        return False
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in wanted
    if isinstance(value, int) and float in wanted:
        return True
    return isinstance(value, wanted)


def kind_of(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _names(types: Any) -> str:
    if isinstance(types, list):
        return f"an array of {_names(types[0]).split(' ', 1)[1]}s"
    wanted = types if isinstance(types, tuple) else (types,)
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}  # fmt: skip
    return " or ".join(names.get(t, t.__name__) for t in wanted)


def exists(path: str | os.PathLike[str]) -> bool:
    """Whether something stands at `path`, a symbolic link included (a reader then refuses it, naming it)."""
    return os.path.lexists(Path(path))
