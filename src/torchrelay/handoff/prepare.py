"""`prepare`: re-point a bundle at this cluster's paths, prove nothing else changed, and lay out the run dir.

Order matters: every check that can fail runs before anything lands in the run directory; the run
directory is assembled in a temporary sibling and renamed into place only at the end, so a failure
leaves nothing half-prepared, and a second run on a prepared directory only re-checks it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.config import RelayConfig
from torchrelay.contract import load_contract
from torchrelay.errors import ConfigError, IntegrityError, RelayError
from torchrelay.fsutil import atomic_write_bytes, atomic_write_text, fsync_dir, kill_point
from torchrelay.handoff.copying import copy_many
from torchrelay.handoff.pack import BUNDLE_INFO, read_bundle_info, read_bundle_record, read_manifest_info
from torchrelay.handoff.signing import parse_digest
from torchrelay.handoff.source import SOURCE_DIR, extract_source
from torchrelay.handoff.verify import VerifyReport, verify_bundle
from torchrelay.history import new_id, read_history
from torchrelay.identity import tree_note
from torchrelay.layout import (
    CONFIG_FILE,
    CONTRACT_FILE,
    HISTORY_FILE,
    LINEAGE_FILE,
    MANIFEST_REL,
    PREPARE_RECORD,
    SOURCE_MANIFEST,
    TRAIN_DIR,
)
from torchrelay.log import logger
from torchrelay.manifest import Manifest
from torchrelay.numerics import compare_here, gather
from torchrelay.resume_check import ResumeCheck, validate_resume
from torchrelay.rundir import RunDir
from torchrelay.util import schema
from torchrelay.util.dotted import flatten
from torchrelay.util.hashing import ByteCallback, sha256_file
from torchrelay.util.safepath import check_relative, resolve_inside

RECORD = PREPARE_RECORD
# Keys prepare owns itself: the manifest always lives in the run directory.
_MANAGED = {
    "manifest": "the manifest is always the run directory's data/manifest.jsonl; set data_root instead"
}
# Files that carry on appending or get rewritten in the run dir are never hardlinked to the bundle.
_NEVER_LINK_PREFIXES = (f"{TRAIN_DIR}/", HISTORY_FILE, CONFIG_FILE, MANIFEST_REL)

Say = Callable[[str], None]


class PrepareRefused(IntegrityError):
    """prepare refused the bundle: one or more of its preflight checks failed; `failures` names each (the
    controller's own preflight before a launch raises controller.preflight.PreflightFailed)."""

    def __init__(self, failures: list[str]) -> None:
        body = "\n".join(f"  - {f}" for f in failures)
        super().__init__(
            f"PREFLIGHT: FAIL ({len(failures)} problem(s)); nothing was written to the run directory:\n{body}",
            hint="fix each problem and run prepare again",
        )
        self.failures = failures


@dataclass(kw_only=True, slots=True)
class PrepareOptions:
    """Where to prepare, what to change, and how to copy."""

    # `--help` reads `doc` and `metavar` (commands/prepare.py declares the options from these fields)
    run_dir: Path = field(metadata={"doc": "the run directory to create (new or empty)"})
    sets: dict[str, Any] = field(default_factory=dict)
    copy_mode: str = field(default="copy", metadata={"choices": ("copy", "hardlink")})
    check_files: bool = field(
        default=False, metadata={"doc": "check every manifest file exists under the new root"}
    )
    code_dir: Path | None = field(
        default=None, metadata={"doc": "validate against this checkout instead of the bundle's source"}
    )
    jobs: int | None = field(default=None, metadata={"doc": "hash/copy threads (default: one per core)"})
    expect: str | None = None  # the bundle digest the packer gave: anything else is refused
    allowed_signers: Path | None = None  # SHA256SUMS.sig must verify against one of these keys
    world_size: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "metavar": "N",
            "doc": "continue on N ranks: a layout change that keeps the global batch (grad_accum is derived)",
        },
    )
    micro_batch: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "metavar": "M",
            "doc": "with --world-size: the per-rank micro-batch of the new layout (default: the checkpoint's)",
        },
    )

    def __post_init__(self) -> None:
        schema.check(self, "prepare")
        if self.expect is not None:
            self.expect = parse_digest(self.expect)


