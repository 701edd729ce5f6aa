"""How `prepare` assembles a run directory from a verified bundle: the files copied (or linked) and re-hashed
against what was verified, the source manifest, the manifest's files checked, this machine's numerics."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchrelay.config.relay import RelayConfig
from torchrelay.errors import IntegrityError
from torchrelay.handoff.copying import copy_many
from torchrelay.handoff.verify import VerifyReport
from torchrelay.identity.numerics import compare_here, gather
from torchrelay.log import logger
from torchrelay.manifest import Manifest
from torchrelay.paths.layout import (
    CONFIG_FILE,
    CONTRACT_FILE,
    HISTORY_FILE,
    MANIFEST_REL,
    SOURCE_DIR,
    SOURCE_MANIFEST,
    TRAIN_DIR,
    VALIDATION_DIR,
)
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.util.durable import atomic_write_bytes
from torchrelay.util.hashing import ByteCallback

Say = Callable[[str], None]
# Files that carry on appending or get rewritten in the run dir are never hardlinked to the bundle.
_NEVER_LINK_PREFIXES = (f"{TRAIN_DIR}/", HISTORY_FILE, CONFIG_FILE, MANIFEST_REL)


@dataclass(slots=True)
class Hooks:
    """Where prepare reports: a line, bytes copied, manifest files checked (done, total)."""

    say: Say
    on_bytes: ByteCallback | None
    on_files: Callable[[int, int], None] | None


def numerics_here(
    history: list[dict[str, Any]], update: int, cfg: RelayConfig, proofs: list[str]
) -> dict[str, Any]:
    """This machine's numerics identity against the bundle's segments: a difference is warned (one line), never
    refused here: prepare may run on another machine than the training (a login node); the launch compares again
    and, with strict_numerics, refuses."""
    here = gather()
    found = compare_here(history, here, upto=update)
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


def copy_bundle(
    bundle: Bundle, into: RunDir, report: VerifyReport, *, link: bool, jobs: int | None, hooks: Hooks
) -> None:
    """The bundle's checkpoints, logs, validation records and run files into `into`, each file re-hashed against
    what was verified; `link`: hardlinked where the run directory never rewrites the file."""
    tmp = into.path
    digests = report.sums.digests()
    checkpoints = tuple(c + "/" for c in report.checkpoints)
    wanted = [
        c.path
        for c in report.sums.checks
        if c.path.startswith(checkpoints)
        or c.path.startswith((f"{TRAIN_DIR}/", f"{VALIDATION_DIR}/"))
        or c.path in (CONFIG_FILE, CONTRACT_FILE, HISTORY_FILE)
    ]
    linkable = [p for p in wanted if link and not p.startswith(_NEVER_LINK_PREFIXES)]
    rest = [p for p in wanted if p not in set(linkable)]
    results = copy_many(
        [(bundle.file(p), tmp / p) for p in linkable],
        link=True,
        jobs=jobs,
        on_bytes=hooks.on_bytes,
    )
    results += copy_many(
        [(bundle.file(p), tmp / p) for p in rest],
        link=False,
        jobs=jobs,
        on_bytes=hooks.on_bytes,
    )
    for r in results:
        rel = r.dst.relative_to(tmp).as_posix()
        if digests.get(rel, ("", -1))[0] != r.sha256:
            raise IntegrityError(
                f"{bundle.path / rel} changed between verification and copy (SHA-256 {r.sha256})",
                hint="something is writing into the bundle; re-download it and run prepare again",
            )


def copy_source_manifest(bundle: Bundle, into: RunDir, report: VerifyReport) -> None:
    """The bundle's source manifest, at the run dir's top (source/ holds only the tree): it names each file a
    later edit of the tree changed (identity.code_identity); checked against the verified digest."""
    rel = f"{SOURCE_DIR}/{SOURCE_MANIFEST}"
    want = report.sums.digests().get(rel)
    if want is None:
        return
    data = bundle.file(rel).read_bytes()
    if hashlib.sha256(data).hexdigest() != want[0]:
        raise IntegrityError(
            f"{bundle.path / rel} changed between verification and copy",
            hint="something is writing into the bundle; re-download it and run prepare again",
        )
    atomic_write_bytes(into.source_manifest_path, data)


def check_files(manifest: Manifest, hooks: Hooks, proofs: list[str]) -> list[str]:
    """--check-files: every file the rebased manifest names exists; the problem, or [] with its proof recorded."""
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
