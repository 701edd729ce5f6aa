"""SHA256SUMS and verify: the format coreutils reads, every failure named, agreement with `sha256sum -c`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from handoff_fixtures import Packed, packed_fixture  # noqa: F401 - the `packed` fixture
from torchrelay.cli import main
from torchrelay.errors import IntegrityError, RelayError, UnsafeInput
from torchrelay.handoff.copying import copy_many
from torchrelay.handoff.hashing import sha256_file
from torchrelay.handoff.prepare import PrepareOptions, prepare
from torchrelay.handoff.safepath import check_relative, walk_files
from torchrelay.handoff.sums import SUMS_NAME, SumEntry, check_sums, parse_sums, read_sums, write_sums
from torchrelay.handoff.verify import verify_bundle


def _tree(root: Path) -> Path:
    (root / "sub dir").mkdir(parents=True)
    (root / "a.bin").write_bytes(bytes(range(256)) * 9000)  # > 2 MiB: several blocks
    (root / "sub dir" / "b c.txt").write_text("hello\n")
    (root / "empty").write_bytes(b"")
    entries = [SumEntry(rel, sha256_file(root / rel)[0]) for rel in walk_files(root)]
    write_sums(root / SUMS_NAME, entries)
    return root


def _coreutils_failures(root: Path) -> tuple[int, set[str]]:
    out = subprocess.run(["sha256sum", "-c", "--quiet", SUMS_NAME], cwd=root, capture_output=True, text=True)
    failed = {
        line.rsplit(":", 1)[0]
        for line in out.stdout.splitlines()
        if line.endswith(("FAILED", "FAILED open or read"))
    }
    return out.returncode, failed


def test_sums_are_what_sha256sum_reads(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    assert _coreutils_failures(root) == (0, set())
    report = check_sums(root, read_sums(root / SUMS_NAME), jobs=2)
    assert report.ok and report.total_bytes == 256 * 9000 + 6
    # and we read what coreutils writes (binary-mode '*' marker included)
    made = subprocess.run(
        ["sha256sum", "-b", "a.bin", "sub dir/b c.txt"], cwd=root, capture_output=True, text=True
    )
    assert [e.path for e in parse_sums(made.stdout, source="x")] == ["a.bin", "sub dir/b c.txt"]


def test_every_failure_is_named(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    (root / "sub dir" / "b c.txt").write_text("hellO\n")
    (root / "empty").unlink()
    (root / "stray.txt").write_text("?")
    report = check_sums(root, read_sums(root / SUMS_NAME))
    assert not report.ok
    text = "\n".join(report.problems())
    assert "sub dir/b c.txt: FAILED" in text and "empty: MISSING" in text and "stray.txt: UNEXPECTED" in text
    code, failed = _coreutils_failures(root)
    assert code != 0 and failed == {c.path for c in report.failed}


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("nothex  a.bin", IntegrityError),
        (f"{'a' * 64}  /abs", UnsafeInput),
        (f"{'a' * 64}  x/../../y", UnsafeInput),
        (f"\\{'a' * 64}  we\\\\ird", UnsafeInput),
    ],
)
def test_malformed_or_unsafe_lines_are_refused(line: str, error: type[Exception]) -> None:
    with pytest.raises(error, match="SHA256SUMS:1"):
        parse_sums(line + "\n", source="SHA256SUMS")


def test_duplicates_and_safe_relative_paths() -> None:
    with pytest.raises(IntegrityError, match="listed twice"):
        parse_sums(f"{'a' * 64}  x\n{'b' * 64}  ./x\n", source="S")
    assert check_relative("./a/./b", source="s").as_posix() == "a/b"


def test_copy_while_hashing_and_links(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    pairs = [(root / rel, tmp_path / "c" / rel) for rel in walk_files(root)]
    results = copy_many(pairs, jobs=2)
    for r in results:
        assert r.sha256 == sha256_file(r.src)[0] and r.dst.read_bytes() == r.src.read_bytes() and not r.linked
    kernel = copy_many(
        [(root / rel, tmp_path / "k" / rel) for rel in walk_files(root)], jobs=2, kernel_copy=True
    )
    for r in kernel:
        assert r.sha256 == sha256_file(r.src)[0] and r.dst.read_bytes() == r.src.read_bytes()
    linked = copy_many([(root / "a.bin", tmp_path / "l" / "a.bin")], link=True)
    assert linked[0].linked and (root / "a.bin").stat().st_nlink == 2


def test_byte_flipped_in_each_file_fails_verify_and_prepare(packed: Packed, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    files = walk_files(bundle)
    assert len(files) > 15
    for rel in files:
        path = bundle / rel
        original = path.read_bytes()
        flipped = bytearray(original)
        at = len(flipped) // 2
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        try:
            code, failed = _coreutils_failures(bundle)
            assert code != 0, rel
            try:
                report = verify_bundle(bundle)
            except RelayError as exc:  # a damaged SHA256SUMS is refused as a whole
                assert rel == SUMS_NAME, f"{rel}: {exc}"
            else:
                assert not report.ok, rel
                named = {c.path for c in report.sums.failed}
                assert rel in named or rel == SUMS_NAME, (rel, report.problems())
                assert named == failed, (rel, named, failed)
            assert main(["verify", str(bundle), "--quiet"]) != 0
            run_dir = tmp_path / "run"
            with pytest.raises(RelayError):
                prepare(bundle, PrepareOptions(run_dir=run_dir), say=lambda s: None)
            assert not run_dir.exists(), rel
        finally:
            path.write_bytes(original)
    assert verify_bundle(bundle).ok
