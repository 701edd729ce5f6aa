"""The one code-identity rule (docs/CODE_IDENTITY.md): which differences between a recorded identity and the one
now refuse a resume, which are only warned about, and the warning's words."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CODE_FIELDS = (
    "code.commit",
    "code.tree",
    "code.dirty",
    "code.dirty_sha256",
    "code.untracked",
    "code.modified",
    "code.program",
    "code.changed",
)
_ABSENT = "<absent>"  # as contract_diff words a side without the value
_BY_FILE = ("code.untracked", "code.modified", "code.changed")


def code_changes(
    recorded: Mapping[str, Any], now: Mapping[str, Any], *, strict: bool = False
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """The one code-identity rule (docs/CODE_IDENTITY.md): (refused, other) differences, each (field, old, new).

    Refused: another commit, or a file of the program (the script and the modules it imports from the code
    directory, recorded then or imported now) whose content differs. Other: any other file of the tree that
    differs (named `code.changed[path]`), and the tree fields it moves; `strict` refuses those too. A contract
    written before the program was recorded (no `code.program`) refuses any change of its tree, as it did.
    """
    refused: list[tuple[str, Any, Any]] = []
    other: list[tuple[str, Any, Any]] = []
    a_commit, b_commit = recorded.get("code.commit"), now.get("code.commit")
    if a_commit is not None and b_commit is not None and a_commit != b_commit:
        refused.append(("code.commit", a_commit, b_commit))
    legacy = "code.program" not in recorded
    program = {str(p) for p in [*(recorded.get("code.program") or []), *(now.get("code.program") or [])]}
    keys = [
        k for k in _BY_FILE if k in recorded and k in now
    ]  # a field written later is compared when both have it
    sides = []
    for fields in (recorded, now):
        delta: dict[str, tuple[str, Any]] = {}
        for key in keys:
            value = fields.get(key)
            for name, sha in value.items() if isinstance(value, dict) else ():
                delta[str(name)] = (key, sha)
                if key != "code.changed":
                    program.add(str(name))
        sides.append(delta)
    old, new = sides
    unknown = "code.changed" in keys and now.get("code.changed") is None  # files that cannot be named
    named = False
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name, (None, _ABSENT))[1], new.get(name, (None, _ABSENT))[1]
        if a == b:
            continue
        named = True
        key = new.get(name, old.get(name, ("code.changed", None)))[0]
        (refused if name in program else other).append((f"{key}[{name}]", a, b))
    # the tree fields: the commit's own when both sides know it; else they say the tree moved
    both_commits = a_commit is not None and b_commit is not None
    for key in ("code.tree", "code.dirty", "code.dirty_sha256"):
        a, b = recorded.get(key, _ABSENT), now.get(key, _ABSENT)
        if a == b or (key == "code.tree" and both_commits):
            continue
        if legacy or (key == "code.tree" and (unknown or not named)):
            refused.append((key, a, b))  # a change no file of the program can be told apart from
        else:
            other.append((key, a, b))
    if strict:
        refused, other = refused + other, []
    return sorted(refused), sorted(other)


def tree_note(other: list[tuple[str, Any, Any]], *, commit: bool) -> str | None:
    """The warning (and segment note) for changes of the tree outside the program, each file named, or None;
    commit: the run has one (a file absent from code.changed is then as in the commit, not missing)."""
    if not other:
        return None
    words = []
    for key, old, new in other:
        if not key.startswith("code.changed["):
            continue
        if new is None:
            what = "deleted"
        elif new == _ABSENT:
            what = "as in the commit again" if commit else "removed"
        else:
            what = "new" if old == _ABSENT and not commit else "changed"
        words.append(f"{key.removeprefix('code.changed[')[:-1]} ({what})")
    named = ", ".join(words) or ", ".join(f"{k}: {o!r} -> {n!r}" for k, o, n in other)
    return (
        f"the code directory changed outside the program since the run recorded it: {named}; recorded, not "
        "refused (the code is the commit, the script and the modules it imports; strict_code: true refuses any "
        "change)"
    )
