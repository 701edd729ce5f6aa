"""Bundles in an object store, against a real S3-compatible server (SeaweedFS on 127.0.0.1, tests/s3_server.py):
pack -> verify -> prepare through the store, the commit object written last, verified ranged reads, the AWS
credential chain kept out of every file and message, and the store's faults (injected by a proxy in front of the
real server, tests/s3_proxy.py) each refused in one line naming the URL."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import boto3
import pytest

from s3_proxy import FaultProxy, Faults
from s3_server import S3Server
from torchrelay.cli import main
from torchrelay.errors import ConfigError, UnsafeInput
from torchrelay.handoff.store_pack import upload_files
from torchrelay.handoff.store_read import PARTS_REL, read_store_bundle
from torchrelay.storage.base import open_store
from torchrelay.storage.url import parse_url
from torchrelay.util.sums import SUMS_NAME, SumEntry, format_sums


def _run(tmp: Path) -> Path:
    """A stopped run with one complete checkpoint, written in-process as the library writes it (no launch)."""
    from scale_run import make_run

    return make_run(
        tmp / "src", samples=2048, updates=4, ranks=1, micro=4, checkpoints=[4], segment_updates=4
    )


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------------- no server needed
def test_a_url_is_never_taken_for_a_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pack RUN gs://b/x` wrote a local folder ./gs:/b/x and said PACK_OK; every verb refuses a URL it does not
    take, in one line, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    cases = [
        ("pack", str(tmp_path / "run"), "gs://bucket/x"),  # an unsupported scheme where a store URL may stand
        ("pack", "s3://bucket/run", str(tmp_path / "bundle")),  # a store URL where a run directory must stand
        ("verify", "https://example.org/bundle"),
        ("prepare", str(tmp_path / "bundle"), "--run-dir", "s3://bucket/run"),
        ("prepare", str(tmp_path / "bundle"), "--run-dir=s3://bucket/run"),
        ("status", "s3://bucket/run"),
        ("ledger", "file:///tmp/run"),
    ]
    for argv in cases:
        code, out, err = _cli(capsys, *argv)
        assert code == 2, (argv, out, err)
        assert "PACK_OK" not in out
        first = err.splitlines()[0]
        assert "URL" in first and "://" in first, (argv, err)
        assert len([ln for ln in err.splitlines() if not ln.startswith("  hint:")]) == 1, err
    assert sorted(os.listdir(tmp_path)) == [], "a URL was taken for a path"


def test_a_launch_command_given_to_audit_keeps_its_urls() -> None:
    """audit's LAUNCH is another program's command line: its URLs are that program's business."""
    from torchrelay.cli import _refuse_urls, build_parser

    for argv in (
        ["audit", "RUN", "--", "torchrun", "train.py", "--data", "s3://bucket/shards"],
        ["audit", "RUN", "torchrun", "train.py", "--data=s3://bucket/shards"],
    ):
        args = build_parser("audit").parse_args(argv)
        _refuse_urls("audit", argv, args)  # nothing refused


def test_store_urls_are_parsed_strictly() -> None:
    url = parse_url("s3://my-bucket/runs/a/")
    assert (url.bucket, url.prefix, str(url), url.key("SHA256SUMS")) == (
        "my-bucket", "runs/a", "s3://my-bucket/runs/a", "runs/a/SHA256SUMS",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="not a bucket name"):
        parse_url("s3://B/x")
    with pytest.raises(UnsafeInput, match="'..'"):
        parse_url("s3://bucket/a/../b")
    with pytest.raises(ConfigError, match="not a store URL"):
        parse_url("gs://bucket/x")


