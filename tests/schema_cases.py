"""Cases generated from a record's schema (util/records.Field): for every field, values its rule refuses, and a record
with every field at its bounds. Used by test_fuzz_readers.py (each bad value through the real reader) and
test_record_fields.py (each record written at its bounds by its writer and read back)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from torchrelay.util.records import STRING_LIMIT, Field, Optional

_NONE = type(None)
_SAMPLE = {dict: {"k": 1}, list: [1], str: "x", int: 7, float: 1.5, bool: True, _NONE: None}


def rule_of(rule: Any) -> Any:
    return rule.types if isinstance(rule, Optional) else rule


def _types(rule: Field) -> tuple[type, ...]:
    types = rule.types[0] if isinstance(rule.types, list) else rule.types
    return types if isinstance(types, tuple) else (types,)


def _accepts(types: tuple[type, ...], value: Any) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def bad_values(rule: Field) -> Iterator[tuple[str, Any]]:
    """(label, value) for each value `rule` refuses: another type, NaN, Infinity, below its range, huge, an
    overlong string, a path that escapes, an array or object past its bound."""
    if isinstance(rule.types, list):
        yield "not an array", "x"
        inner = Field(rule.types[0], rule.low, rule.high, rule.above, rule.length, rule.items, rule.path)
        for label, value in bad_values(inner):
            if not (isinstance(value, str) and len(value) > 1 << 20):  # one overlong item is enough
                yield f"an item {label}", [value]
        if rule.items <= 1 << 16:
            good = next(good_values(inner))
            yield "too many items", [good] * (rule.items + 1)
        return
    types = _types(rule)
    for t, sample in _SAMPLE.items():
        if not _accepts(types, sample):
            yield f"a {t.__name__}", sample
    yield "NaN", math.nan
    yield "Infinity", math.inf
    yield "-Infinity", -math.inf
    yield "huge", 2**70
    if int in types or float in types:
        if rule.low is not None:
            yield "below its range", rule.low - 1
        if rule.above is not None:
            yield "at its exclusive bound", rule.above
        if rule.high is not None:
            yield "above its range", int(rule.high) + 1
    if str in types:
        yield "overlong", "x" * (rule.length + 1)
        if rule.path:
            yield "absolute path", "/etc/passwd"
            yield "path climbing out", "../../etc/passwd"
        if rule.choices is not None:
            yield "not a choice", "no-such-choice"
    if dict in types and rule.size is not None:
        yield "oversized object", {"k": "x" * (rule.size + 1)}
    if dict in types and rule.keys is not None and rule.keys.path:
        yield "a key climbing out", {"../../etc/passwd": "0" * 64}


def good_values(rule: Field) -> Iterator[Any]:
    """A value `rule` accepts (the first one at its upper bound)."""
    types = _types(rule)
    if rule.choices:
        yield rule.choices[-1]
    elif isinstance(rule.types, list):
        yield []
    elif int in types and bool not in types:
        yield int(rule.high) if rule.high is not None else 2**63 - 1
    elif float in types:
        yield float(rule.high) if rule.high is not None else 1e300
    elif str in types:
        yield ("a/" * (rule.length // 2))[: rule.length] if rule.path else "y" * rule.length
    elif bool in types:
        yield True
    elif dict in types:
        yield {}
    else:
        yield None


def at_bounds(schema: Mapping[str, Any], total: int = 8 << 20) -> dict[str, Any]:
    """A record whose every field is at its bound: strings at their length, arrays at their items, objects at
    their size, numbers at their highest; an array of long strings is filled up to `total` bytes at most."""
    doc: dict[str, Any] = {}
    for name, raw in schema.items():
        rule = rule_of(raw)
        if not isinstance(rule, Field):
            continue
        doc[name] = _at_bound(rule, total)
    return doc


def _at_bound(rule: Field, total: int) -> Any:
    types = _types(rule)
    if isinstance(rule.types, list):
        item = Field(rule.types[0], rule.low, rule.high, rule.above, rule.length, rule.items, rule.path)
        one = _at_bound(item, total)
        count = rule.items
        if isinstance(one, str):
            count = max(1, min(count, total // (len(one) + 4)))
        return [one] * count
    if dict in types:
        if rule.fields is not None:
            return at_bounds(rule.fields, total)
        if rule.size is not None:
            filler = "z" * max(0, rule.size - len('{"k": ""}'))
            return {"k": filler}
        return {}
    if str in types:
        return (
            next(good_values(rule)) if rule.length <= STRING_LIMIT * 16 else "w" * min(rule.length, 1 << 16)
        )
    return next(good_values(rule))


def small(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A small valid record: every field of `schema` at a small value its rule accepts (nested records too)."""
    doc: dict[str, Any] = {}
    for name, raw in schema.items():
        rule = rule_of(raw)
        if isinstance(rule, Field):
            doc[name] = _small(rule)
    return doc


def _small(rule: Field) -> Any:
    types = _types(rule)
    if isinstance(rule.types, list):
        return [
            _small(Field(rule.types[0], rule.low, rule.high, rule.above, rule.length, rule.items, rule.path))
        ]
    if rule.choices:
        return rule.choices[0]
    if dict in types:
        return small(rule.fields) if rule.fields is not None else {"k": "v"}
    if int in types and bool not in types:
        return int(max(rule.low or 0, (rule.above or 0) + 1, 1)) if rule.low != 0 else 0
    if float in types:
        return float(max(rule.low or 0, (rule.above or 0) + 1))
    if str in types:
        return "a/b" if rule.path else "a"
    if bool in types:
        return False
    return None


def field_cases(
    schema: Mapping[str, Any], doc: dict[str, Any], prefix: str = ""
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(field, label, record) for every field of `schema` (nested records too) and every value its rule refuses:
    `doc` (valid, every field present) with that one value replaced."""
    for name, raw in schema.items():
        rule = rule_of(raw)
        if not isinstance(rule, Field) or name not in doc:
            continue
        for label, value in bad_values(rule):
            yield prefix + name, label, {**doc, name: value}
        if rule.fields is not None and isinstance(doc[name], dict):
            for field, label, inner in field_cases(rule.fields, doc[name], prefix + name + "."):
                yield field, label, {**doc, name: inner}


def env_cases(var: Any) -> Iterator[tuple[str, str, bool]]:
    """(label, text, refused?) for an environment variable: what its kind and range refuse, and a value it takes."""
    numeric = var.kind in ("int", "float", "ints")
    low = var.low if var.low is not None else (var.above if var.above is not None else None)
    texts = [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"), ("negative", "-5"), ("zero", "0"),
             ("huge", str(2**70)), ("past float", "1e400"), ("a word", "soon"), ("a list", "[1]"),
             ("overlong", "7" * 70_000), ("a fraction", "0.5"), ("deep", "[" * 100_000)]  # fmt: skip
    for label, text in texts:
        if var.kind in ("str", "path"):
            refused = len(text) > 1 << 16 or (var.choices is not None and text not in var.choices)
        elif var.kind == "flag":
            refused = text.lower() not in ("1", "0", "true", "false", "yes", "no")
        elif var.kind == "json":
            refused = True  # none of these is a JSON object
        else:
            try:
                value = float(text) if var.kind == "float" else int(text)
            except ValueError:
                refused = True
            else:
                refused = not math.isfinite(value) or (
                    (var.low is not None and value < var.low)
                    or (var.above is not None and value <= var.above)
                    or (var.high is not None and value > var.high)
                )
        yield label, text, refused
    if numeric and low is not None:
        yield "its least", str(int(low) + (1 if var.above is not None else 0)), False