@dataclass(slots=True)
class PrepareResult:
    """The prepared run directory, what changed (old -> new), and the passed checks."""

    run_dir: Path
    changes: dict[str, list[Any]]
    passed: list[str]
    already_prepared: bool = False
    code_dir: Path | None = None
    seconds: float = 0.0
    layout_change: dict[str, Any] | None = None  # reshard.change_record, with --world-size / --micro-batch


@dataclass(slots=True)
class _Hooks:
    say: Say
    on_bytes: ByteCallback | None
    on_files: Callable[[int, int], None] | None


def allowed_keys(cfg: RelayConfig) -> list[str]:
    """The keys `--set` accepts: the configuration's runtime keys, minus the ones prepare manages."""
    return [k for k in cfg.runtime_keys() if k not in _MANAGED]


def apply_sets(cfg: RelayConfig, sets: dict[str, Any]) -> tuple[RelayConfig, dict[str, list[Any]]]:
    """The configuration with `sets` applied, and {key: [old, new]}; refuses any non-runtime key."""
    allowed = allowed_keys(cfg)
    refused = [k for k in sets if k not in allowed]
    if refused:
        why = [f"{k} ({_MANAGED[k]})" for k in refused if k in _MANAGED]
        raise ConfigError(
            f"--set refused for {', '.join(refused)}: only server-specific (runtime) fields may change"
            + (f"; {'; '.join(why)}" if why else ""),
            hint=f"allowed keys: {', '.join(allowed)}; every other field is part of the training contract",
        )
    before = flatten(cfg.to_dict())
    new = cfg.with_dotted(sets, source="--set")
    after = flatten(new.to_dict())
    changes = {
        k: [before.get(k), after.get(k)]
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    }
    return new, changes


