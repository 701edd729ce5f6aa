"""The one JSONL reader, with one policy for a torn line.

Every JSONL file torchrelay writes (per-rank metrics and exposures, history.jsonl, the audit's probe records) is
appended one whole line per write, or rewritten atomically. So:
- a LAST line without its newline, or that is not a JSON object, is what a writer killed mid-write leaves: skipped;
- a bad line anywhere before the last is damage, never a crash: an IntegrityError naming the file and line number
  (stopping silently there would hide every record after it, e.g. from the exposure ledger);
- blank lines are skipped; bytes that are not UTF-8 are an IntegrityError naming the line;
- the file may come from elsewhere (a bundle): it is opened the one safe way (`safepath.open_regular`: no symlink,
  no pipe or device), a line longer than LINE_LIMIT is damage, not something to hold in memory, and a line nested
  deeper than DEPTH_LIMIT is not JSON a torchrelay writer makes;
- with a `schema`, each record is checked against it (util/records.check): a wrong-typed field is one
  RecordError naming the file, the line and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from torchrelay.errors import IntegrityError
from torchrelay.util.records import DEPTH_LIMIT, LINE_LIMIT, check, depth_of
from torchrelay.util.safepath import open_regular

__all__ = ["LINE_LIMIT", "iter_records", "read_records"]


def iter_records(
    path: str | os.PathLike[str],
    *,
    missing_ok: bool = True,
    schema: Mapping[str, Any] | None = None,
    root: str | os.PathLike[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL file, line by line, under the module's torn-line policy."""
    path = Path(path)
    try:
        fd, _ = open_regular(path, what=path.name, root=root)
    except FileNotFoundError:
        if missing_ok and not os.path.islink(path):
            return
        raise IntegrityError(f"{path} is missing") from None
    with os.fdopen(fd, "rb") as f:
        pending: tuple[int, str] | None = None  # a bad line, an error only if another line follows it
        number = 0
        while raw := f.readline(LINE_LIMIT + 1):
            number += 1
            if len(raw) > LINE_LIMIT:
                raise IntegrityError(
                    f"{path}: line {number} is longer than {LINE_LIMIT:,} bytes",
                    hint=f"{path.name} is damaged",
                )
            if not raw.strip():
                continue
            if pending is not None:
                raise _damaged(path, *pending)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise IntegrityError(
                    f"{path} is not UTF-8 text ({exc.reason} at line {number})",
                    hint=f"restore {path.name} from a copy",
                ) from None
            record, problem = _parse(line)
            if problem is None:
                yield record if schema is None else check(record, schema, source=str(path), line=number)
            else:
                pending = (number, problem)


def read_records(
    path: str | os.PathLike[str], *, missing_ok: bool = True, schema: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """All JSON objects of a JSONL file (see the module's torn-line policy)."""
    return list(iter_records(path, missing_ok=missing_ok, schema=schema))


def _parse(line: str) -> tuple[dict[str, Any], str | None]:
    if not line.endswith("\n"):
        return {}, "ends without a newline"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return {}, f"is not JSON ({exc.msg})"
    except (
        ValueError,
        RecursionError,
    ):  # a number of more digits than Python converts; nesting past the parser
        return {}, "is not JSON a torchrelay writer makes"
    if not isinstance(record, dict):
        return {}, "is not a JSON object"
    if line.count("[") + line.count("{") > DEPTH_LIMIT and depth_of(record, DEPTH_LIMIT) > DEPTH_LIMIT:
        return {}, f"nests deeper than {DEPTH_LIMIT} levels"
    return record, None


def _damaged(path: Path, number: int, problem: str) -> IntegrityError:
    return IntegrityError(
        f"{path}: line {number} {problem}, and lines follow it (only a last line may be torn)",
        hint=f"the file is damaged; restore {path.name} from a copy, or remove line {number}",
    )
