"""SHA256SUMS in the format `sha256sum -c` reads, and a parallel check of a directory against it."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from torchrelay.errors import IntegrityError, UnsafeInput
from torchrelay.util.durable import atomic_write_text
from torchrelay.util.hashing import ByteCallback, default_jobs, sha256_file
from torchrelay.util.records import read_bounded
from torchrelay.util.safepath import check_relative, ensure_inside, walk_files

SUMS_NAME = "SHA256SUMS"
SUMS_LIMIT = 1 << 30  # ~12 million lines; more is no bundle torchrelay wrote

# "<64 hex><space><space or *><path>" — text and binary mode read the same on POSIX.
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


@dataclass(frozen=True, slots=True)
class SumEntry:
    """One line of SHA256SUMS: a relative path and the SHA-256 its bytes must have."""

    path: str
    sha256: str


@dataclass(frozen=True, slots=True)
class FileCheck:
    """The verdict on one listed file."""

    path: str
    expected: str
    actual: str | None
    size: int
    status: str  # "ok" | "mismatch" | "missing" | "unreadable"
    detail: str = ""


@dataclass(slots=True)
class SumsReport:
    """Every listed file's verdict, plus files present but not listed."""

    root: Path
    checks: list[FileCheck] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    total_bytes: int = 0
    seconds: float = 0.0

    @property
    def failed(self) -> list[FileCheck]:
        return [c for c in self.checks if c.status != "ok"]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.unexpected

    def digests(self) -> dict[str, tuple[str, int]]:
        """Relative path -> (sha256, size) of every file that was read, for callers that must not re-read."""
        return {c.path: (c.actual, c.size) for c in self.checks if c.actual is not None}

    def problems(self) -> list[str]:
        """One line per failure, naming the file, in the spirit of `sha256sum -c` output."""
        lines = []
        for c in self.failed:
            if c.status == "mismatch":
                lines.append(f"{c.path}: FAILED (sha256 {c.actual} != recorded {c.expected})")
            elif c.status == "missing":
                lines.append(f"{c.path}: MISSING (listed in {SUMS_NAME}, not in the bundle)")
            else:
                lines.append(f"{c.path}: UNREADABLE ({c.detail})")
        lines.extend(f"{p}: UNEXPECTED (in the bundle, not listed in {SUMS_NAME})" for p in self.unexpected)
        return lines


def parse_sums(text: str, *, source: str) -> list[SumEntry]:
    """Parse SHA256SUMS text; refuse malformed lines, duplicates and unsafe paths (naming the line)."""
    entries: list[SumEntry] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if line.startswith("\\"):
            raise UnsafeInput(
                f"{source}:{number}: escaped file name refused",
                hint="torchrelay never writes names that need escaping; the bundle is damaged or forged",
            )
        match = _LINE.match(line)
        if match is None:
            raise IntegrityError(
                f"{source}:{number}: not a `sha256sum` line: {line[:80]!r}",
                hint="re-download the bundle's SHA256SUMS",
            )
        digest, raw_path = match.group(1).lower(), match.group(2)
        rel = check_relative(raw_path, source=f"{source}:{number}").as_posix()
        if rel in seen:
            raise IntegrityError(f"{source}:{number}: {rel} is listed twice", hint="the bundle is damaged")
        seen.add(rel)
        entries.append(SumEntry(rel, digest))
    return entries


def read_sums(path: Path) -> list[SumEntry]:
    """Read and parse a SHA256SUMS file."""
    try:
        text = read_bounded(path, SUMS_LIMIT, what="checksums").decode("utf-8")
    except FileNotFoundError:
        raise IntegrityError(
            f"{path}: missing",
            hint="a bundle must carry SHA256SUMS; re-download it or re-run `torchrelay pack`",
        ) from None
    except UnicodeDecodeError as exc:
        raise IntegrityError(f"{path}: not UTF-8 text ({exc.reason})", hint="the bundle is damaged") from None
    return parse_sums(text, source=str(path))


def format_sums(entries: Iterable[SumEntry]) -> str:
    """Lines `<sha256>  <path>`, sorted by path, that `sha256sum -c` accepts."""
    lines = []
    for e in sorted(entries, key=lambda e: e.path):
        rel = check_relative(e.path, source="SHA256SUMS entry").as_posix()
        lines.append(f"{e.sha256}  {rel}\n")
    return "".join(lines)


def write_sums(path: Path, entries: Iterable[SumEntry]) -> None:
    """Write SHA256SUMS atomically (temporary file, fsync, rename, fsync of its folder)."""
    atomic_write_text(path, format_sums(entries))


def check_sums(
    root: Path,
    entries: list[SumEntry],
    *,
    jobs: int | None = None,
    on_bytes: ByteCallback | None = None,
    not_listed_ok: Iterable[str] = (SUMS_NAME,),
) -> SumsReport:
    """Hash every listed file under `root` in parallel and compare; also list files present but not listed."""
    root = Path(root)
    started = time.perf_counter()
    # Refuse unsafe paths before reading a single byte.
    for e in entries:
        ensure_inside(root, root / e.path, source=f"{root / SUMS_NAME}", shown=e.path)
    listed = {e.path for e in entries}
    allowed = set(not_listed_ok)
    unexpected = [p for p in walk_files(root) if p not in listed and p not in allowed]

    def size_of(e: SumEntry) -> int:
        try:
            return (root / e.path).stat().st_size
        except OSError:
            return 0

    # Largest first, so one big file does not start last and leave the other threads idle.
    order = sorted(entries, key=size_of, reverse=True)

    def check(e: SumEntry) -> FileCheck:
        path = root / e.path
        if not path.exists():
            return FileCheck(e.path, e.sha256, None, 0, "missing")
        try:
            actual, size = sha256_file(path, on_bytes)
        except OSError as exc:
            return FileCheck(e.path, e.sha256, None, 0, "unreadable", exc.strerror or str(exc))
        status = "ok" if actual == e.sha256 else "mismatch"
        return FileCheck(e.path, e.sha256, actual, size, status)

    workers = max(1, jobs or default_jobs())
    if workers == 1 or len(order) <= 1:
        checks = [check(e) for e in order]
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
            checks = list(pool.map(check, order))
    checks.sort(key=lambda c: c.path)
    report = SumsReport(root=root, checks=checks, unexpected=unexpected)
    report.total_bytes = sum(c.size for c in checks)
    report.seconds = time.perf_counter() - started
    return report


def listed_size(root: Path, entries: list[SumEntry]) -> int:
    """Bytes a check will read (for a progress bar's total); missing files count zero."""
    total = 0
    for e in entries:
        with contextlib.suppress(OSError):
            total += (Path(root) / e.path).stat().st_size
    return total
