"""`pack`: write a verifiable bundle of a stopped run, and mark the source checkpoint as handed off."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.checkpoint.handed_off import (
    HANDED,
    HANDED_OFF,
    PACKING,
    RECLAIM_ENV,
    clean_temporaries,
    guarding_record,
    read_marker,
    write_marker,
)
from torchrelay.checkpoint.handed_off import TMP_PREFIX as MARKER_TMP_PREFIX
from torchrelay.checkpoint.inventory import INVENTORY, read_inventory
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.config.relay import stored_config
from torchrelay.errors import CheckpointError, ConfigError, ForkRefused, IntegrityError, PathError
from torchrelay.handoff.bundle_readme import render_readme
from torchrelay.handoff.copying import CopyResult, copy_many, through_link
from torchrelay.handoff.signing import bundle_digest, check_key, sign
from torchrelay.handoff.source import write_source
from torchrelay.identity import find_code_dir
from torchrelay.manifest import Manifest
from torchrelay.paths.destinations import refuse_nested
from torchrelay.paths.layout import CONFIG_FILE, CONTRACT_FILE, HISTORY_FILE, LEDGER_PROOF, MANIFEST_REL
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.records.contract import load_contract
from torchrelay.records.history import new_id, read_history
from torchrelay.records.train import copy_log, rank_logs, trim_copy
from torchrelay.util.durable import fsync_dir, temp_prefix
from torchrelay.util.hashing import ByteCallback, sha256_file
from torchrelay.util.jsonl import iter_records
from torchrelay.util.kill_points import kill_point
from torchrelay.util.records import read_json_or_none
from torchrelay.util.safepath import walk_files
from torchrelay.util.sums import SumEntry, format_sums, write_sums

BUNDLE_FORMAT = 1
# Copied verbatim from the run directory when present.
RUN_FILES = (CONFIG_FILE, CONTRACT_FILE, HISTORY_FILE, MANIFEST_REL)


@dataclass(kw_only=True, slots=True)
class PackOptions:
    """How to pack: which checkpoint, link or copy, where the run's source lives."""

    # `--help` reads `doc` and `metavar` (commands/pack.py declares the options from these fields)
    checkpoint: int | None = None  # None: the newest complete checkpoint
    link: bool = field(default=False, metadata={"doc": "hardlink checkpoint files instead of copying"})
    code_dir: Path | None = field(
        default=None,
        metadata={
            "doc": "git checkout the run was trained from (default: where the run's recorded script lies)"
        },
    )
    allow_dirty: bool = field(default=False, metadata={"doc": "pack a run trained from uncommitted code"})
    jobs: int | None = field(default=None, metadata={"doc": "copy/hash threads (default: one per core)"})
    sign: Path | None = field(
        default=None,
        metadata={
            "metavar": "KEYFILE",
            "doc": "sign SHA256SUMS with this SSH key (ssh-keygen -Y sign) into SHA256SUMS.sig",
        },
    )

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.checkpoint < 0:
            raise ConfigError(f"--checkpoint must be an update number >= 0, got {self.checkpoint}")


@dataclass(slots=True)
class PackResult:
    """What was packed, where, and how long it took."""

    bundle: Path
    lineage: str
    update: int
    files: int = 0
    bytes: int = 0
    linked: int = 0
    seconds: float = 0.0
    digest: str = ""  # the bundle digest: SHA-256 of SHA256SUMS
    signed: bool = False
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what recovering an interrupted pack did