def prepare(
    bundle: Path,
    options: PrepareOptions,
    *,
    say: Say = logger.info,
    on_bytes: ByteCallback | None = None,
    on_files: Callable[[int, int], None] | None = None,
) -> PrepareResult:
    """Check everything, then assemble the run directory from the bundle; raise PrepareRefused naming each failure."""
    started = time.perf_counter()
    hooks = _Hooks(say, on_bytes, on_files)
    bundle = Path(bundle).resolve()
    run_dir = Path(options.run_dir).absolute()
    # Fail fast on what needs no hashing: a --set of a contract field, an unrelated run directory.
    try:
        early = RelayConfig.from_dict(read_bundle_record(bundle / CONFIG_FILE, "the run's configuration"))
    except (RelayError, ValueError):
        early = None  # a damaged file: the verification below names it
    if early is not None:
        apply_sets(early, options.sets)
    _refuse_unrelated(run_dir)

    # Every byte against SHA256SUMS before any file of the bundle is believed.
    say("verifying the bundle against SHA256SUMS")
    report = verify_bundle(
        bundle,
        jobs=options.jobs,
        on_bytes=on_bytes,
        expect=options.expect,
        allowed_signers=options.allowed_signers,
    )
    if not report.ok:
        raise PrepareRefused([f"bundle file {p}" for p in report.problems()])

    info = read_bundle_info(bundle)
    contract = load_contract(bundle)
    stored = RelayConfig.from_dict(
        read_bundle_record(bundle / CONFIG_FILE, "the run's configuration"), source=CONFIG_FILE
    )
    new_cfg, changes = apply_sets(stored, options.sets)

    existing = _existing_state(run_dir, info)
    if existing is not None:
        return _recheck(run_dir, existing, changes, options, contract, hooks, started)

    _remove_stale_temporaries(run_dir.parent, f".{run_dir.name}.prepare-tmp-")
    tmp = run_dir.parent / f".{run_dir.name}.prepare-tmp-{new_id()}"
    tmp.mkdir(parents=True)
    try:
        result = _prepare_into(tmp, bundle, report, info, contract, stored, new_cfg, changes, options, hooks)
        kill_point("prepare:assembled")
        # One step from nothing to a whole run dir (an empty DIR is replaced): a kill on either side of it
        # leaves no DIR (the next prepare removes the temporary) or a prepared one (the next one re-checks it).
        os.rename(tmp, run_dir)
        fsync_dir(run_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kill_point("prepare:renamed")
    result.run_dir = run_dir
    if result.code_dir is not None and options.code_dir is None:
        result.code_dir = run_dir / result.code_dir.relative_to(tmp)
    result.seconds = time.perf_counter() - started
    return result


def _prepare_into(
    tmp: Path,
    bundle: Path,
    report: VerifyReport,
    info: dict[str, Any],
    contract: dict[str, Any],
    stored: RelayConfig,
    new_cfg: RelayConfig,
    changes: dict[str, list[Any]],
    options: PrepareOptions,
    hooks: _Hooks,
) -> PrepareResult:
    fields = contract["fields"]
    failures: list[str] = []
    proofs: list[str] = []

    # 1. Data: rebase the manifest into the temporary dir and prove the fingerprint unchanged.
    (tmp / "data").mkdir()
    manifest_src = resolve_inside(bundle, MANIFEST_REL, source=str(bundle))
    old_manifest = Manifest.load(manifest_src, stored.data_root)
    recorded = read_manifest_info(bundle)["fingerprint"]
    fp_old = old_manifest.fingerprint()
    rebased_path = tmp / MANIFEST_REL
    if new_cfg.data_root != stored.data_root:
        lines = old_manifest.rebased_lines(new_cfg.data_root)
        rebased_path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    else:
        shutil.copyfile(manifest_src, rebased_path)
    new_manifest = Manifest.load(rebased_path, new_cfg.data_root)
    fp_new = new_manifest.fingerprint()
    if not (fp_old == fp_new == fields.get("data.fingerprint") == recorded):
        failures.append(
            f"data manifest fingerprint changed: recorded {fields.get('data.fingerprint')}, "
            f"manifest_info {recorded}, before rebase {fp_old}, after rebase {fp_new}"
        )
    else:
        proofs.append(
            f"manifest rebased {stored.data_root!r} -> {new_cfg.data_root!r}: sha256 {old_manifest.sha256()[:16]}... "
            f"-> {new_manifest.sha256()[:16]}..., fingerprint unchanged {fp_new}"
        )
        hooks.say(f"manifest fingerprint unchanged: {fp_new}")
    if options.check_files:
        failures.extend(_check_files(new_manifest, hooks, proofs))

    # 2. External files: each must hash to the identity the contract recorded.
    for name, path in sorted(new_cfg.external_files.items()):
        want = fields.get(f"external.{name}.sha256")
        if not Path(path).is_file():
            failures.append(f"external file {name!r}: {path} does not exist (set external_files.{name}=PATH)")
            continue
        got = sha256_file(Path(path))[0]
        if got != want:
            failures.append(
                f"external file {name!r}: {path} has SHA-256 {got}, the run was trained with {want}"
            )
        else:
            proofs.append(f"external file {name}: {path} SHA-256 {got} = contract external.{name}.sha256")

    # 3. The bundle was verified before it was read; record the proof.
    proofs.append(
        f"{len(report.sums.checks)} bundle files ({report.sums.total_bytes:,} bytes) match SHA256SUMS "
        f"(bundle digest sha256:{report.digest}); inventories of {', '.join(report.checkpoints)} match"
    )
    if options.expect is not None:
        proofs.append(f"bundle digest sha256:{report.digest} = --expect")
    if report.signer is not None:
        proofs.append(f"SHA256SUMS.sig: signed by {report.signer} ({options.allowed_signers})")

    # 4. The exact code: the bundle's archive, extracted (or the caller's checkout).
    code_dir = options.code_dir
    from_bundle = (
        False  # the caller's own checkout may be asked for its git identity; the bundle's tree never
    )
    source = info.get("source") or {}
    if not isinstance(source, dict):
        raise IntegrityError(
            f"{bundle / BUNDLE_INFO}: 'source' is not an object", hint="the bundle is damaged"
        )
    if code_dir is None and source.get("archive"):
        from_bundle = True
        archive = resolve_inside(bundle, str(source["archive"]), source=str(bundle / BUNDLE_INFO))
        prefix = check_relative(str(source.get("archive_prefix")), source="bundle.json source.archive_prefix")
        code_dir = extract_source(archive, tmp / "source", prefix.as_posix())
        if source.get("untracked"):  # the program's files git did not track, beside the commit's
            extra = resolve_inside(bundle, str(source["untracked"]), source=str(bundle / BUNDLE_INFO))
            extract_source(extra, tmp / "source", prefix.as_posix())
    if failures:
        raise PrepareRefused(failures)

    # 5. The trainer's own validation, on the bundle itself, before anything is copied (with --world-size, of
    # the layout change: the global batch must stay).
    check_cfg = new_cfg.replace(manifest=str(rebased_path))
    if options.micro_batch is not None:
        check_cfg = check_cfg.replace(micro_batch=options.micro_batch)
    world_size = options.world_size or int(fields["world_size"])
    reshard = options.world_size is not None or options.micro_batch is not None
    explicit = {"micro_batch"} if options.micro_batch is not None else set()

    def trainer_validation(where: str, run_dir: Path, cfg: RelayConfig) -> ResumeCheck:
        """The launch's own resume validation, on the bundle and again on the assembled directory."""
        try:
            return validate_resume(
                run_dir,
                cfg,
                world_size,
                code_dir,
                deep=False,
                code_from_bundle=from_bundle,
                reshard=reshard,
                explicit=explicit,
            )
        except RelayError as exc:
            raise PrepareRefused([f"trainer validation on the {where}: {exc}"]) from None

    check = trainer_validation("bundle", bundle, check_cfg)
    assert check.config is not None
    layout_change = check.layout_change
    if layout_change is not None:
        layout_change["asked_by"] = "prepare"
        for key in ("micro_batch", "grad_accum"):
            old, new = layout_change["from"][key], layout_change["to"][key]
            if old != new:
                changes[key] = [old, new]  # kept over a script's original split (resume_check.keep_prepared)
        new_cfg = new_cfg.replace(micro_batch=check.config.micro_batch, grad_accum=check.config.grad_accum)
    numerics = _numerics_here(bundle, check.update, new_cfg, proofs)

    # 6. Copy (or link) into the temporary run dir, re-hashing every byte against what was verified.
    _copy_bundle(bundle, tmp, report, options, hooks)
    _copy_source_manifest(bundle, tmp, report)
    (tmp / (MANIFEST_REL + ".orig")).unlink(missing_ok=True)
    shutil.copyfile(manifest_src, tmp / (MANIFEST_REL + ".orig"))
    shutil.copyfile(bundle / CONFIG_FILE, tmp / f"{CONFIG_FILE}.orig")
    final_cfg = new_cfg.replace(manifest=stored.manifest)
    atomic_write_text(tmp / CONFIG_FILE, json.dumps(final_cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    lineage = {"lineage": info.get("lineage"), "parent_lineage": info.get("parent_lineage")}
    atomic_write_text(tmp / LINEAGE_FILE, json.dumps(lineage))

    # 7. The same validation again on the assembled directory, which is what the launch will see.
    final = trainer_validation("prepared directory", tmp, final_cfg.replace(manifest=str(tmp / MANIFEST_REL)))
    code_note = tree_note(final.code_changes, commit=fields.get("code.commit") is not None)
    if code_note:
        hooks.say(f"warning: {code_note}")
    passed = proofs + check.passed + [p for p in final.passed if p not in check.passed]
    record = {
        "format": 1,
        "tool": f"torchrelay {__version__}",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bundle": str(bundle),
        "bundle_lineage": info.get("lineage"),
        "parent_lineage": info.get("parent_lineage"),
        "sums_sha256": report.digest,
        "signed_by": report.signer,
        "checkpoint": info.get("checkpoint"),
        "update": final.update,
        "contract_sha256": contract["sha256"],
        "copy_mode": options.copy_mode,
        # inside the run dir: stored relative, since the temporary dir is renamed into place
        "code_dir": _relative_if_inside(code_dir, tmp),
        "changes": changes,
        "layout_change": layout_change,
        "proofs": passed,
        "numerics": numerics,
        "originals": [f"{CONFIG_FILE}.orig", MANIFEST_REL + ".orig"],
    }
    atomic_write_text(tmp / RECORD, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return PrepareResult(
        run_dir=tmp, changes=changes, passed=passed, code_dir=code_dir, layout_change=layout_change
    )


def _numerics_here(bundle: Path, update: int, cfg: RelayConfig, proofs: list[str]) -> dict[str, Any]:
    """This machine's numerics identity against the bundle's segments: a difference is warned (one line), never
    refused here: prepare may run on another machine than the training (a login node); the launch compares again
    and, with strict_numerics, refuses."""
    here = gather()
    found = compare_here(read_history(bundle), here, upto=update)
    if found is not None and found["segments"]:
        then = " (strict_numerics: a launch here refuses it)" if cfg.strict_numerics else ""
        logger.warning(f"[torchrelay] warning: on this machine, {found['line']}{then}")
    elif found is not None and found["unknown"]:
        logger.info(f"[torchrelay] {found['line']}")
    elif found is not None:
        proofs.append(
            "numerics: this machine's processor and libraries are the bundle's segments' (the program's "
            "threads, TF32 and determinism are compared at launch)"
        )
    return {"here": here, "change": found}


def _copy_bundle(
    bundle: Path, tmp: Path, report: VerifyReport, options: PrepareOptions, hooks: _Hooks
) -> None:
    digests = report.sums.digests()
    checkpoints = tuple(c + "/" for c in report.checkpoints)
    wanted = [
        c.path
        for c in report.sums.checks
        if c.path.startswith(checkpoints)
        or c.path.startswith(("train/", "validation/"))
        or c.path in (CONFIG_FILE, CONTRACT_FILE, HISTORY_FILE)
    ]
    link_ok = options.copy_mode == "hardlink"
    linkable = [p for p in wanted if link_ok and not p.startswith(_NEVER_LINK_PREFIXES)]
    rest = [p for p in wanted if p not in set(linkable)]
    results = copy_many(
        [(resolve_inside(bundle, p, source=str(bundle)), tmp / p) for p in linkable],
        link=True,
        jobs=options.jobs,
        on_bytes=hooks.on_bytes,
    )
    results += copy_many(
        [(resolve_inside(bundle, p, source=str(bundle)), tmp / p) for p in rest],
        link=False,
        jobs=options.jobs,
        on_bytes=hooks.on_bytes,
    )
    for r in results:
        rel = r.dst.relative_to(tmp).as_posix()
        if digests.get(rel, ("", -1))[0] != r.sha256:
            raise IntegrityError(
                f"{bundle / rel} changed between verification and copy (SHA-256 {r.sha256})",
                hint="something is writing into the bundle; re-download it and run prepare again",
            )


def _copy_source_manifest(bundle: Path, tmp: Path, report: VerifyReport) -> None:
    """The bundle's source manifest, at the run dir's top (source/ holds only the tree): it names each file a
    later edit of the tree changed (identity.code_identity); checked against the verified digest."""
    rel = f"{SOURCE_DIR}/{SOURCE_MANIFEST}"
    want = report.sums.digests().get(rel)
    if want is None:
        return
    data = resolve_inside(bundle, rel, source=str(bundle)).read_bytes()
    if hashlib.sha256(data).hexdigest() != want[0]:
        raise IntegrityError(
            f"{bundle / rel} changed between verification and copy",
            hint="something is writing into the bundle; re-download it and run prepare again",
        )
    atomic_write_bytes(tmp / SOURCE_MANIFEST, data)


def _check_files(manifest: Manifest, hooks: _Hooks, proofs: list[str]) -> list[str]:
    paths = list(manifest.paths())
    missing: list[str] = []
    for i, path in enumerate(paths, 1):
        if not os.path.exists(path):
            missing.append(path)
        if hooks.on_files is not None and (i % 256 == 0 or i == len(paths)):
            hooks.on_files(i, len(paths))  # (checked so far, total)
    if missing:
        examples = ", ".join(missing[:5])
        return [
            f"--check-files: {len(missing)} of {len(paths)} manifest files missing under the new root, e.g. {examples}"
        ]
    proofs.append(f"--check-files: all {len(paths)} manifest files exist under {manifest.data_root}")
    hooks.say(f"all {len(paths)} manifest files exist")
    return []


def _remove_stale_temporaries(parent: Path, prefix: str) -> None:
    """A prepare killed mid-way leaves only its temporary sibling; the next one removes it."""
    if parent.is_dir():
        for child in parent.iterdir():
            if child.name.startswith(prefix) and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)


def _refuse_unrelated(run_dir: Path) -> None:
    """Refuse at once a non-empty directory that no prepare wrote (the bundle's lineage is compared later)."""
    if run_dir.is_dir() and any(run_dir.iterdir()) and not (run_dir / RECORD).is_file():
        shown = sorted(p.name for p in run_dir.iterdir())[:5]
        raise ConfigError(
            f"{run_dir} is not empty ({shown}) and was not prepared from a bundle",
            hint="choose a new or empty --run-dir; prepare never writes into an unrelated directory",
        )


def _existing_state(run_dir: Path, info: dict[str, Any]) -> dict[str, Any] | None:
    """None for a new or empty run dir; the record if it was prepared from this bundle; refuse otherwise."""
    if not run_dir.exists():
        return None
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} exists and is not a directory", hint="choose another --run-dir")
    if not any(run_dir.iterdir()):
        return None
    record_path = run_dir / RECORD
    if record_path.is_file():
        record = read_bundle_record(record_path, "the rebase record")
        if record.get("bundle_lineage") == info.get("lineage"):
            return record
        raise ConfigError(
            f"{run_dir} was prepared from another bundle (lineage {record.get('bundle_lineage')}, "
            f"this bundle is {info.get('lineage')})",
            hint="choose a new --run-dir",
        )
    shown = sorted(p.name for p in run_dir.iterdir())[:5]
    raise ConfigError(
        f"{run_dir} is not empty ({shown}) and was not prepared from this bundle",
        hint="choose a new or empty --run-dir; prepare never writes into an unrelated directory",
    )


def _recheck(
    run_dir: Path,
    record: dict[str, Any],
    changes: dict[str, list[Any]],
    options: PrepareOptions,
    contract: dict[str, Any],
    hooks: _Hooks,
    started: float,
) -> PrepareResult:
    """A second prepare on the same directory changes nothing; it re-runs the trainer's validation."""
    if options.sets and changes != record.get("changes"):
        raise ConfigError(
            f"{run_dir} was already prepared from this bundle with {record.get('changes')}, not {changes}",
            hint="to change a runtime field now, launch with TORCHRELAY_OVERRIDES, or prepare a new --run-dir",
        )
    hooks.say(f"{run_dir} was already prepared from this bundle at {record.get('time')}; re-checking only")
    moved = record.get("layout_change") or {}
    world_size = int((moved.get("to") or contract["fields"])["world_size"])
    if options.world_size is not None and options.world_size != world_size:
        raise ConfigError(
            f"{run_dir} was already prepared from this bundle for {world_size} rank(s), not {options.world_size}",
            hint="prepare a new --run-dir for another world size",
        )
    rd = RunDir(run_dir)
    cfg = rd.load_config()
    recorded_code = record.get("code_dir")
    code_dir = options.code_dir or (run_dir / str(recorded_code) if recorded_code else None)
    # the bundle's extracted source lives inside the run dir (recorded relative): never run git there
    from_bundle = options.code_dir is None and code_dir is not None and code_dir.is_relative_to(run_dir)
    if code_dir is not None and not code_dir.is_dir():
        code_dir = None
    try:
        check = validate_resume(
            run_dir,
            cfg.replace(manifest=str(run_dir / MANIFEST_REL)),
            world_size,
            code_dir,
            code_from_bundle=from_bundle,
        )
    except RelayError as exc:
        raise PrepareRefused([f"trainer validation on {run_dir}: {exc}"]) from None
    return PrepareResult(
        run_dir=run_dir,
        changes=record.get("changes", {}),
        passed=check.passed,
        already_prepared=True,
        code_dir=code_dir,
        layout_change=record.get("layout_change"),
        seconds=time.perf_counter() - started,
    )


def _relative_if_inside(path: Path | None, root: Path) -> str | None:
    if path is None:
        return None
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
