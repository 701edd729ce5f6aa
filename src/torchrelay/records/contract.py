"""The resume contract: every field that must not change for a continuation to be the same run."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchrelay.config.relay import RUNTIME_FIELDS, RelayConfig
from torchrelay.errors import ConfigError, ContractMismatch, IntegrityError
from torchrelay.identity import CODE_FIELDS, code_changes, code_identity, versions
from torchrelay.manifest import Manifest, index_root
from torchrelay.paths.layout import CONTRACT_FILE  # noqa: F401 - a name its readers (diff, the tests) import from here
from torchrelay.paths.rundir import RunDir
from torchrelay.util.dotted import flatten
from torchrelay.util.hashing import canonical_json, sha256_hex, sha256_json
from torchrelay.util.records import Field, Optional, Schema, check, read_json
from torchrelay.util.schema import INT_LIMIT, hints

CONTRACT_FORMAT = 1
# A plain source tree (an extracted `git archive`) knows its tree hash but not its commit: the commit is
# compared only when both sides know it, the tree always.
_OPTIONAL_WHEN_UNKNOWN = ("code.commit",)
# Fields added after contracts were first written (format 1 all along): a contract without them is compared
# without them, so a run made before them still resumes; code.dirty then keeps its old sense (tracked files only).
LATER_FIELDS = (
    "code.untracked",
    "code.modified",
    "code.program",
    "code.changed",
    "data.sha256",
    "data.lengths_sha256",
)


# What a field of a recorded contract may hold. A contract is re-hashed by whoever edits it, so its hash proves no
# value: each is checked before status, ledger, prepare or a resume computes with it (global_batch 0 divided by
# zero, Infinity overflowed an int). The configuration's fields take their rules from RelayConfig's own metadata.
_COUNT = 1 << 40  # updates, samples, a batch: more than any run, far below what an int64 or an array holds
_HEX = Field(str, length=128)
_NONE = type(None)
_PATH_LIMIT = 4096  # PATH_MAX
_CODE_MAP = Field(
    dict,
    items=1 << 20,
    keys=Field(str, length=_PATH_LIMIT, path=True),
    values=Field((str, _NONE), length=128),
)


def _config_rule(name: str) -> Field:
    """A contract field's rule from RelayConfig's annotation and metadata (`min`, `max`, `choices`)."""
    f = next(f for f in dataclasses.fields(RelayConfig) if f.name == name)
    hint, meta = hints(RelayConfig)[name], f.metadata
    if hint is int:  # a count is at most _COUNT (a product of three stays an int64); a seed any int64
        return Field(int, low=meta.get("min"), high=meta.get("max", INT_LIMIT if name == "seed" else _COUNT))
    if hint is str:
        return Field(str, choices=tuple(meta["choices"]) if meta.get("choices") else None)
    if hint is bool:
        return Field(bool)
    if hint == list[int]:
        return Field([int], low=0, high=_COUNT)
    return Field([str])  # pins


CONTRACT_SCHEMA = Schema(
    {
        **{
            f.name: Optional(_config_rule(f.name))
            for f in dataclasses.fields(RelayConfig)
            if f.name not in RUNTIME_FIELDS and f.name != "params"
        },
        "world_size": Optional(Field(int, low=1, high=1 << 20)),
        "global_batch": Optional(Field(int, low=1, high=_COUNT)),
        "schedule.total_updates": Optional(Field(int, low=1, high=_COUNT)),
        "schedule.warmup_updates": Optional(Field(int, low=0, high=_COUNT)),
        "data.fingerprint": Optional(Field(str, length=200)),
        "data.samples": Optional(Field(int, low=1, high=_COUNT)),
        "data.sha256": Optional(Field((str, _NONE), length=128)),
        "data.lengths_sha256": Optional(Field(str, length=128)),
        "code.commit": Optional(Field((str, _NONE), length=128)),
        "code.tree": Optional(Field((str, _NONE), length=128)),
        "code.dirty": Optional(Field((bool, _NONE))),  # null: no code directory, nothing to call dirty
        "code.dirty_sha256": Optional(Field((str, _NONE), length=128)),
        "code.untracked": Optional(_CODE_MAP),
        "code.modified": Optional(_CODE_MAP),
        "code.program": Optional(Field([str], items=1 << 20, length=_PATH_LIMIT, path=True)),
        "code.changed": Optional(
            Field((dict, _NONE), items=1 << 20, keys=_CODE_MAP.keys, values=_CODE_MAP.values)
        ),
    },
    prefixes={
        "versions.": Field((str, _NONE), length=200),
        "external.": Field(str, length=128),
        # the user's own hyper-parameters: any JSON value, finite, of a sane size
        "params.": Field((str, int, float, bool, _NONE, list, dict), size=1 << 20, length=1 << 20),
    },
)


def contract_manifest(
    path: str | os.PathLike[str],
    data_roots: Sequence[str],
    fields: dict[str, Any],
    *,
    index: str | os.PathLike[str] | None,
    root: str | os.PathLike[str] | None,
) -> Manifest:
    """A run's manifest as its recorded contract is checked against it: the saved index is believed only for the
    bytes the contract binds (`data.sha256`); other bytes are read line by line, so `data.fingerprint` is compared
    with the bytes' own fingerprint, never with what an index says of them.

    Why the field: the fingerprint covers the content, but a resume took it from the index, and the index's only
    tie to the bytes is the digest in its own meta, which whoever replaces the manifest writes too. A contract
    written before the field does not record it ("" below vouches for no bytes): its run still resumes, reading
    every line to check the fingerprint.

    data_roots: the roots the manifest may be written under, tried in turn until one gives the contract's
    fingerprint; for the run's own copy (`root`, the run directory) also the root its index was saved under, which
    finds a copy that a launch re-pointed (run/directory.py) and was killed before config.json named the root.
    Trying several is sound: the fingerprint is read from the bytes, and a root under which it matches names the
    same samples. Where none does, the manifest read under the first (the contract's comparison names what
    differs)."""
    bound = str(fields.get("data.sha256") or "")
    candidates = [*data_roots, index_root(index) if root is not None and index is not None else None]
    tried: list[Manifest] = []
    for data_root in candidates:
        if data_root is None or any(m.written_under(data_root) for m in tried):
            continue
        found = Manifest.load(path, data_root, index=index, root=root, bound_sha256=bound)
        if found.indexed and not _lengths_vouched(found, fields):
            found = Manifest.load(path, data_root, index=None, root=root)
        if found.fingerprint() == fields.get("data.fingerprint"):
            return found
        tried.append(found)
    return tried[0]


def _lengths_vouched(manifest: Manifest, fields: dict[str, Any]) -> bool:
    """Whether the lengths an index gave are the ones the contract records (`data.lengths_sha256`), all of them:
    the index spot-checks a spread of lengths against the lines, which a forger who knows the spread passes. A
    contract written before the field vouches for none a length-bucketed sampler uses (the lines are read)."""
    recorded = fields.get("data.lengths_sha256")
    if not isinstance(recorded, str):
        return fields.get("sampler") != "length_bucketed"
    return manifest.lengths_sha256() == recorded


def contract_sha256(fields: dict[str, Any]) -> str:
    return sha256_json(fields)


def build_contract(
    cfg: RelayConfig,
    world_size: int,
    code_dir: str | os.PathLike[str] | None,
    manifest: Manifest | None = None,
    *,
    use_git: bool = True,
    code_files: list[str] | tuple[str, ...] = (),
    known: dict[str, Any] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Recompute the contract from a configuration and what is installed and on disk here.

    use_git=False: `code_dir` is untrusted (extracted from a bundle); its identity is a plain content hash.
    code_files: the running program's files (identity.running_files); known: the recorded contract's fields, whose
    code files are looked at too (see identity.code_identity); run_dir: the run's own directory, never code.
    """
    manifest = manifest or Manifest.load(cfg.manifest, cfg.data_root)
    config = cfg.to_dict()
    for name in RUNTIME_FIELDS:
        config.pop(name, None)
    config["params"] = {k: v for k, v in cfg.params.items() if k not in cfg.runtime_params}
    if config.get("elastic") == "default":
        # Absent means default: a contract written before the field, and its digest, stay as they were.
        config.pop("elastic")
    pinned = versions(cfg.pins)
    code = code_identity(code_dir, use_git=use_git, files=code_files, known=known, run_dir=run_dir)
    tracked_dirty = code.pop("_tracked_dirty", None)
    fields: dict[str, Any] = {
        **flatten(config),
        "world_size": world_size,
        "global_batch": cfg.global_batch_for(world_size),
        "schedule.total_updates": cfg.total_updates,
        "schedule.warmup_updates": cfg.warmup_updates,
        "data.fingerprint": manifest.fingerprint(),
        "data.samples": len(manifest),
        "data.sha256": _bound_sha256(manifest, known),
        "data.lengths_sha256": manifest.lengths_sha256(),
        **{f"code.{k}": v for k, v in code.items()},
        "versions.python": pinned["python"],
        "versions.torch": pinned["torch"],
        **{f"versions.{k}": v for k, v in pinned.items() if k not in ("python", "torch", "torchrelay")},
    }
    for name, path in sorted(cfg.external_files.items()):
        if not Path(path).is_file():
            raise ConfigError(
                f"external file {name!r} not found at {path}",
                hint=f"point config field external_files.{name} at the file (a runtime field)",
            )
        fields[f"external.{name}.sha256"] = sha256_hex(path)
    # Not part of the contract: what code.dirty meant before untracked files counted, for an older contract.
    compat = {"code.dirty": tracked_dirty}
    return {"format": CONTRACT_FORMAT, "fields": fields, "sha256": contract_sha256(fields), "compat": compat}