def checkpoint_to_pack(run: RunDir, which: int | None, *, guard: bool = True) -> Path:
    """The complete checkpoint to pack: the newest, or checkpoint-N; refuses incomplete or (guard) handed-off ones."""
    run_dir = run.path
    infos = list_checkpoints(run_dir)
    complete = [c for c in infos if c.complete]
    if which is None:
        if not complete:
            raise CheckpointError(
                f"{run_dir} has no complete checkpoint to pack", hint="stop the run cleanly first"
            )
        chosen = complete[-1]
    else:
        matches = [c for c in infos if c.update == which]
        if not matches:
            have = ", ".join(str(c.update) for c in complete) or "none"
            raise PathError(
                f"{run.checkpoint(which)} does not exist (complete: {have})",
                hint="pass --checkpoint with the update of a complete checkpoint, or latest",
            )
        chosen = matches[0]
        if not chosen.complete:
            raise CheckpointError(f"{chosen.path} is incomplete ({chosen.reason}); it cannot be packed")
    record = guarding_record(chosen.path) if guard else None
    if record is not None:
        unfinished = record.get("state") == PACKING
        raise ForkRefused(
            f"{chosen.path} was already handed off (bundle lineage {record.get('lineage', '?')}, "
            f"to {record.get('bundle', '?')}{'; that pack was interrupted' if unfinished else ''}); "
            "packing it again would let the run continue in two places",
            hint=f"continue from that bundle, or set {RECLAIM_ENV}=1 if that bundle was discarded"
            + (" (it has no SHA256SUMS, so it was never usable)" if unfinished else ""),
        )
    return chosen.path


def pack(
    run_dir: str | os.PathLike[str] | RunDir,
    bundle: Path,
    options: PackOptions,
    on_bytes: ByteCallback | None = None,
) -> PackResult:
    """Write `bundle` from `run_dir`'s checkpoint, then mark that checkpoint HANDED_OFF in the source run.

    Packing holds the run's writer lock: a run still training is refused (it would go on past the handed-off
    checkpoint, a fork), and no training can start until the checkpoint is marked.
    """
    rd = RunDir.of(run_dir)  # the `pack` verb's, or a program's path
    lock = RunLock(rd.path, "train").acquire()
    try:
        return _pack(rd, bundle, options, on_bytes)
    finally:
        lock.release()


