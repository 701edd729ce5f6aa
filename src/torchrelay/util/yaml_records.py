"""A YAML plan read as untrusted input: bounded size, safe_load, bounded aliases and depth, no repeated key (the bounds:
util/records.py, docs/FORMATS.md)."""

from __future__ import annotations

import os
import re
from typing import Any

from torchrelay.errors import RecordError
from torchrelay.util.records import ALIAS_LIMIT, DAMAGED_HINT, DEPTH_LIMIT, YAML_LIMIT, depth_of
from torchrelay.util.safepath import read_regular


def read_yaml(
    path: str | os.PathLike[str], *, what: str, limit: int = YAML_LIMIT, follow: bool = False
) -> Any:
    """A YAML file (a plan) as untrusted input: bounded size, safe_load, bounded aliases and depth; one RecordError.
    `follow`: the user named the path (a link of theirs is followed; a pipe or a device still is not read)."""
    import yaml

    source = f"{path} ({what})"
    data = read_regular(path, limit, what=what, follow=follow)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(
            source, f"not UTF-8 text ({exc.reason} at byte {exc.start})", hint=DAMAGED_HINT
        ) from None
    # PyYAML's scanner takes time in the square of flow nesting ([[[...): the brackets are counted first.
    if _flow_depth(text) > DEPTH_LIMIT:
        raise RecordError(source, f"nested deeper than {DEPTH_LIMIT} levels", hint="fix the YAML")
    deep = RecordError(source, f"nested deeper than {DEPTH_LIMIT} levels", hint="fix the YAML")
    try:  # the reader checks every character as it is made: a NUL is refused there
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as exc:
        raise RecordError(source, f"not valid YAML ({_yaml_problem(exc)})", hint="fix the YAML") from None
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_nodes(node, source)
        doc = loader.construct_document(node) if node is not None else None
    except RecursionError:  # PyYAML composes recursively: deep block nesting reaches the interpreter's bound
        raise deep from None
    except yaml.YAMLError as exc:
        raise RecordError(source, f"not valid YAML ({_yaml_problem(exc)})", hint="fix the YAML") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise RecordError(source, f"not YAML a plan holds ({str(exc)[:120]})", hint="fix the YAML") from None
    finally:
        loader.dispose()
    if depth_of(doc, DEPTH_LIMIT) > DEPTH_LIMIT:
        raise deep
    return doc


def _check_nodes(root: Any, source: str) -> None:
    """Refuse a composed YAML document whose aliases expand it by more than ALIAS_LIMIT values or hold a node
    inside itself, or with a key repeated in a mapping. Counted on the node graph, where an alias is the node it
    names: each node is visited once, whatever its aliases expand to."""
    import yaml

    sizes: dict[int, int] = {}  # id(node) -> values it expands to, itself included
    open_: set[int] = set()  # nodes being counted: meeting one again is a node inside itself

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise RecordError(source, "an alias holds the node it names (a loop)", hint="fix the YAML")
        open_.add(key)
        if isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(c) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            _unique_keys(node, source)
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        else:
            total = 1
        open_.discard(key)
        sizes[key] = total
        return total

    expanded = size(root)
    if expanded - len(sizes) > ALIAS_LIMIT:
        raise RecordError(
            source,
            f"its aliases expand {len(sizes)} values to {expanded} (more than {ALIAS_LIMIT} added)",
            hint="write the values out, or reuse fewer of them through anchors and aliases (&name, *name)",
        )


def _unique_keys(node: Any, source: str) -> None:
    """Refuse a mapping node in which a plain key (`run_dir`) is written twice."""
    import yaml

    seen: set[tuple[str, str]] = set()
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        if (key.tag, key.value) in seen:
            raise RecordError(
                source,
                f"key {key.value!r} is repeated at line {key.start_mark.line + 1}",
                hint="keep one of them: YAML would silently use the last",
            )
        seen.add((key.tag, key.value))


def _flow_depth(text: str) -> int:
    """How deep YAML's flow brackets nest, at most (a bracket inside a quoted string counts too)."""
    if text.count("[") + text.count("{") <= DEPTH_LIMIT:
        return 0
    depth = deepest = 0
    for bracket in re.finditer(r"[\[\]{}]", text):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > DEPTH_LIMIT:
            break
    return deepest


def _yaml_problem(exc: Exception) -> str:
    """PyYAML's error in one line: its problem and where (its own text spans several, with the line quoted)."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())[:300]
