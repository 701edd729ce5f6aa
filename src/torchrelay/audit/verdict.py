"""The audit's verdict: a rich table for people, JSON for machines, and the last verdict kept per script."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from torchrelay.identity.numerics import describe as describe_numerics
from torchrelay.identity.numerics import fingerprint
from torchrelay.paths.layout import checkpoint_label
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.hashing import sha256_json
from torchrelay.util.records import read_json_or_none

VERDICT_FORMAT = 1
AUDIT_FILE = "AUDIT.json"


@dataclass(kw_only=True, slots=True)
class Verdict:
    """Everything an audit concluded; `equal` is the answer, the rest says where and why not."""

    equal: bool
    launch: list[str]
    script: str | None
    script_sha256: str | None
    updates: int
    stops: list[int]
    vary: dict[str, list[Any]] = field(default_factory=dict)
    atol: float = 0.0
    ignored_keys: list[str] = field(default_factory=list)
    tensors_equal: bool = True
    tensors_compared: int = 0
    values_compared: int = (
        0  # restored values that are not tensors: statefuls' numbers, strings, param groups
    )
    tensors_differing: int = 0
    top_tensors: list[dict[str, Any]] = field(default_factory=list)  # {"name", "max_abs", "note"}
    tensors_first_update: int | None = None  # the first compared checkpoint whose tensors differ
    # one per compared checkpoint: {"update", "after_stop" (the stop it is the first checkpoint after, or null),
    # "compared" (tensors), "values" (other restored values), "differing" (of both), "top" (the most differing
    # tensor's or value's name, or null)}
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    metrics_equal: bool = True
    metrics_first_update: int | None = None
    metrics_keys: list[str] = field(default_factory=list)
    metrics_detail: str = ""
    ledger_equal: bool = True
    ledger_first_update: int | None = None
    ledger_detail: str = ""
    # the parameters' per-update digests (records/digests.py): the first update after which they differ, None if never
    digests_compared: int = 0  # updates both runs recorded a digest for (0: none recorded)
    digests_first_update: int | None = None
    digests_detail: str = ""
    own_loaders: list[str] = field(default_factory=list)  # sampler classes of the script's own DataLoaders
    own_batches_equal: bool = True
    own_batches_first_update: int | None = None
    own_batches_detail: str = ""
    causes: list[dict[str, str]] = field(default_factory=list)  # {"name", "evidence", "fix"}
    run_dirs: dict[str, str] = field(default_factory=dict)
    code: dict[str, Any] = field(
        default_factory=dict
    )  # the audited runs' code identity (history.jsonl "code")
    # The numerics identities the audited segments ran with (history.jsonl "numerics", numerics.gather), one per
    # distinct identity: EQUAL is a claim within one; another identity computes other bits (docs/NUMERICS.md).
    numerics: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    time: float = field(default_factory=time.time)
    format: int = VERDICT_FORMAT

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (infinite differences, from missing or reshaped tensors, become null)."""
        data = asdict(self)
        for row in data["top_tensors"]:
            if not math.isfinite(row["max_abs"]):
                row["max_abs"] = None
        return data

    @property
    def cause(self) -> str | None:
        """The most likely cause's name, or None when equal."""
        return self.causes[0]["name"] if self.causes else None

    def summary(self) -> str:
        """One line: equal, or not equal with where and the likely cause; and the numerics it holds for."""
        if self.equal:
            return (
                f"equal: {self.updates} updates, {len(self.stops)} stop(s), bit for bit"
                + (f" (atol {self.atol:g})" if self.atol else "")
                + f"; {holds_for(self.numerics)}"
            )
        where = self.metrics_first_update or self.ledger_first_update
        part = f" from update {where}" if where else ""
        if self.digests_first_update is not None:
            part += f"; parameters part after update {self.digests_first_update}"
        return f"NOT equal{part}; likely cause: {self.cause or 'unknown'}; {holds_for(self.numerics)}"


def _mark(ok: bool) -> str:
    return "[green]equal[/green]" if ok else "[bold red]not equal[/bold red]"