def _pack(rd: RunDir, bundle: Path, options: PackOptions, on_bytes: ByteCallback | None = None) -> PackResult:
    """The steps, ordered so that a kill at any moment leaves no usable bundle or a recorded hand-off:

    1. every file but SHA256SUMS into a temporary sibling; 2. rename it into place (not usable yet: no SHA256SUMS);
    3. HANDED_OFF.json "packing"; 4. SHA256SUMS (the bundle becomes usable); 5. HANDED_OFF.json "handed-off".
    A later pack rolls back what an interrupted one left (checkpoint/handed_off.py says how).
    """
    started = time.perf_counter()
    bundle = through_link(Path(bundle))
    refuse_nested(rd.path, "run directory", bundle, "bundle")
    if options.sign is not None:
        check_key(options.sign)
    contract = load_contract(rd)
    cfg = stored_config(rd)
    notes = recover(rd, bundle)
    ckpt = checkpoint_to_pack(rd, options.checkpoint)
    inventory = read_inventory(ckpt)
    update = int(inventory["update"])
    if bundle.exists() and (not bundle.is_dir() or any(bundle.iterdir())):
        raise ConfigError(f"{bundle} already exists and is not empty", hint="choose a new bundle directory")

    lineage = new_id()
    tmp = bundle.parent / f"{_tmp_prefix(bundle)}{lineage}"
    tmp.mkdir(parents=True)
    try:
        result, entries = _write_bundle(rd, cfg, contract, ckpt, inventory, tmp, lineage, options, on_bytes)
        sums = format_sums(entries).encode()
        result.digest = bundle_digest(sums)
        if options.sign is not None:
            Bundle(tmp).sig_path.write_bytes(sign(sums, options.sign))
            result.signed = True
        kill_point("pack:written")
        os.rename(tmp, bundle)  # replaces an empty directory in one step
        fsync_dir(bundle.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kill_point("pack:renamed")
    result.bundle, result.notes = bundle, notes
    # The fork guard, before the bundle can be used: the source refuses this checkpoint unless reclaimed.
    marker = {
        "format": 1,
        "state": PACKING,
        "lineage": lineage,
        "bundle": str(bundle.resolve()),
        "digest": result.digest,
        "packed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "by": _who(),
        "update": update,
    }
    write_marker(ckpt, marker, step="pack:marking")
    kill_point("pack:marked")
    write_sums(Bundle(bundle).sums_path, entries)
    fsync_dir(bundle)
    kill_point("pack:summed")
    write_marker(ckpt, {**marker, "state": HANDED}, step="pack:finishing")
    result.seconds = time.perf_counter() - started
    return result


def _tmp_prefix(bundle: Path) -> str:
    return f".{bundle.name}.pack-tmp-"


def recover(run: RunDir, bundle: Path) -> list[str]:
    """Clean up after a pack killed part-way (with the run's lock held); returns what was done.

    Only what is provably ours and unusable goes: temporaries, and a bundle that never got its SHA256SUMS and
    is named by a "packing" record (or by no record at all) of this run. A "packing" record whose bundle has its
    SHA256SUMS was killed just before its last write: it is finished, not rolled back.
    """
    run_dir = run.path
    notes = [f"removed {name}, left by an interrupted pack" for name in clean_temporaries(run_dir)]
    bundle = Path(bundle)
    if bundle.parent.is_dir():
        for child in bundle.parent.iterdir():
            if child.name.startswith(_tmp_prefix(bundle)) and child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
                notes.append(f"removed {child}, left by an interrupted pack")
    recorded: set[str] = set()
    for ck in list_checkpoints(run_dir):
        record = read_marker(ck.path)
        if record is None:
            continue
        recorded.add(str(record.get("lineage")))
        if record.get("state") != PACKING or not isinstance(record.get("bundle"), str):
            continue
        where = Bundle(record["bundle"])
        if where.info_or_empty().get("lineage") != record.get("lineage"):
            continue  # moved or removed by hand: nothing proves it unusable, so the record stays
        if where.sums_path.exists():
            write_marker(ck.path, {**record, "state": HANDED}, step="pack:finishing")
            notes.append(
                f"{ck.path.name}: the pack into {where.path} had finished but for its record; recorded"
            )
            continue
        # Record first, then the bundle: a kill between leaves an unusable bundle no record names, removed below.
        (ck.path / HANDED_OFF).unlink()
        fsync_dir(ck.path)
        recorded.discard(str(record.get("lineage")))
        shutil.rmtree(where.path, ignore_errors=True)
        notes.append(
            f"{ck.path.name}: rolled back an interrupted pack into {where.path} (it never got SHA256SUMS)"
        )
    info = Bundle(bundle).info_or_empty() if bundle.is_dir() else {}
    ours = info.get("source_run") == str(run_dir.resolve()) and isinstance(info.get("lineage"), str)
    if ours and info["lineage"] not in recorded and not Bundle(bundle).sums_path.exists():
        shutil.rmtree(bundle, ignore_errors=True)
        notes.append(f"removed {bundle}, an interrupted pack of this run (it never got SHA256SUMS)")
    return notes


def _write_bundle(
    rd: RunDir,
    cfg: Any,
    contract: dict[str, Any],
    ckpt: Path,
    inventory: dict[str, Any],
    out: Path,
    lineage: str,
    options: PackOptions,
    on_bytes: ByteCallback | None,
) -> tuple[PackResult, list[SumEntry]]:
    """Every file of the bundle but SHA256SUMS, whose entries are returned (written last, by the caller)."""
    update = int(inventory["update"])
    result = PackResult(bundle=out, lineage=lineage, update=update)
    digests: dict[str, str] = {}
    written = Bundle(out)

    # 1. The checkpoint, hashed while copied and held against its own inventory.
    expected = {f["path"]: f for f in inventory["files"]}
    skipped = (MARKER_TMP_PREFIX, temp_prefix(LEDGER_PROOF))  # what killed writers left: no part of a bundle
    names = [rel for rel in walk_files(ckpt) if rel != HANDED_OFF and not rel.startswith(skipped)]
    pairs = [(ckpt / rel, out / ckpt.name / rel) for rel in names]
    # 2. The run's own files, verbatim (the checkpoint's files may be linked; these are always copied).
    run_pairs = [(rd.path / rel, out / rel) for rel in RUN_FILES if (rd.path / rel).is_file()]
    # Validation records travel too: what was validated where, so that a continuation does not repeat it.
    validation = rd.validation_dir
    if validation.is_dir():
        run_pairs += [
            (validation / rel, written.run.validation_dir / rel)
            for rel in walk_files(validation)
            if (validation / rel).is_file()
            and not (validation / rel).is_symlink()
            and rel.split("/")[1:2] != ["weights"]  # an export left by a killed validation: not a record
        ]
    copied: list[CopyResult] = copy_many(
        pairs, link=options.link, jobs=options.jobs, on_bytes=on_bytes, kernel_copy=True
    )
    copied += copy_many(run_pairs, link=False, jobs=options.jobs, on_bytes=on_bytes)
    for c in copied:
        rel = c.dst.relative_to(out).as_posix()
        digests[rel] = c.sha256
        result.bytes += c.size
        result.linked += int(c.linked)
        inner = c.dst.relative_to(out / ckpt.name).as_posix() if rel.startswith(ckpt.name + "/") else None
        if inner is not None and inner in expected:
            want = expected[inner]
            if c.sha256 != want["sha256"] or c.size != want["size"]:
                raise IntegrityError(
                    f"{c.src} does not match {ckpt / INVENTORY} (sha256 or size differs)",
                    hint="the source checkpoint is damaged; pack an older one with --checkpoint N",
                )
    missing = sorted(set(expected) - set(names))
    if missing:
        raise IntegrityError(
            f"{ckpt}: {missing[0]} is listed in COMPLETE.json but missing", hint="pack an older one"
        )

    # 3. Per-rank logs up to the checkpoint's update (lines past it belong to no bundle).
    train = written.run.train_dir
    train.mkdir(exist_ok=True)
    for kind in ("metrics", "exposures"):
        for _rank, path in rank_logs(rd.train_dir, kind).items():
            trim_copy(path, train / path.name, update)
    for path in sorted(
        rd.train_dir.glob("ooms-rank*.jsonl")
    ):  # every OOM the run met: counted, never trimmed
        copy_log(path, train / path.name)

    # 4. Manifest identity, the exact source, progress at the stop, lineage, the README.
    manifest = Manifest.load(
        rd.manifest_path, cfg.data_root, root=rd.path
    )  # every line: the bytes' fingerprint
    if manifest.fingerprint() != contract["fields"].get("data.fingerprint"):
        raise IntegrityError(
            f"{rd.manifest_path}: lists other samples than the manifest the run's contract binds "
            f"(data.fingerprint {contract['fields'].get('data.fingerprint')}, the file's {manifest.fingerprint()})",
            hint="restore the run's copy of its manifest; a bundle of other data would be refused by prepare",
        )
    manifest_info = {
        "path": MANIFEST_REL,
        "sha256": manifest.sha256(),
        "fingerprint": manifest.fingerprint(),
        "data_root": cfg.data_root,
        "samples": len(manifest),
    }
    _write_json(written.manifest_info_path, manifest_info)
    fields = contract["fields"]
    code = {k.removeprefix("code."): v for k, v in fields.items() if k.startswith("code.")}
    code_dir = options.code_dir or recorded_code_dir(rd) or _checkout_here()
    source = write_source(
        code,
        code_dir,
        written.source_dir,
        allow_dirty=options.allow_dirty,
        run_dir=rd.path,
        strict_code=cfg.strict_code,
    )
    result.warnings.extend(source.warnings)
    progress = training_progress(written.run, update, cfg.total_updates)
    _write_json(written.progress_path, progress)
    source_lineage = read_json_or_none(rd.lineage_path, what=rd.lineage_path.name)
    source_lineage = source_lineage if isinstance(source_lineage, dict) else {}
    info = {
        "format": BUNDLE_FORMAT,
        "lineage": lineage,
        "parent_lineage": source_lineage.get("lineage"),
        "checkpoint": ckpt.name,
        "update": update,
        "contract_sha256": contract["sha256"],
        "world_size": fields.get("world_size"),
        "runtime_keys": [k for k in cfg.runtime_keys() if k != "manifest"],  # prepare owns the manifest
        "source_run": str(rd.path.resolve()),
        "packed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "packed_by": _who(),
        "tool_version": __version__,
        "source": source.to_dict(),
        "warnings": result.warnings,
    }
    _write_json(written.info_path, info)
    history = read_history(rd.path)
    readme = render_readme(info, contract, cfg.to_dict(), manifest_info, progress, history)
    written.readme_path.write_text(readme, encoding="utf-8")

    # 5. SHA256SUMS's entries over everything; files written here (small) are hashed now, the big ones already were.
    entries = []
    for rel in walk_files(out):
        digest = digests.get(rel)
        if digest is None:
            digest, size = sha256_file(out / rel)
            result.bytes += size
        entries.append(SumEntry(rel, digest))
    result.files = len(entries)
    # No per-file fsync: a bundle is proven by SHA256SUMS on arrival, not by durability on the way out.
    return result, entries


def recorded_code_dir(run: RunDir) -> Path | None:
    """Where the run's code lies, from what its segments recorded: the code directory (git top level, or the
    folder) of the newest recorded script that still exists."""
    run_dir = run.path
    for seg in reversed(read_history(run_dir)):
        code = seg.get("code")
        script = code.get("script") if isinstance(code, dict) else None
        if isinstance(script, str) and Path(script).is_file():
            return find_code_dir(script)
    return None


def _checkout_here() -> Path | None:
    cwd = Path.cwd()  # pack run from the training repository's checkout
    return cwd if (cwd / ".git").exists() else None


def training_progress(bundle_like: RunDir, update: int, total_updates: int) -> dict[str, Any]:
    """Updates done/left, epoch, exposures, LR and mean losses at the stop, from the bundle's own copies."""
    summary: dict[str, Any] = {}
    try:
        from torchrelay.records.summary import summarize  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # the core's status summary is optional for packing; the basics follow below
        pass
    else:
        try:
            summary = dict(summarize(bundle_like))
        except Exception as exc:  # noqa: BLE001 - progress is informative; a pack must not fail on it
            summary["summarize_error"] = f"{type(exc).__name__}: {exc}"
    summary.setdefault("update", update)
    summary.setdefault("updates_done", update)
    summary.setdefault("updates_left", max(total_updates - update, 0))
    summary.setdefault("total_updates", total_updates)
    losses: dict[int, list[float]] = {}
    objectives: dict[str, dict[int, list[float]]] = {}
    lr = None
    for _rank, path in rank_logs(bundle_like.train_dir, "metrics").items():
        for rec in iter_records(path):
            u = int(rec.get("update", 0))
            if isinstance(rec.get("loss"), (int, float)):
                losses.setdefault(u, []).append(float(rec["loss"]))
            for key, value in rec.items():  # `loss_<name>`: one objective's loss (loss_g3, loss_a1)
                if key.startswith("loss_") and isinstance(value, (int, float)):
                    objectives.setdefault(key, {}).setdefault(u, []).append(float(value))
            if u == update and isinstance(rec.get("lr"), (int, float)):
                lr = float(rec["lr"])
    last = sorted(losses)[-100:]
    if last:
        # per update, the mean over ranks; then the mean over the last (up to) 100 updates
        summary.setdefault("loss_mean_100", sum(sum(losses[u]) / len(losses[u]) for u in last) / len(last))
    if objectives:
        means = {}
        for key, per_update in sorted(objectives.items()):
            window = sorted(per_update)[-100:]
            means[key] = sum(sum(per_update[u]) / len(per_update[u]) for u in window) / len(window)
        summary["objective_loss_mean_100"] = means  # mean over ranks, then over the last 100 updates
    if lr is not None:
        summary.setdefault("lr", lr)
    try:
        from torchrelay.ledger.exposure import prove

        summary.setdefault("ledger", prove(bundle_like).to_dict())
    except Exception as exc:  # noqa: BLE001 - as above
        summary.setdefault("ledger_error", f"{type(exc).__name__}: {exc}")
    return summary


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"