def _bound_sha256(manifest: Manifest, known: dict[str, Any] | None) -> str:
    """`data.sha256`: the manifest's bytes at the run's creation, which vouch for its saved index. A rebase
    (`prepare`, a relaunch with another data_root) rewrites the bytes and keeps the content: a recorded value
    stays, and the content is judged by `data.fingerprint`, read from the bytes unless they are these."""
    recorded = None if known is None else known.get("data.sha256")
    if not isinstance(recorded, str):
        return manifest.sha256()
    if manifest.indexed and manifest.sha256() != recorded:
        # an invariant, not input: a caller that checks a contract loads the manifest with contract_manifest
        raise AssertionError(f"{manifest.path}: a fingerprint from an index the contract does not vouch for")
    return recorded


def comparable(recorded: dict[str, Any], recomputed: dict[str, Any]) -> dict[str, Any]:
    """The recomputed contract in the recorded one's terms: a field added later (LATER_FIELDS) that the recorded
    contract lacks is left out, and code.dirty takes its sense of then; a run made before stays resumable, and
    its contract digest stays the one it recorded."""
    fields = dict(recomputed["fields"])
    if all(key in recorded for key in LATER_FIELDS):
        return recomputed
    for key in LATER_FIELDS:
        if key not in recorded:
            fields.pop(key, None)
    compat = recomputed.get("compat") or {}
    if "code.untracked" not in recorded and "code.dirty" in fields and compat.get("code.dirty") is not None:
        fields["code.dirty"] = compat["code.dirty"]
    return {**recomputed, "fields": fields, "sha256": contract_sha256(fields)}