# ------------------------------------------------------------------------------------------- against the server
def _objects(bucket: str, prefix: str = "") -> dict[str, bytes]:
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.s3
def test_pack_verify_prepare_through_the_store(
    tmp_path: Path, s3_bucket: str, s3_server: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundle goes into the store (SHA256SUMS last), is verified there without a local copy, and prepared
    from there into a run directory whose checkpoint is the source's, byte for byte; the secret of the AWS chain
    is in no file, object or message on the way."""
    run = _run(tmp_path)
    url = f"s3://{s3_bucket}/bundles/a"
    code, out, err = _cli(
        capsys, "pack", str(run), url, "--code-dir", str(run.parent / "code"), "--allow-dirty"
    )
    assert code == 0 and "PACK_OK" in out, out + err
    digest = next(ln.split("sha256:")[1] for ln in out.splitlines() if ln.startswith("BUNDLE_DIGEST"))
    assert not (tmp_path / "s3:").exists() and not Path("s3:").exists()
    assert not list(run.parent.glob(".*store-pack*")), "the staging folder is removed"
    objects = _objects(s3_bucket, "bundles/a/")
    assert "bundles/a/SHA256SUMS" in objects and "bundles/a/.torchrelay/parts.json" in objects
    assert hashlib.sha256(objects["bundles/a/SHA256SUMS"]).hexdigest() == digest
    marker = json.loads((run / "checkpoint-4" / "HANDED_OFF.json").read_text())
    assert marker["state"] == "handed-off" and marker["bundle"] == url

    code, out, err = _cli(capsys, "verify", url, "--expect", digest)
    assert code == 0 and "VERIFY_OK" in out and "no local copy" in out, out + err
    assert "1 checkpoint inventories checked" in out

    dest = tmp_path / "prepared"
    code, out, err = _cli(capsys, "prepare", url, "--run-dir", str(dest), "--expect", digest)
    assert code == 0 and "PREPARE_OK" in out, out + err
    for k, v in _files(run / "checkpoint-4").items():
        if k != "HANDED_OFF.json":
            assert _files(dest / "checkpoint-4")[k] == v, k
    assert not list(tmp_path.glob(".prepared.store-bundle-*")), "the download is removed"
    assert json.loads((dest / "REBASE_RECORD.json").read_text())["bundle"] == url

    secret = s3_server.secret_key.encode()
    for root in (run, dest, tmp_path):
        for rel, data in _files(root).items():
            assert secret not in data, f"the secret is in {root / rel}"
    for key, data in _objects(s3_bucket).items():
        assert secret not in data, f"the secret is in the object {key}"
    assert s3_server.secret_key not in out + err

    # a second pack into the same prefix is refused: a bundle is written once
    code, out, err = _cli(capsys, "pack", str(run), url, "--code-dir", str(run.parent / "code"))
    assert code == 2, out + err


@pytest.mark.s3
def test_a_prefix_without_its_commit_object_is_an_incomplete_upload(
    tmp_path: Path, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every object but SHA256SUMS (a pack killed before its commit): verify and prepare refuse it, nothing is
    written to the run directory."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    (folder / "a.bin").write_bytes(os.urandom(1000))
    store = open_store(parse_url(f"s3://{s3_bucket}/half"))
    entries = [SumEntry("a.bin", hashlib.sha256((folder / "a.bin").read_bytes()).hexdigest())]
    upload_files(store, parse_url(f"s3://{s3_bucket}/half"), folder, entries, jobs=2, on_bytes=None)
    code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/half")
    assert code == 2 and "incomplete upload" in err and f"s3://{s3_bucket}/half" in err, out + err
    dest = tmp_path / "run"
    code, out, err = _cli(capsys, "prepare", f"s3://{s3_bucket}/half", "--run-dir", str(dest))
    assert code == 2 and "incomplete upload" in err, out + err
    assert not dest.exists() or not any(dest.iterdir())
    assert sorted(os.listdir(tmp_path)) == ["bundle"], "no download is left behind"


def _committed(tmp_path: Path, bucket: str, prefix: str, files: dict[str, bytes]) -> tuple[object, object]:
    """`files` uploaded under s3://bucket/prefix as a pack uploads them, committed by SHA256SUMS."""
    folder = tmp_path / prefix
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    entries = [SumEntry(rel, hashlib.sha256(data).hexdigest()) for rel, data in sorted(files.items())]
    url = parse_url(f"s3://{bucket}/{prefix}")
    store = open_store(url, jobs=4)
    upload_files(store, url, folder, entries, jobs=4, on_bytes=None)
    assert store.put_if_absent(url.key(SUMS_NAME), format_sums(entries).encode())
    assert not store.put_if_absent(url.key(SUMS_NAME), b"a second commit\n"), "the commit is conditional"
    return store, url


@pytest.mark.s3
def test_a_big_object_is_uploaded_in_parts_and_read_back_part_by_part(tmp_path: Path, s3_bucket: str) -> None:
    """A 40 MiB object goes up as a multipart upload and comes back in 16 MiB ranged GETs, each part checked
    against its recorded SHA-256 state; a part changed in the store fails, named, and is never written out."""
    big = os.urandom(40 << 20)
    store, url = _committed(tmp_path, s3_bucket, "big", {"ckpt/big.bin": big, "small.txt": b"hello\n"})
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    head = s3.head_object(Bucket=s3_bucket, Key="big/ckpt/big.bin")
    assert head["ETag"].strip('"').endswith("-3"), "a multipart upload of 3 parts"
    parts = json.loads(s3.get_object(Bucket=s3_bucket, Key=f"big/{PARTS_REL}")["Body"].read())
    assert len(parts["files"]["ckpt/big.bin"]["parts"]["states"]) == 2
    dest = tmp_path / "down"
    report = read_store_bundle(store, url, jobs=4, dest=dest)  # type: ignore[arg-type]
    assert report.ok, report.problems
    assert (dest / "ckpt/big.bin").read_bytes() == big and report.bytes == len(big) + 6

    # the second part's bytes replaced in the store (same size): that part, and only it, fails
    bad = bytearray(big)
    bad[(16 << 20) + 5] ^= 1
    s3.put_object(Bucket=s3_bucket, Key="big/ckpt/big.bin", Body=bytes(bad))
    report = read_store_bundle(store, url, jobs=4)  # type: ignore[arg-type]
    assert [p for p in report.problems] == [
        f"s3://{s3_bucket}/big/ckpt/big.bin: FAILED (part 1 (bytes {16 << 20}-{(32 << 20) - 1}) does not match)"
    ]


@pytest.mark.s3
def test_missing_bucket_and_wrong_credentials_are_one_line_without_the_secret(
    tmp_path: Path,
    s3_bucket: str,
    s3_server: S3Server,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, out, err = _cli(capsys, "verify", "s3://no-such-bucket-here/x")
    assert code == 2 and "s3://no-such-bucket-here: no such bucket" in err, out + err
    wrong = "wrong-secret-7c1d"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/x")
    assert code == 2 and "refused the credentials" in err and f"s3://{s3_bucket}" in err, out + err
    assert wrong not in out + err and s3_server.secret_key not in out + err
    monkeypatch.setenv("TORCHRELAY_S3_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("TORCHRELAY_S3_ATTEMPTS", "1")
    code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/x")
    assert code == 1 and "cannot reach the store at http://127.0.0.1:9" in err, out + err


@pytest.mark.s3
def test_throttling_and_cut_bodies_are_retried_then_refused_in_one_line(
    tmp_path: Path,
    s3_bucket: str,
    s3_server: S3Server,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a proxy in front of the real server: a few 503 SlowDown answers and bodies cut short are retried
    (bounded, with backoff) and the bundle verifies; more than the attempts allow fails, naming the URL."""
    data = os.urandom(3 << 20)
    _committed(tmp_path, s3_bucket, "flaky", {"a.bin": data, "b.txt": b"b\n"})
    with FaultProxy(s3_server.endpoint) as proxy:
        monkeypatch.setenv("TORCHRELAY_S3_ENDPOINT", proxy.endpoint)
        monkeypatch.setenv("TORCHRELAY_S3_ATTEMPTS", "4")
        proxy.faults = Faults(fail_503=2, truncate=2, match=r"^GET /[^?]*a\.bin")
        code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/flaky")
        assert code == 0 and "VERIFY_OK" in out, out + err
        assert proxy.faults.fail_503 == 0 and proxy.faults.truncate == 0, "the faults were met"

        proxy.faults = Faults(truncate=10, match=r"^GET /[^?]*a\.bin")
        code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/flaky")
        assert code == 1 and f"s3://{s3_bucket}/flaky/a.bin" in err and "cut short" in err, out + err
        assert len(err.strip().splitlines()) == 2  # the line and its hint

        proxy.faults = Faults(fail_503=10, match=r"list-type=2")
        code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/flaky")
        assert code == 1 and "SlowDown (HTTP 503) after 4 attempt(s)" in err and f"s3://{s3_bucket}" in err


@pytest.mark.s3
def test_foreign_and_escaping_keys_and_a_changing_object_are_refused(
    tmp_path: Path,
    s3_bucket: str,
    s3_server: S3Server,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _committed(tmp_path, s3_bucket, "odd", {"a.bin": os.urandom(1 << 20)})
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    s3.put_object(Bucket=s3_bucket, Key="odd/stranger.txt", Body=b"not ours")
    code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/odd")
    assert code == 2 and f"s3://{s3_bucket}/odd/stranger.txt: UNEXPECTED" in out, out + err
    dest = tmp_path / "run"
    code, out, err = _cli(capsys, "prepare", f"s3://{s3_bucket}/odd", "--run-dir", str(dest))
    assert code == 2 and "stranger.txt: UNEXPECTED" in err and not dest.exists(), out + err
    s3.delete_object(Bucket=s3_bucket, Key="odd/stranger.txt")

    with FaultProxy(s3_server.endpoint) as proxy:
        monkeypatch.setenv("TORCHRELAY_S3_ENDPOINT", proxy.endpoint)
        proxy.faults = Faults(list_extra_key="odd/../escape")
        code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/odd")
        assert code == 2 and "'odd/../escape'" in err and "refusing the bundle" in err, out + err

        # the object replaced between the listing and its read: refused, naming it
        def replace_once(method: str, path: str) -> None:
            if method == "GET" and path.split("?")[0].endswith("/odd/a.bin") and not replaced:
                replaced.append(path)
                s3.put_object(Bucket=s3_bucket, Key="odd/a.bin", Body=os.urandom(1 << 20))

        replaced: list[str] = []
        proxy.faults = Faults(before=replace_once)
        code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/odd")
        assert replaced and code == 1 and f"s3://{s3_bucket}/odd/a.bin: the object changed" in err, out + err


def _killed_at(step: str, argv: list[str]) -> None:
    """`torchrelay ARGV` in a forked child that SIGKILLs itself at `step` (kill_points.arm): a real kill."""
    import signal

    from torchrelay.util import kill_points

    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 3
        try:
            kill_points.arm(step)
            main(argv)
        except BaseException:  # noqa: BLE001 - any way out but the kill is reported by the exit code
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{step}: not killed ({status})"


@pytest.mark.s3
def test_a_pack_killed_before_its_commit_is_rolled_back_and_one_killed_after_is_finished(
    tmp_path: Path, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILLed during the upload (its record names the prefix, SHA256SUMS not written): the prefix is an
    incomplete upload, and the next pack into it rolls it back and packs. Killed after the commit: the next pack
    completes the record and refuses a second hand-off; the bundle verifies."""
    run = _run(tmp_path)
    url = f"s3://{s3_bucket}/killed"
    pack = ["pack", str(run), url, "--code-dir", str(run.parent / "code"), "--allow-dirty"]
    _killed_at("pack:uploaded", pack)
    marker = json.loads((run / "checkpoint-4" / "HANDED_OFF.json").read_text())
    assert marker["state"] == "packing" and marker["bundle"] == url
    assert f"killed/{SUMS_NAME}" not in _objects(s3_bucket, "killed/") and _objects(s3_bucket, "killed/")
    code, out, err = _cli(capsys, "verify", url)
    assert code == 2 and "incomplete upload" in err, out + err
    capsys.readouterr()
    code, out, err = _cli(capsys, *pack)
    assert code == 0 and "rolled back an interrupted pack into" in out and "PACK_OK" in out, out + err

    url2 = f"s3://{s3_bucket}/killed-late"
    run2 = tmp_path / "run2"
    import shutil

    shutil.copytree(run, run2, symlinks=True)
    (run2 / "checkpoint-4" / "HANDED_OFF.json").unlink()
    pack2 = ["pack", str(run2), url2, "--code-dir", str(run.parent / "code"), "--allow-dirty"]
    _killed_at("pack:summed", pack2)
    code, out, err = _cli(capsys, "verify", url2)
    assert code == 0 and "VERIFY_OK" in out, out + err
    code, out, err = _cli(capsys, *pack2)
    assert code == 2 and "already handed off" in err, out + err
    assert json.loads((run2 / "checkpoint-4" / "HANDED_OFF.json").read_text())["state"] == "handed-off"


@pytest.mark.s3
def test_a_pack_whose_uploads_fail_leaves_nothing_committed_and_no_hand_off(
    tmp_path: Path,
    s3_bucket: str,
    s3_server: S3Server,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the fault proxy: a few 503s on the uploads are retried and the pack commits; a store that keeps
    failing ends the pack in one line naming the object, its objects deleted, the checkpoint not handed off."""
    run = _run(tmp_path)
    capsys.readouterr()  # the run's making (its in-process close warns that it left run.steps): not the pack's
    pack = ["pack", str(run), "", "--code-dir", str(run.parent / "code"), "--allow-dirty"]
    with FaultProxy(s3_server.endpoint) as proxy:
        monkeypatch.setenv("TORCHRELAY_S3_ENDPOINT", proxy.endpoint)
        monkeypatch.setenv("TORCHRELAY_S3_ATTEMPTS", "3")
        proxy.faults = Faults(fail_503=40, match=r"^PUT ")
        pack[2] = f"s3://{s3_bucket}/down"
        code, out, err = _cli(capsys, *pack)
        assert (
            code == 1 and "SlowDown (HTTP 503) after 3 attempt(s)" in err and f"s3://{s3_bucket}/down" in err
        )
        assert len(err.strip().splitlines()) == 2, err
        assert not (run / "checkpoint-4" / "HANDED_OFF.json").exists(), "a failed pack hands nothing off"
        assert not _objects(s3_bucket, "down/"), "the failed pack's objects are deleted"
        assert not list(run.parent.glob(".*store-pack*"))

        proxy.faults = Faults(fail_503=3, match=r"^PUT ")
        pack[2] = f"s3://{s3_bucket}/flaky"
        code, out, err = _cli(capsys, *pack)
        assert code == 0 and "PACK_OK" in out and proxy.faults.fail_503 == 0, out + err
    monkeypatch.setenv("TORCHRELAY_S3_ENDPOINT", s3_server.endpoint)
    code, out, err = _cli(capsys, "verify", f"s3://{s3_bucket}/flaky")
    assert code == 0 and "VERIFY_OK" in out, out + err


@pytest.mark.s3
@pytest.mark.skipif(
    __import__("shutil").which("ssh-keygen") is None,
    reason="ssh-keygen (openssh-client) is not installed and could not be (scripts/env.sh installs it as root)",
)
def test_a_signed_bundle_in_the_store_verifies_only_against_its_signer(
    tmp_path: Path, s3_bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import subprocess

    signers = {}
    for name in ("alice", "mallory"):
        key = tmp_path / name
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True
        )
        signers[name] = tmp_path / f"{name}_signers"
        signers[name].write_text(
            f'{name} namespaces="torchrelay-bundle" {key.with_suffix(".pub").read_text()}'
        )
    run = _run(tmp_path)
    url = f"s3://{s3_bucket}/signed"
    argv = [
        "pack",
        str(run),
        url,
        "--code-dir",
        str(run.parent / "code"),
        "--allow-dirty",
        "--sign",
        str(tmp_path / "alice"),
    ]
    code, out, err = _cli(capsys, *argv)
    assert code == 0 and f"signed: {url}/SHA256SUMS.sig" in out, out + err
    code, out, err = _cli(capsys, "verify", url, "--allowed-signers", str(signers["alice"]))
    assert code == 0 and "signed by alice" in out and "VERIFY_OK" in out, out + err
    code, out, err = _cli(capsys, "verify", url, "--allowed-signers", str(signers["mallory"]))
    assert code == 2 and "VERIFY_OK" not in out, out + err
    dest = tmp_path / "prepared"
    code, out, err = _cli(
        capsys, "prepare", url, "--run-dir", str(dest), "--allowed-signers", str(signers["mallory"])
    )
    assert code == 2 and not dest.exists(), out + err
