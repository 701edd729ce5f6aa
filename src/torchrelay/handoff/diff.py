"""`diff`: the contract (and runtime configuration) difference between two runs, checkpoints or bundles.

It compares what a resume would: the recorded contracts, config.json against its own contract, and the samples each
side's own manifest lists (`data.fingerprint`, `data.samples`, read from the manifest as a resume reads it), so a
side whose manifest was replaced under an unchanged contract is not "identical".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.config.relay import is_runtime_key
from torchrelay.errors import ConfigError, IntegrityError, RelayError
from torchrelay.paths.layout import parse_checkpoint_name
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.records.contract import CONTRACT_FILE, contract_diff, contract_manifest, load_contract
from torchrelay.util.dotted import flatten
from torchrelay.util.records import Schema, read_json, read_json_or_none


@dataclass(frozen=True, slots=True)
class Side:
    """One side of a diff: what it is, its contract fields, its flat configuration, its checkpoint (if any)."""

    path: Path
    kind: str  # "run" | "bundle" | "checkpoint" | "prepared run"
    contract_sha256: str
    fields: dict[str, Any]
    config: dict[str, Any]
    checkpoint: str | None = None
    checkpoint_contract: str | None = None
    # contract fields whose value config.json no longer holds (key, recorded, configured): a resume of this side
    # recomputes its contract from config.json and refuses it
    drift: tuple[tuple[str, Any, Any], ...] = ()
    # the data fields a resume recomputes from this side's own manifest (under config.json's data_root):
    # {data.fingerprint, data.samples}; those that differ from its contract (key, recorded, read); or why the
    # manifest cannot be read
    data: dict[str, Any] = field(default_factory=dict)
    data_drift: tuple[tuple[str, Any, Any], ...] = ()
    data_problem: str | None = None

    @property
    def resumable(self) -> bool:
        """Whether a resume of this side would accept its own files (config.json, a manifest) as its contract. (A
        data drift is not counted: read under the data_root a launch passes, the manifest may match.)"""
        return not self.drift and self.data_problem is None


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """One differing field; `runtime` fields may differ between segments of one run."""

    key: str
    a: Any
    b: Any
    runtime: bool


@dataclass(slots=True)
class DiffReport:
    """Every differing field, contract first; `same_contract` says whether one run could continue the other."""

    a: Side
    b: Side
    contract: list[FieldDiff] = field(default_factory=list)
    runtime: list[FieldDiff] = field(default_factory=list)

    @property
    def same_contract(self) -> bool:
        return not self.contract and self.a.resumable and self.b.resumable


def load_side(path: Path) -> Side:
    """Read a run dir, a bundle, or a checkpoint dir (whose run is its parent); JSON only, nothing executed."""
    path = Path(path)
    checkpoint = None
    checkpoint_contract = None
    root = path
    if parse_checkpoint_name(path.name) is not None and (path / INVENTORY).exists():
        root, checkpoint = path.parent, path.name
        doc = read_json_or_none(path / INVENTORY, what="checkpoint inventory", root=path)
        checkpoint_contract = doc.get("contract_sha256") if isinstance(doc, dict) else None
    rd = RunDir(root)  # the `diff` verb's side, once its checkpoint (if one was named) is set apart
    if not rd.contract_path.is_file():
        raise ConfigError(
            f"{path} is not a run directory, a bundle or a checkpoint (no {CONTRACT_FILE} at {root})",
            hint="pass a run dir, a bundle dir, or a run's checkpoint-N dir",
        )
    contract = load_contract(rd)
    try:
        # an object, or one line naming the file (flatten took a list or a number apart with an AttributeError)
        config = read_json(rd.config_path, what="the run's configuration", root=root, schema=Schema({}))
    except OSError as exc:
        raise IntegrityError(f"{rd.config_path} is unreadable: {exc}") from None
    if Bundle(root).looks_like_one():
        kind = "bundle"
    elif rd.prepare_record_path.is_file():
        kind = "prepared run"
    else:
        kind = "run"
    if checkpoint is not None:
        kind = f"checkpoint of a {kind}"
    fields, flat = dict(contract["fields"]), flatten(config)
    data, problem = _data_as_resumed(rd, fields, flat)
    return Side(
        path,
        kind,
        str(contract["sha256"]),
        fields,
        flat,
        checkpoint,
        checkpoint_contract,
        tuple((k, fields[k], v) for k, v in sorted(_configured(fields, flat).items()) if v != fields[k]),
        data,
        tuple((k, fields[k], v) for k, v in sorted(data.items()) if v != fields[k]),
        problem,
    )


def _data_as_resumed(
    rd: RunDir, fields: dict[str, Any], flat_config: dict[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """The data fields of the contract as a resume recomputes them from the side's own copy of its manifest
    (data/manifest.jsonl, read under config.json's data_root; its index believed only for the bytes the contract
    binds), and None; or {} and why that copy cannot be read. Only the side's own copy: a path config.json names
    elsewhere is not read."""
    data_root = flat_config.get("data_root")
    try:
        manifest = contract_manifest(
            rd.manifest_path,
            [data_root if isinstance(data_root, str) else ""],
            fields,
            index=rd.manifest_index_path,
            root=rd.path,
        )
    except (RelayError, OSError, ValueError) as exc:
        return {}, str(getattr(exc, "message", exc))
    found = {"data.fingerprint": manifest.fingerprint(), "data.samples": len(manifest)}
    return {k: v for k, v in found.items() if k in fields}, None


# The layout: a reshard writes the new split into config.json, and the resume compares it by its own rule.
_LAYOUT_KEYS = ("micro_batch", "grad_accum")


def _configured(fields: dict[str, Any], flat_config: dict[str, Any]) -> dict[str, Any]:
    """The contract fields that config.json sets (a resume recomputes them from it), with its values."""
    params = _runtime_params(flat_config)
    return {
        k: v
        for k, v in flat_config.items()
        if k in fields and k not in _LAYOUT_KEYS and not is_runtime_key(k, params)
    }


def diff(a_path: Path, b_path: Path) -> DiffReport:
    """Field-by-field difference between two sides: contract fields, then runtime configuration fields."""
    a, b = load_side(a_path), load_side(b_path)
    report = DiffReport(a, b)
    # each side's data as its manifest holds it, not as its contract says (a replaced manifest, a forged contract)
    for key, old, new in contract_diff({**a.fields, **a.data}, {**b.fields, **b.data}):
        report.contract.append(FieldDiff(key, old, new, runtime=False))
    params = _runtime_params(a.config) + _runtime_params(b.config)
    for key in sorted(set(a.config) | set(b.config)):
        if is_runtime_key(key, params) and a.config.get(key) != b.config.get(key):
            report.runtime.append(
                FieldDiff(key, a.config.get(key, "<absent>"), b.config.get(key, "<absent>"), True)
            )
    return report


def _runtime_params(flat_config: dict[str, Any]) -> list[str]:
    # the recorded config as it is (one from another version still diffs): no RelayConfig is built from it
    names = flat_config.get("runtime_params")
    return [p for p in names if isinstance(p, str)] if isinstance(names, list) else []


def format_report(report: DiffReport) -> list[str]:
    """Human lines: one per differing field, runtime-only fields marked."""
    lines = [
        f"A: {report.a.path} ({report.a.kind}{', ' + report.a.checkpoint if report.a.checkpoint else ''}), "
        f"contract {report.a.contract_sha256}",
        f"B: {report.b.path} ({report.b.kind}{', ' + report.b.checkpoint if report.b.checkpoint else ''}), "
        f"contract {report.b.contract_sha256}",
    ]
    for side in (report.a, report.b):
        if side.checkpoint_contract and side.checkpoint_contract != side.contract_sha256:
            lines.append(f"note: {side.path} was saved under contract {side.checkpoint_contract}")
        if side.drift:
            lines.append(
                f"{side.path}/config.json differs from its own contract ({len(side.drift)}): a resume of it is "
                "refused"
            )
            lines.extend(f"  {k}: {_short(old)} -> {_short(new)}" for k, old, new in side.drift)
        if side.data_drift:
            lines.append(
                f"note: {side.path}/data/manifest.jsonl, read under config.json's data_root, lists other samples "
                "than its own contract: a resume under that data_root is refused"
            )
            lines.extend(f"  {k}: {_short(old)} -> {_short(new)}" for k, old, new in side.data_drift)
        if side.data_problem is not None:
            lines.append(
                f"{side.path}: its manifest cannot be read, a resume of it is refused: {side.data_problem}"
            )
    if report.contract:
        lines.append(f"contract fields that differ ({len(report.contract)}): one cannot continue the other")
        lines.extend(f"  {d.key}: {_short(d.a)} -> {_short(d.b)}" for d in report.contract)
    elif report.same_contract:
        lines.append("contract: identical (one can continue the other)")
    else:
        lines.append(
            "contract: identical, but a resume is refused (config.json or the manifest differs from the contract)"
        )
    if report.runtime:
        lines.append(f"runtime-only fields that differ ({len(report.runtime)}): allowed between segments")
        lines.extend(f"  {d.key}: {_short(d.a)} -> {_short(d.b)}  [runtime]" for d in report.runtime)
    else:
        lines.append("runtime fields: identical")
    return lines


def _short(value: Any, limit: int = 100) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 3] + "..."
