"""Verify a bundle: every file against SHA256SUMS, and every checkpoint's inventory against its files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torchrelay.checkpoint.inventory import (
    INVENTORY,
    MISSING,
    SHA256,
    SIZE,
    UNEXPECTED,
    check_files,
    read_inventory,
)
from torchrelay.errors import IntegrityError, UnsafeInput
from torchrelay.handoff.signing import SIG_LIMIT, SIG_NAME, bundle_digest, parse_digest, verify_signature
from torchrelay.paths.layout import parse_checkpoint_name
from torchrelay.paths.rundir import Bundle
from torchrelay.util.hashing import ByteCallback
from torchrelay.util.records import read_bounded
from torchrelay.util.sums import SUMS_LIMIT, SUMS_NAME, SumsReport, check_sums, listed_size, parse_sums


@dataclass(slots=True)
class VerifyReport:
    """The outcome of `verify`: the SHA256SUMS check, one line per inventory problem, and the bundle's identity."""

    sums: SumsReport
    inventory_problems: list[str] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    digest: str = ""  # SHA-256 of SHA256SUMS: names the whole bundle
    signer: str | None = None  # the allowed signer whose signature checked, when one was asked for

    @property
    def ok(self) -> bool:
        return self.sums.ok and not self.inventory_problems

    def problems(self) -> list[str]:
        return self.sums.problems() + self.inventory_problems


def bundle_bytes(bundle: Path) -> int:
    """Bytes `verify_bundle` will hash (for a progress bar); refuses an unreadable SHA256SUMS early."""
    return listed_size(
        bundle, parse_sums(_sums_text(Path(bundle) / SUMS_NAME), source=str(Path(bundle) / SUMS_NAME))
    )


def verify_bundle(
    bundle: Path,
    *,
    jobs: int | None = None,
    on_bytes: ByteCallback | None = None,
    expect: str | None = None,
    allowed_signers: Path | None = None,
) -> VerifyReport:
    """Check every file of `bundle` against its SHA256SUMS and every checkpoint inventory; raise on unsafe paths.

    `expect` (a bundle digest) and `allowed_signers` (an SSH allowed-signers file) tie SHA256SUMS to the bundle
    that was packed; they are checked on the very bytes the files are then checked against, before any of them.
    """
    bundle = Path(bundle)
    if not bundle.is_dir():
        raise IntegrityError(
            f"{bundle}: not a directory", hint="pass the bundle directory that holds SHA256SUMS"
        )
    sums_path = Bundle(bundle).sums_path
    raw = _sums_bytes(sums_path)
    digest = bundle_digest(raw)
    if expect is not None and digest != parse_digest(expect):
        raise IntegrityError(
            f"{sums_path}: the bundle digest is sha256:{digest}, not the expected sha256:{parse_digest(expect)}",
            hint="this is not the bundle that was packed (or SHA256SUMS was changed); get it again from its packer",
        )
    signer = None
    if allowed_signers is not None:
        try:
            signature = read_bounded(Bundle(bundle).sig_path, SIG_LIMIT, what="the bundle's signature")
        except FileNotFoundError:
            raise IntegrityError(
                f"{Bundle(bundle).sig_path}: missing; the bundle is not signed",
                hint="ask its packer for a signed bundle (`torchrelay pack --sign KEY`) or its --expect digest",
            ) from None
        signer = verify_signature(raw, signature, allowed_signers, source=str(sums_path))
    entries = parse_sums(_decode(raw, sums_path), source=str(sums_path))
    sums = check_sums(bundle, entries, jobs=jobs, on_bytes=on_bytes, not_listed_ok=(SUMS_NAME, SIG_NAME))
    report = VerifyReport(sums=sums, digest=digest, signer=signer)
    known = sums.digests()
    # every file was listed and read just now (an unlisted one is a problem of its own): the inventories among them
    for inventory in [bundle / rel for rel in sorted(known) if rel.rsplit("/", 1)[-1] == INVENTORY]:
        rel_dir = inventory.parent.relative_to(bundle).as_posix()
        if parse_checkpoint_name(rel_dir) is None:
            # prepare copies checkpoint folders into the run dir; only the top-level checkpoint-N/ are ones
            report.inventory_problems.append(f"{rel_dir}/{INVENTORY}: an inventory outside a checkpoint-N/")
            continue
        report.checkpoints.append(rel_dir)
        report.inventory_problems.extend(check_inventory(bundle, inventory.parent, known))
    return report


def _sums_bytes(path: Path) -> bytes:
    try:
        return read_bounded(path, SUMS_LIMIT, what="the bundle's checksums")
    except FileNotFoundError:
        raise IntegrityError(
            f"{path}: missing",
            hint="a bundle must carry SHA256SUMS (a pack that was interrupted never writes it); "
            "re-download it or re-run `torchrelay pack`",
        ) from None


def _decode(raw: bytes, path: Path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{path}: not UTF-8 text ({exc.reason})", hint="the bundle is damaged") from None


def _sums_text(path: Path) -> str:
    return _decode(_sums_bytes(path), path)


def check_inventory(root: Path, ckpt_dir: Path, known: dict[str, tuple[str, int]] | None = None) -> list[str]:
    """Problems between a checkpoint's inventory and its files, by the rule the trainer's resume applies
    (checkpoint/inventory.check_files); `known` holds digests already computed, keyed relative to `root`."""
    prefix = ckpt_dir.relative_to(root).as_posix()
    try:
        doc = read_inventory(ckpt_dir)
    except UnsafeInput:
        raise
    except IntegrityError as exc:
        return [exc.message]
    inner = {
        rel.removeprefix(prefix + "/"): v for rel, v in (known or {}).items() if rel.startswith(prefix + "/")
    }
    listed = f"{prefix}/{INVENTORY}"
    shown = {
        MISSING: f"MISSING (listed in {listed})",
        SHA256: f"sha256 differs from {listed}",
        UNEXPECTED: f"UNEXPECTED (not in {listed})",
    }
    return [
        f"{prefix}/{p.rel}: "
        + (f"size {p.size} != {p.listed_size} in {listed}" if p.kind == SIZE else shown[p.kind])
        for p in check_files(ckpt_dir, doc, known=inner)
    ]
