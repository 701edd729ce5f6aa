"""`prepare`: re-point a bundle at this cluster's paths, prove nothing else changed, and lay out the run dir.

Order matters: every check that can fail runs before anything lands in the run directory; the run
directory is assembled in a temporary sibling and renamed into place only at the end, so a failure
leaves nothing half-prepared, and a second run on a prepared directory only re-checks it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.checkpoint.resume_check import ResumeCheck, validate_resume
from torchrelay.config.relay import RelayConfig, stored_config
from torchrelay.errors import ConfigError, IntegrityError, RelayError
from torchrelay.handoff.assemble import (
    Hooks,
    Say,
    check_files,
    copy_bundle,
    copy_source_manifest,
    numerics_here,
)
from torchrelay.handoff.bundle_records import BundleRecords, bundle_config, verified_records
from torchrelay.handoff.copying import through_link
from torchrelay.handoff.prepare_target import _existing_state, _refuse_unrelated, _remove_stale_temporaries
from torchrelay.handoff.signing import parse_digest
from torchrelay.handoff.source import extract_source
from torchrelay.handoff.verify import VerifyReport, verify_bundle
from torchrelay.identity import tree_note
from torchrelay.log import logger
from torchrelay.manifest import Manifest
from torchrelay.paths.destinations import refuse_nested
from torchrelay.paths.layout import CONFIG_FILE, MANIFEST_REL
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.records.history import new_id
from torchrelay.util import schema
from torchrelay.util.dotted import flatten
from torchrelay.util.durable import atomic_write_bytes, atomic_write_text, fsync_dir
from torchrelay.util.hashing import ByteCallback, sha256_file
from torchrelay.util.kill_points import kill_point

# Keys prepare owns itself: the manifest always lives in the run directory.
_MANAGED = {
    "manifest": "the manifest is always the run directory's data/manifest.jsonl; set data_root instead"
}


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
    origin: str | None = None  # where the bundle came from when not `bundle` itself (a store URL): recorded
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
    return _prepare(Bundle(Path(bundle).resolve()), options, Hooks(say, on_bytes, on_files), started)


def _prepare(bundle: Bundle, options: PrepareOptions, hooks: Hooks, started: float) -> PrepareResult:
    run_dir = through_link(Path(options.run_dir).absolute())
    # Fail fast on what needs no hashing: a --set of a contract field, an unrelated run directory. The
    # configuration is read once, here; it is believed once SHA256SUMS vouched for the bytes it was read from.
    try:
        early: RelayConfig | None = bundle_config(bundle)
    except (RelayError, ValueError):
        early = None  # a damaged file: the verification below names it
    if early is not None:
        apply_sets(early, options.sets)
    refuse_nested(bundle.path, "bundle", run_dir, "run directory")
    run = RunDir(run_dir)
    _refuse_unrelated(run)

    # Every byte against SHA256SUMS before any file of the bundle is believed.
    hooks.say("verifying the bundle against SHA256SUMS")
    report = verify_bundle(
        bundle.path,
        jobs=options.jobs,
        on_bytes=hooks.on_bytes,
        expect=options.expect,
        allowed_signers=options.allowed_signers,
    )
    if not report.ok:
        raise PrepareRefused([f"bundle file {p}" for p in report.problems()])

    records = verified_records(bundle, report.sums.digests())
    new_cfg, changes = apply_sets(records.config, options.sets)

    existing = _existing_state(run, records.info)
    if existing is not None:
        return _recheck(run, existing, changes, options, records.contract, hooks, started)

    _remove_stale_temporaries(run_dir.parent, f".{run_dir.name}.prepare-tmp-")
    tmp = run_dir.parent / f".{run_dir.name}.prepare-tmp-{new_id()}"
    tmp.mkdir(parents=True)
    try:
        result = _prepare_into(tmp, bundle, report, records, new_cfg, changes, options, hooks)
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
    bundle: Bundle,
    report: VerifyReport,
    records: BundleRecords,
    new_cfg: RelayConfig,
    changes: dict[str, list[Any]],
    options: PrepareOptions,
    hooks: Hooks,
) -> PrepareResult:
    info, contract, stored = records.info, records.contract, records.config
    fields = contract["fields"]
    failures: list[str] = []
    proofs: list[str] = []

    # 1. Data: rebase the manifest into the temporary dir and prove the fingerprint unchanged.
    into = RunDir(tmp)
    into.data_dir.mkdir()
    manifest_src = bundle.file(MANIFEST_REL)
    old_manifest = Manifest.load(manifest_src, stored.data_root)
    recorded = bundle.manifest_info(report.sums.digests())["fingerprint"]
    fp_old = old_manifest.fingerprint()
    rebased_path = into.manifest_path
    if new_cfg.data_root != stored.data_root:
        try:  # (the one re-pointing of a manifest: a relaunch with another data_root does the same)
            new_manifest = old_manifest.rebase_into(rebased_path, new_cfg.data_root)
        except ConfigError as exc:
            raise PrepareRefused([exc.message]) from None
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
        failures.extend(check_files(new_manifest, hooks, proofs))

    # 2. External files: each must hash to the identity the contract recorded. A path only the bundle's
    # config.json names (not --set here) is the packing cluster's: read only for a name the contract records, and
    # its digest never shown unless it is the contract's (else any file's digest could be asked for by a bundle).
    named_here = _external_names(options.sets)
    for name, path in sorted(new_cfg.external_files.items()):
        want = fields.get(f"external.{name}.sha256")
        ours = name in named_here
        if not ours and not isinstance(want, str):
            failures.append(
                f"external file {name!r}: config.json names {path}, but the contract records no "
                f"external.{name}.sha256; nothing was read (set external_files.{name}=PATH to name it here)"
            )
            continue
        if not Path(path).is_file():
            failures.append(f"external file {name!r}: {path} does not exist (set external_files.{name}=PATH)")
            continue
        got = sha256_file(Path(path))[0]
        if got != want and ours:
            failures.append(
                f"external file {name!r}: {path} has SHA-256 {got}, the run was trained with {want}"
            )
        elif got != want:
            failures.append(
                f"external file {name!r}: {path} (the bundle's config.json names it) does not have the SHA-256 "
                f"the run was trained with, {want} (set external_files.{name}=PATH to this cluster's copy)"
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
    archives, prefix = bundle.source_archives(info) if code_dir is None else ([], "")
    if archives:
        from_bundle = True
        code_dir = extract_source(archives[0], into.source_dir, prefix)
        for extra in archives[1:]:  # the program's files git did not track, beside the commit's
            extract_source(extra, into.source_dir, prefix)
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

    check = trainer_validation("bundle", bundle.path, check_cfg)
    assert check.config is not None
    layout_change = check.layout_change
    if layout_change is not None:
        layout_change["asked_by"] = "prepare"
        for key in ("micro_batch", "grad_accum"):
            old, new = layout_change["from"][key], layout_change["to"][key]
            if old != new:
                changes[key] = [old, new]  # kept over a script's original split (resume_check.keep_prepared)
        new_cfg = new_cfg.replace(micro_batch=check.config.micro_batch, grad_accum=check.config.grad_accum)
    numerics = numerics_here(records.history, check.update, new_cfg, proofs)

    # 6. Copy (or link) into the temporary run dir, re-hashing every byte against what was verified.
    copy_bundle(bundle, into, report, link=options.copy_mode == "hardlink", jobs=options.jobs, hooks=hooks)
    copy_source_manifest(bundle, into, report)
    orig_manifest = into.path / (MANIFEST_REL + ".orig")
    orig_manifest.unlink(missing_ok=True)
    shutil.copyfile(manifest_src, orig_manifest)
    atomic_write_bytes(into.path / f"{CONFIG_FILE}.orig", records.config_bytes)  # the bytes verified
    final_cfg = new_cfg.replace(manifest=stored.manifest)
    atomic_write_text(into.config_path, json.dumps(final_cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    lineage = {"lineage": info.get("lineage"), "parent_lineage": info.get("parent_lineage")}
    atomic_write_text(into.lineage_path, json.dumps(lineage))

    # 7. The same validation again on the assembled directory, which is what the launch will see.
    final = trainer_validation("prepared directory", tmp, final_cfg.replace(manifest=str(into.manifest_path)))
    code_note = tree_note(final.code_changes, commit=fields.get("code.commit") is not None)
    if code_note:
        hooks.say(f"warning: {code_note}")
    passed = proofs + check.passed + [p for p in final.passed if p not in check.passed]
    record = {
        "format": 1,
        "tool": f"torchrelay {__version__}",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "bundle": options.origin or str(bundle.path),
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
    atomic_write_text(into.prepare_record_path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return PrepareResult(
        run_dir=tmp, changes=changes, passed=passed, code_dir=code_dir, layout_change=layout_change
    )


def _external_names(sets: dict[str, Any]) -> set[str]:
    """The external files `--set` names a path for here (`external_files.NAME=PATH`, or the whole mapping)."""
    names = {k.split(".", 1)[1] for k in sets if k.startswith("external_files.")}
    whole = sets.get("external_files")
    return names | (set(whole) if isinstance(whole, dict) else set())


def _recheck(
    rd: RunDir,
    record: dict[str, Any],
    changes: dict[str, list[Any]],
    options: PrepareOptions,
    contract: dict[str, Any],
    hooks: Hooks,
    started: float,
) -> PrepareResult:
    """A second prepare on the same directory changes nothing; it re-runs the trainer's validation."""
    run_dir = rd.path
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
    cfg = stored_config(rd)
    recorded_code = record.get("code_dir")
    code_dir = options.code_dir or (run_dir / str(recorded_code) if recorded_code else None)
    # the bundle's extracted source lives inside the run dir (recorded relative): never run git there
    from_bundle = options.code_dir is None and code_dir is not None and code_dir.is_relative_to(run_dir)
    if code_dir is not None and not code_dir.is_dir():
        code_dir = None
    try:
        check = validate_resume(
            run_dir,
            cfg.replace(manifest=str(rd.manifest_path)),
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