def contract_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Every field whose value differs, as (field, old, new), sorted by field; a field holding files
    ({path: sha256}) differs file by file, as `field[path]`."""
    out: list[tuple[str, Any, Any]] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        if key in _OPTIONAL_WHEN_UNKNOWN and (a is None or b is None):
            continue
        if key in LATER_FIELDS and (key not in old or key not in new):
            continue  # one side was written before the field existed
        if isinstance(a, dict) and isinstance(b, dict):
            for name in sorted(set(a) | set(b)):
                if a.get(name, "<absent>") != b.get(name, "<absent>"):
                    out.append((f"{key}[{name}]", a.get(name, "<absent>"), b.get(name, "<absent>")))
        elif a != b:
            out.append((key, a, b))
    return out


def contract_changes(
    recorded: dict[str, Any], recomputed: dict[str, Any], *, strict_code: bool = False
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(refused, other): every differing field outside the code identity, and the code's differences as
    identity.code_changes rules them (another file of the tree is `other` unless strict_code)."""
    diffs = [d for d in contract_diff(recorded, recomputed) if d[0].split("[", 1)[0] not in CODE_FIELDS]
    refused, other = code_changes(recorded, recomputed, strict=strict_code)
    return sorted(diffs + refused), other


def write_contract(run: RunDir, contract: dict[str, Any]) -> None:
    from torchrelay.util.durable import atomic_write_text

    recorded = {k: contract[k] for k in ("format", "fields", "sha256")}  # not "compat": it is no field
    atomic_write_text(run.contract_path, canonical_json(recorded) + "\n")


def load_contract(run_dir: str | os.PathLike[str] | RunDir) -> dict[str, Any]:
    """The recorded contract, checked against its own hash."""
    path = RunDir.of(run_dir).contract_path
    try:
        data = read_json(path, what="the training contract")
    except FileNotFoundError as exc:
        raise IntegrityError(f"{path} is missing: this directory holds no torchrelay run") from exc
    if not isinstance(data, dict):
        raise IntegrityError(f"{path} does not hold a JSON object")
    if not isinstance(data.get("fields"), dict) or not isinstance(data.get("sha256"), str):
        raise IntegrityError(
            f"{path}: needs an object 'fields' and its 'sha256'", hint="restore it from a copy"
        )
    if data.get("format") != CONTRACT_FORMAT:
        raise IntegrityError(
            f"{path}: contract format {data.get('format')!r} is not {CONTRACT_FORMAT}",
            hint="this run was written by another torchrelay version; use that version to continue it",
        )
    if contract_sha256(data.get("fields", {})) != data.get("sha256"):
        raise IntegrityError(
            f"{path}: the contract's fields do not match its recorded sha256 (edited by hand?)"
        )
    check(data["fields"], CONTRACT_SCHEMA, source=f"{path} (the training contract)", prefix="fields.")
    return data


def check_contract(
    run: RunDir,
    recomputed: dict[str, Any],
    recorded: dict[str, Any] | None = None,
    *,
    strict_code: bool = False,
) -> dict[str, Any]:
    """Refuse with every differing field listed, or return the recorded contract (another changed file of the
    code's tree is no refusal unless strict_code: identity.code_changes)."""
    recorded = recorded if recorded is not None else load_contract(run)
    recomputed = comparable(recorded["fields"], recomputed)
    diffs, _ = contract_changes(recorded["fields"], recomputed["fields"], strict_code=strict_code)
    if diffs:
        raise ContractMismatch(str(run.contract_path), diffs)
    return recorded


def runtime_changes(old: RelayConfig, new: RelayConfig) -> dict[str, list[Any]]:
    """Runtime fields that changed between the stored and the new configuration: {field: [old, new]}."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    out = {}
    for key in sorted(set(a) | set(b)):
        if (old.is_runtime(key) or new.is_runtime(key)) and a.get(key) != b.get(key):
            out[key] = [a.get(key), b.get(key)]
    return out