def render_table(verdict: Verdict, console: Console | None = None) -> None:
    """Print the verdict as a table: overall answer, each comparison, the tensors that differ most, the causes."""
    # Off a terminal rich assumes 80 columns; a log file or CI page reads better wider.
    out = console or (Console() if Console().is_terminal else Console(width=130))
    head = "[bold green]EQUAL[/bold green]" if verdict.equal else "[bold red]NOT EQUAL[/bold red]"
    table = Table(
        title=f"torchrelay audit: {head}", show_header=True, header_style="bold", title_justify="left"
    )
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    table.add_row("script", verdict.script or "?", " ".join(verdict.launch))
    stops = ", ".join(map(str, verdict.stops))
    vary = "; ".join(f"{k}={','.join(map(str, v))}" for k, v in verdict.vary.items())
    table.add_row(
        "plan", f"{verdict.updates} updates", f"stopped after {stops}" + (f"; varied {vary}" if vary else "")
    )
    table.add_row(
        "tensors",
        _mark(verdict.tensors_equal),
        f"{verdict.tensors_compared} tensors and {verdict.values_compared} values "
        f"compared, {verdict.tensors_differing} differ"
        + (f" in {checkpoint_label(verdict.tensors_first_update)}" if verdict.tensors_first_update else "")
        + (f" (atol {verdict.atol:g})" if verdict.atol else " (bit for bit)"),
    )
    for point in verdict.checkpoints:
        after = f"first after the stop at {point['after_stop']}" if point["after_stop"] else "the last"
        table.add_row(
            f"  {checkpoint_label(point['update'])}",
            _mark(not point["differing"]),
            f"{after}: {point['compared']} tensors, {point.get('values', 0)} values"
            + (f", {point['differing']} differ, most {point['top']}" if point["differing"] else ""),
        )
    table.add_row(
        "metric logs",
        _mark(verdict.metrics_equal),
        ""
        if verdict.metrics_equal
        else f"first part at update {verdict.metrics_first_update}: {verdict.metrics_detail}",
    )
    table.add_row(
        "exposure ledgers",
        _mark(verdict.ledger_equal),
        ""
        if verdict.ledger_equal
        else f"first part at update {verdict.ledger_first_update}: {verdict.ledger_detail}",
    )
    if verdict.digests_compared:
        table.add_row(
            "update digests",
            _mark(verdict.digests_first_update is None),
            f"the parameters after each of {verdict.digests_compared} updates"
            if verdict.digests_first_update is None
            else f"first part after update {verdict.digests_first_update}: {verdict.digests_detail}",
        )
    if verdict.own_loaders:
        table.add_row(
            "own DataLoaders",
            _mark(verdict.own_batches_equal),
            f"samplers {', '.join(verdict.own_loaders)}"
            + (
                ""
                if verdict.own_batches_equal
                else f"; first part at update {verdict.own_batches_first_update}: "
                f"{verdict.own_batches_detail}"
            ),
        )
    for row in verdict.top_tensors:
        diff = "missing/shape" if not math.isfinite(row["max_abs"] or math.inf) else f"{row['max_abs']:.3e}"
        table.add_row(
            "  tensor", row["name"], f"max abs diff {diff}" + (f" ({row['note']})" if row["note"] else "")
        )
    table.add_row(
        "numerics",
        f"{len(verdict.numerics)} identit{'y' if len(verdict.numerics) == 1 else 'ies'}",
        "\n".join(escape(describe_numerics(n)) for n in verdict.numerics) or "not recorded",
    )
    for rank, cause in enumerate(verdict.causes):
        label = "likely cause" if rank == 0 else "also possible"
        table.add_row(
            label, f"[bold yellow]{cause['name']}[/bold yellow]", f"{cause['evidence']}\nfix: {cause['fix']}"
        )
    out.print(table)
    out.print(verdict.summary())


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "torchrelay" / "audits"


def script_key(script_path: str | Path) -> str:
    """SHA-256 of the script's absolute path and its content: a verdict belongs to one version of one script."""
    path = Path(script_path).resolve()
    digest = hashlib.sha256(str(path).encode("utf-8") + b"\0")
    try:
        digest.update(path.read_bytes())
    except OSError:
        digest.update(b"<unreadable>")
    return digest.hexdigest()


def _path_key(script_path: str | Path) -> str:
    return hashlib.sha256(str(Path(script_path).resolve()).encode("utf-8")).hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")  # fsynced, then its folder


def save(verdict: Verdict) -> list[Path]:
    """Write AUDIT.json into each audited run directory and keep the verdict for the script; returns the paths."""
    data = verdict.to_dict()
    written = []
    for run_dir in verdict.run_dirs.values():
        if Path(run_dir).is_dir():
            _write_json(Path(run_dir) / AUDIT_FILE, data)
            written.append(Path(run_dir) / AUDIT_FILE)
    root = _cache_root()
    targets = []
    if verdict.script:
        targets += [
            root / f"{script_key(verdict.script)}.json",
            root / "by-path" / f"{_path_key(verdict.script)}.json",
        ]
    if verdict.code:
        name = _path_key(verdict.script or " ".join(verdict.launch))
        targets.append(root / "by-code" / code_key(verdict.code) / f"{name}.json")
    for path in targets:
        _write_json(path, data)
        written.append(path)
    return written


def code_key(code: dict[str, Any]) -> str:
    """SHA-256 of a code identity (commit, tree, dirty, dirty_sha256) as history.jsonl records it."""
    return sha256_json(code)


def shown_for_run(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """`verdict_for_run`, or None where the audit record cannot be read: status and report never fail over it."""
    try:
        found = verdict_for_run(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable audit record must not cost the user the run's status
        return None
    return dict(found) if found else None


def verdict_for_run(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The last audit verdict that applies to a run directory, for `torchrelay status`; None if none applies.

    In order: the run's own AUDIT.json (an audited run); the verdict for the run's script when history.jsonl
    names it ("code": {"script": path}); else the newest verdict for a script audited at the run's exact code
    identity (commit, tree and uncommitted diff). The dict is a Verdict's, plus "verdict" (one line for
    status), "source" (how it was found) and "stale".
    """
    root = Path(run_dir)
    own = root / AUDIT_FILE
    if own.is_file():
        return _shown(_read(own), "this run was audited", stale=False)
    from torchrelay.records.history import read_history

    segments = read_history(root)
    code = dict(segments[-1].get("code") or {}) if segments else {}
    script = code.pop("script", None)
    if isinstance(script, str):
        found = last_verdict(script, any_version=True)
        if found is not None:
            return _shown(found, f"audit of {script}", stale=bool(found.get("stale")))
    if not code:
        return None
    folder = _cache_root() / "by-code" / code_key(code)
    candidates = [d for d in (_read(p) for p in folder.glob("*.json")) if d] if folder.is_dir() else []
    if not candidates:
        return None
    newest = max(candidates, key=lambda d: float(d.get("time") or 0))
    others = f" (newest of {len(candidates)} scripts audited at this code)" if len(candidates) > 1 else ""
    return _shown(newest, f"audit of {newest.get('script') or 'a script'} at this code{others}", stale=False)


def _read(path: Path) -> dict[str, Any]:
    data = read_json_or_none(path, what="an audit verdict")  # unreadable, not JSON, a link, a pipe: none
    return data if isinstance(data, dict) else {}


def _shown(data: dict[str, Any], source: str, *, stale: bool) -> dict[str, Any]:
    data = dict(data, stale=stale, source=source)
    data["verdict"] = f"{describe(data)} — {source}"
    return data


def last_verdict(script_path: str | Path, *, any_version: bool = False) -> dict[str, Any] | None:
    """The last audit verdict (a dict, see Verdict) for this script as it is now; None if never audited.

    With any_version=True, the last verdict for this path even if the script has changed since; the returned
    dict then has "stale": True when the recorded script_sha256 differs from the file's current content.
    """
    root = _cache_root()
    path = root / f"{script_key(script_path)}.json"
    stale = False
    if not path.is_file():
        if not any_version:
            return None
        path, stale = root / "by-path" / f"{_path_key(script_path)}.json", True
        if not path.is_file():
            return None
    data = read_json_or_none(path, what="an audit verdict")  # unreadable, not JSON, a link, a pipe: none
    if not isinstance(data, dict):
        return None
    data["stale"] = stale
    return data


def describe(verdict: dict[str, Any]) -> str:
    """One line for `torchrelay status`: when the audit ran and what it found."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(verdict.get("time") or 0)))
    stale = " (script changed since)" if verdict.get("stale") else ""
    if verdict.get("equal"):
        text = f"equal ({verdict.get('updates')} updates, {len(verdict.get('stops') or [])} stops)"
    else:
        causes = verdict.get("causes") or []
        text = "NOT equal; likely cause: " + (causes[0]["name"] if causes else "unknown")
    numerics = verdict.get("numerics")
    held = f"; {holds_for(numerics)}" if isinstance(numerics, list) else ""
    return f"{text}, audited {when}{stale}{held}"


def holds_for(numerics: list[dict[str, Any]]) -> str:
    """Which numerics identity the verdict holds for: bits are compared within one (docs/NUMERICS.md)."""
    if not numerics:
        return "numerics identity not recorded"
    if len(numerics) == 1:
        return (
            f"holds for numerics identity {fingerprint(numerics[0])} only ({describe_numerics(numerics[0])})"
        )
    ids = ", ".join(fingerprint(n) for n in numerics)
    return f"the audited segments ran with {len(numerics)} numerics identities ({ids}): bits may differ by kernel"
