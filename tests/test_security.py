"""A bundle is untrusted input: planted pickles never run, and paths never leave the bundle."""

from __future__ import annotations

import builtins
import io
import json
import os
import pickle
import shutil
import signal
import tarfile
from pathlib import Path
from typing import Any

import pytest

from handoff_fixtures import STOP_AT, Packed
from helpers import launch
from torchrelay.checkpoint import dcp_io
from torchrelay.cli import VERBS, main
from torchrelay.errors import IntegrityError, RelayError, UnsafeInput
from torchrelay.handoff.pack import PackOptions, pack
from torchrelay.handoff.prepare import PrepareOptions, prepare
from torchrelay.handoff.source import extract_source
from torchrelay.handoff.verify import verify_bundle
from torchrelay.util.hashing import sha256_file
from torchrelay.util.safepath import walk_files
from torchrelay.util.sums import SUMS_NAME, SumEntry, write_sums

CKPT = f"checkpoint-{STOP_AT}"


class _Payload:
    """A real malicious pickle: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (builtins.open, (self.marker, "w"))


def payload(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker))


def resign(bundle: Path) -> None:
    """Do what an attacker who controls the bundle can: make inventories and SHA256SUMS agree with the files."""
    ckpt = bundle / CKPT
    doc = json.loads((ckpt / "COMPLETE.json").read_text())
    listed = {f["path"] for f in doc["files"]}
    for rel in walk_files(ckpt):
        if rel != "COMPLETE.json" and rel not in listed:
            doc["files"].append({"path": rel, "size": 0, "sha256": ""})
    for f in doc["files"]:
        digest, size = sha256_file(ckpt / f["path"])
        f["sha256"], f["size"] = digest, size
    (ckpt / "COMPLETE.json").write_text(json.dumps(doc))
    entries = [SumEntry(rel, sha256_file(bundle / rel)[0]) for rel in walk_files(bundle) if rel != SUMS_NAME]
    write_sums(bundle / SUMS_NAME, entries)


def plant_in_shard(shard: Path, model_dir: Path, marker: Path) -> None:
    """Put a torch.save'd payload where DCP will read the shard's first tensor (same offset, fits its length)."""
    md = dcp_io.read_metadata(model_dir)
    items = [s for s in md.storage_data.values() if Path(str(s.relative_path)).name == shard.name]
    first = min(items, key=lambda s: s.offset)
    buf = io.BytesIO()
    import torch

    torch.save(_Payload(marker), buf)
    data = buf.getvalue()
    assert len(data) <= first.length, "the payload must fit where the first tensor is read"
    raw = bytearray(shard.read_bytes())
    raw[first.offset : first.offset + len(data)] = data
    shard.write_bytes(bytes(raw))


PLACES = [
    f"{CKPT}/model/.metadata",
    f"{CKPT}/model/__0_0.distcp",
    f"{CKPT}/rng/rank-0.safetensors",
    f"{CKPT}/state_tensors.safetensors",
    f"{CKPT}/relay_state.json",
    "config.json",
    "bundle.json",
]


def test_the_payload_is_live(tmp_path: Path) -> None:
    marker = tmp_path / "sanity"
    pickle.loads(payload(marker))  # noqa: S301 - proving the payload really executes when unpickled
    assert marker.exists()


@pytest.mark.launch
@pytest.mark.parametrize("place", PLACES)
def test_planted_pickle_never_runs(packed: Packed, tmp_path: Path, place: str) -> None:
    marker = tmp_path / "PWNED"
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    target = bundle / place
    if place.endswith(".distcp"):
        plant_in_shard(target, bundle / CKPT / "model", marker)
    else:
        target.write_bytes(payload(marker))
    resign(bundle)

    outcomes = {}
    outcomes["verify"] = main(["verify", str(bundle)])
    outcomes["diff"] = _quiet(lambda: main(["diff", str(bundle), str(packed.bundle)]))
    for verb in ("status", "ledger"):
        if verb in VERBS and _has_verb(verb):
            outcomes[verb] = _quiet(lambda v=verb: main([v, str(bundle)]))  # type: ignore[misc]
    from torchrelay.ledger.exposure import prove

    outcomes["ledger-lib"] = _quiet(lambda: prove(bundle))
    run_dir = tmp_path / "run"
    outcomes["prepare"] = main(["prepare", str(bundle), "--run-dir", str(run_dir)])
    if run_dir.exists():
        out = launch(next((run_dir / "source").iterdir()), run_dir)
        outcomes["resume"] = out.returncode
        assert out.returncode != 0, "a tampered checkpoint must not train"
    assert not marker.exists(), f"payload in {place} executed; outcomes {outcomes}"
    if place.startswith(CKPT):
        # a re-signed checkpoint passes every integrity check, so the payload really reached the loaders
        assert outcomes["verify"] == 0 and outcomes["prepare"] == 0 and "resume" in outcomes, outcomes


def _has_verb(verb: str) -> bool:
    import importlib

    try:
        importlib.import_module(f"torchrelay.commands.{VERBS[verb]}")
    except ModuleNotFoundError:
        return False
    return True


def _quiet(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except (RelayError, ValueError, OSError) as exc:
        return type(exc).__name__


@pytest.mark.launch
@pytest.mark.parametrize(
    "bad",
    ["/etc/passwd", "../outside.txt", "a/../../outside.txt", "ok/./../../x", ".git/config", "x/.git/HEAD"],
)
def test_unsafe_paths_in_sha256sums_are_refused(packed: Packed, tmp_path: Path, bad: str) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    (tmp_path / "outside.txt").write_text("secret")
    with open(bundle / SUMS_NAME, "a") as f:
        f.write(f"{'0' * 64}  {bad}\n")
    with pytest.raises(UnsafeInput, match=r"absolute|climbs out|\.git"):
        verify_bundle(bundle)
    with pytest.raises(UnsafeInput):
        prepare(bundle, PrepareOptions(run_dir=tmp_path / "run"), say=lambda s: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.launch
def test_symlink_out_of_the_bundle_is_refused(packed: Packed, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    os.symlink(secret, bundle / "data" / "link.txt")
    with open(bundle / SUMS_NAME, "a") as f:
        f.write(f"{sha256_file(secret)[0]}  data/link.txt\n")
    with pytest.raises(UnsafeInput, match="symlink"):
        verify_bundle(bundle)
    # a symlinked directory on the way out is refused the same
    (bundle / "data" / "link.txt").unlink()
    os.symlink(tmp_path, bundle / "escape")
    lines = (bundle / SUMS_NAME).read_text().replace("data/link.txt", "escape/secret.txt")
    (bundle / SUMS_NAME).write_text(lines)
    with pytest.raises(UnsafeInput, match="symlink"):
        verify_bundle(bundle)


@pytest.mark.launch
@pytest.mark.parametrize("bad", ["../../outside.txt", "/etc/passwd"])
def test_unsafe_paths_in_an_inventory_are_refused(packed: Packed, tmp_path: Path, bad: str) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    doc = json.loads((bundle / CKPT / "COMPLETE.json").read_text())
    doc["files"].append({"path": bad, "size": 6, "sha256": "0" * 64})
    (bundle / CKPT / "COMPLETE.json").write_text(json.dumps(doc))
    resign_sums_only(bundle)
    with pytest.raises(UnsafeInput):
        verify_bundle(bundle)


def resign_sums_only(bundle: Path) -> None:
    entries = [SumEntry(rel, sha256_file(bundle / rel)[0]) for rel in walk_files(bundle) if rel != SUMS_NAME]
    write_sums(bundle / SUMS_NAME, entries)


def test_source_archive_escaping_its_folder_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("code-1/ok.py", "code-1/../../escaped.py"):
            data = b"print(1)\n"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(UnsafeInput):
        extract_source(archive, tmp_path / "out", "code-1")
    assert not (tmp_path / "escaped.py").exists()


def test_a_source_archive_unpacking_past_the_free_space_is_refused_before_a_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzip bomb in a bundle's source archive (1 GiB of zeros in about a megabyte) filled the disk `prepare`
    extracted onto; its headers declare the sizes, checked against the free space before anything is created."""
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        ok = _member("code-1/ok.py")
        ok.size = 9
        tar.addfile(ok, io.BytesIO(b"print(1)\n"))
        big = _member("code-1/zeros.bin")
        big.size = 4 << 20
        tar.addfile(big, io.BytesIO(bytes(big.size)))
    assert archive.stat().st_size < 64 << 10
    real = shutil.disk_usage
    free = 64 << 20  # what the host has left: less than the files and the room kept beside them

    def disk_usage(path: Any) -> Any:
        return real(path)._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(IntegrityError, match=r"unpack to 4 MiB; .* has 64 MiB free"):
        extract_source(archive, tmp_path / "out", "code-1")
    assert not (tmp_path / "out" / "code-1").exists(), "nothing may land before the refusal"
    free = 1 << 40
    out = extract_source(archive, tmp_path / "out", "code-1")
    assert (out / "zeros.bin").stat().st_size == 4 << 20


def _retar_source(bundle: Path, add: object) -> None:
    """Rewrite the bundle's source archive: its files plus whatever `add(tar, prefix, workdir)` puts in."""
    info = json.loads((bundle / "bundle.json").read_text())
    archive, prefix = bundle / info["source"]["archive"], info["source"]["archive_prefix"]
    work = bundle.parent / "retar"
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(work, filter="data")
    add(work, prefix)  # type: ignore[operator]
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work / prefix, arcname=prefix)
    shutil.rmtree(work)
    resign_sums_only(bundle)


def _fake_git_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `git` first on PATH that records every call (its folder and arguments), then runs the real one."""
    real = shutil.which("git")
    assert real is not None
    log = tmp_path / "git-calls.log"
    fake = tmp_path / "fakebin" / "git"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$PWD $*" >> {log}\nexec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    return log


@pytest.mark.launch
def test_a_planted_git_repository_in_the_source_never_runs(
    packed: Packed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: prepare ran git inside the extracted source, whose .git/config had core.fsmonitor = a command."""
    marker = tmp_path / "FSMONITOR_RAN"
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)

    def plant(work: Path, prefix: str) -> None:
        from helpers import git

        tree = work / prefix
        git(tree, "init", "-q", "-b", "main")
        git(tree, "add", "-A")
        git(tree, "commit", "-q", "-m", "same files, hostile config")
        git(tree, "config", "core.fsmonitor", f"touch {marker}; false")
        git(tree, "config", "core.pager", f"touch {marker}")

    _retar_source(bundle, plant)
    calls = _fake_git_on_path(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    with pytest.raises(RelayError) as refused:
        prepare(bundle, PrepareOptions(run_dir=run_dir), say=lambda s: None)
    assert not marker.exists(), "git ran the bundle's core.fsmonitor command"
    assert isinstance(refused.value, UnsafeInput) and ".git" in str(refused.value)
    assert not run_dir.exists() and not list(tmp_path.glob(".run.prepare-tmp-*"))
    assert not calls.exists(), f"prepare ran git: {calls.read_text()}"


@pytest.mark.launch
def test_prepare_and_recheck_run_no_git_at_all(
    packed: Packed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code identity of a tree that came from a bundle is a plain content hash: not one git call."""
    calls = _fake_git_on_path(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    base = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
    assert main(["verify", str(packed.bundle), "--quiet"]) == 0
    prepare(packed.bundle, PrepareOptions(run_dir=run_dir, sets=base), say=lambda s: None)
    again = prepare(packed.bundle, PrepareOptions(run_dir=run_dir, sets=base), say=lambda s: None)
    assert again.already_prepared and (run_dir / "REBASE_RECORD.json").is_file()
    assert not calls.exists(), f"verify or prepare ran git: {calls.read_text()}"


@pytest.mark.launch
def test_pack_and_prepare_into_a_link_to_an_empty_folder_fill_the_folder(
    packed: Packed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A destination linked to scratch space (`bundle -> /scratch/me/bundle`, an empty folder): the bundle and
    the prepared run land in the folder the link names, and the link still leads there. (The finished copy was
    renamed onto the link itself: "Not a directory", exit 2.)"""
    source = tmp_path / "source"
    shutil.copytree(packed.source, source, symlinks=True)  # pack marks its checkpoint handed off
    monkeypatch.setenv("TORCHRELAY_RECLAIM", "1")  # the copy's checkpoint was handed off to the shared bundle
    (tmp_path / "scratch" / "bundle").mkdir(parents=True)
    (tmp_path / "scratch" / "run").mkdir()
    os.symlink(tmp_path / "scratch" / "bundle", tmp_path / "bundle")
    os.symlink(tmp_path / "scratch" / "run", tmp_path / "run")
    pack(source, tmp_path / "bundle", PackOptions(code_dir=packed.code))
    assert (tmp_path / "bundle").is_symlink() and (tmp_path / "scratch" / "bundle" / SUMS_NAME).is_file()
    assert main(["verify", str(tmp_path / "bundle"), "--quiet"]) == 0
    base = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
    prepare(tmp_path / "bundle", PrepareOptions(run_dir=tmp_path / "run", sets=base), say=lambda s: None)
    assert (tmp_path / "run").is_symlink() and (tmp_path / "scratch" / "run" / "REBASE_RECORD.json").is_file()


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_member("code-1/.git/config"), r"\.git"),
        (_member("code-1/sub/.GIT/hooks/post-checkout"), r"\.git"),
        (_member("/etc/cron.d/x"), "absolute"),
        (_member("code-1/../../escaped.py"), r"\.\."),
        (_member("other/x.py"), "outside the expected folder"),
        (_member("code-1/dev", tarfile.CHRTYPE), "device"),
        (_member("code-1/fifo", tarfile.FIFOTYPE), "device, pipe"),
        (_member("code-1/up", tarfile.SYMTYPE, "../../etc/passwd"), "links to"),
        (_member("code-1/abs", tarfile.SYMTYPE, "/etc/passwd"), "links to"),
        (_member("code-1/hard", tarfile.LNKTYPE, "etc/passwd"), "links to"),
        (_member("code-1/g", tarfile.SYMTYPE, ".git/config"), r"\.git"),
    ],
)
def test_source_archive_members_that_could_escape_or_run_are_refused(
    tmp_path: Path, member: tarfile.TarInfo, why: str
) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        ok = _member("code-1/ok.py")
        ok.size = 9
        tar.addfile(ok, io.BytesIO(b"print(1)\n"))
        if member.isreg():
            member.size = 1
            tar.addfile(member, io.BytesIO(b"x"))
        else:
            tar.addfile(member)
    with pytest.raises(UnsafeInput, match=why):
        extract_source(archive, tmp_path / "out", "code-1")
    assert not (tmp_path / "out" / "code-1" / "ok.py").exists(), "nothing may land before the refusal"


def test_links_inside_the_source_tree_are_kept(tmp_path: Path) -> None:
    archive = tmp_path / "fine.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        ok = _member("code-1/pkg/ok.py")
        ok.size = 9
        tar.addfile(ok, io.BytesIO(b"print(1)\n"))
        tar.addfile(_member("code-1/alias.py", tarfile.SYMTYPE, "pkg/ok.py"))
        # a repository's usual chain (configs/latest -> v2, configs/current.py -> latest/ok.py): a link through
        # a link that stays inside, which `pack` writes from a clean commit and prepare once refused
        tar.addfile(_member("code-1/configs/v2", tarfile.DIRTYPE))
        tar.addfile(_member("code-1/configs/latest", tarfile.SYMTYPE, "v2"))
        tar.addfile(_member("code-1/configs/current.py", tarfile.SYMTYPE, "latest/ok.py"))
        tar.addfile(_member("code-1/configs/up", tarfile.SYMTYPE, "latest/../../pkg"))
        two = _member("code-1/configs/v2/ok.py")
        two.size = 9
        tar.addfile(two, io.BytesIO(b"print(2)\n"))
    out = extract_source(archive, tmp_path / "out", "code-1")
    assert (out / "alias.py").read_text() == "print(1)\n"
    assert (out / "configs" / "current.py").read_text() == "print(2)\n"
    assert (out / "configs" / "up" / "ok.py").read_text() == "print(1)\n"


def _add(
    tar: tarfile.TarFile, name: str, kind: bytes = tarfile.REGTYPE, link: str = "", data: bytes = b""
) -> None:
    info = _member(name, kind, link)
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data else None)


def test_a_chain_of_links_past_path_max_writes_nothing_outside(tmp_path: Path) -> None:
    """CVE-2025-4517's archive: folders of long names, a link to each, a link through the chain that climbs back
    up, and a member under it. Each link's target, normalised as text, stays in the folder, and Python 3.11.7's
    "data" filter, resolving it past PATH_MAX, let it through: the file landed outside the run. Now a member under
    a link and a link through a link are refused, in one short line, before anything is written."""
    dest = tmp_path / "run.prepare-tmp-0123456789ab" / "source"
    victim = dest.parent.parent / "victim.txt"
    victim.write_text("original content\n")
    prefix, steps = "code-1", "abcdefghijklmnop"
    comp = "d" * ((4096 - len(str(dest)) - len(prefix) - 1) // (len(steps) + 1))
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, prefix, tarfile.DIRTYPE)
        path = prefix
        for step in steps:
            _add(tar, f"{path}/{comp}", tarfile.DIRTYPE)
            _add(tar, f"{path}/{step}", tarfile.SYMTYPE, comp)
            path = f"{path}/{comp}"
        deep = "/".join([*steps, "l" * 254])
        _add(tar, f"{prefix}/{deep}", tarfile.SYMTYPE, "/".join([".."] * len(steps)))
        _add(tar, f"{prefix}/escape", tarfile.SYMTYPE, deep + "/.." * 3)
        _add(tar, f"{prefix}/escape/victim.txt", data=b"written outside the run directory\n")
    with pytest.raises(UnsafeInput, match="refused") as info:
        extract_source(archive, dest, prefix)
    assert victim.read_text() == "original content\n"
    assert len(str(info.value)) < 600 and "\n" not in info.value.message, str(info.value)
    assert not any(dest.iterdir()), "nothing may land before the refusal"


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([("code-1/a", tarfile.SYMTYPE, "pkg"), ("code-1/b", tarfile.SYMTYPE, "a/../..")], "outside code-1/"),
        (
            [("code-1/a", tarfile.SYMTYPE, "b"), ("code-1/b", tarfile.SYMTYPE, "a/x")],
            "a loop of symbolic links",
        ),
        (  # each link names the one before it twice: 2**30 lookups, where the kernel follows 40 links in all
            [("code-1/l0", tarfile.SYMTYPE, ".")]
            + [(f"code-1/l{k + 1}", tarfile.SYMTYPE, f"l{k}/l{k}") for k in range(30)],
            "a loop of symbolic links",
        ),
        (
            [("code-1/pkg/up", tarfile.SYMTYPE, ".."), ("code-1/c", tarfile.SYMTYPE, "pkg/up/pkg/up/..")],
            "outside",
        ),
        (
            [("code-1/a", tarfile.SYMTYPE, "pkg"), ("code-1/a/x.py", tarfile.REGTYPE, "")],
            "under a symbolic link",
        ),
        ([("code-1/x.py", tarfile.REGTYPE, ""), ("code-1/x.py", tarfile.REGTYPE, "")], "twice"),
        ([("code-1/" + "d/" * 2040 + "x.py", tarfile.REGTYPE, "")], "longer than a path can be"),
        ([("code-1/a", tarfile.SYMTYPE, "x" * 300)], "longer than a name"),
    ],
)
def test_source_archive_links_resolved_only_where_text_is_truth(
    tmp_path: Path, members: list[tuple[str, bytes, str]], why: str
) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "code-1/pkg", tarfile.DIRTYPE)
        for name, kind, link in members:
            _add(tar, name, kind, link, b"x" if kind == tarfile.REGTYPE else b"")
    with pytest.raises(UnsafeInput, match=why):
        extract_source(archive, tmp_path / "out", "code-1")
    assert not (tmp_path / "out" / "code-1").exists(), "nothing may land before the refusal"


# --- DCP metadata: class state, types, shard paths ------------------------------------------------------------


def _metadata_file(tmp_path: Path, data: bytes) -> Path:
    model = tmp_path / "ckpt" / "model"
    model.mkdir(parents=True)
    (model / ".metadata").write_bytes(data)
    return model


def _build_on(target: bytes) -> bytes:
    """A pickle that pushes `target` (opcodes), gives it state {'torchrelay_poisoned': 1} by BUILD, and returns it."""
    state = b"N}" + b"\x8c\x13torchrelay_poisoned" + b"K\x01s" + b"\x86"  # (None, {'torchrelay_poisoned': 1})
    return b"\x80\x04" + target + state + b"b."


_POSIXPATH = b"\x8c\x07pathlib\x8c\tPosixPath\x93"
_ENUM_MEMBER = (
    b"\x8c%torch.distributed.checkpoint.metadata\x8c\x14_MEM_FORMAT_ENCODING\x93" + b"K\x01\x85R"
)  # _MEM_FORMAT_ENCODING(1): the process-wide enum member, not a fresh object
_VIA_MEMO = _POSIXPATH + b"\x94" + b"0" + b"h\x00"  # memoized, popped, fetched back: the same class


@pytest.mark.parametrize(
    "target", [_POSIXPATH, _ENUM_MEMBER, _VIA_MEMO], ids=["class", "enum-member", "memo"]
)
def test_state_given_to_a_shared_object_is_refused(tmp_path: Path, target: bytes) -> None:
    """Defect: BUILD on an allow-listed class (or enum member) changed it for the whole process."""
    import pathlib

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    data = _build_on(target)
    model = _metadata_file(tmp_path, data)
    victims = [pathlib.PosixPath, *list(_MEM_FORMAT_ENCODING)]
    try:
        with pytest.raises(UnsafeInput, match=r"\.metadata"):
            dcp_io.read_metadata(model)
        poisoned = [v for v in victims if "torchrelay_poisoned" in vars(v)]
        assert not poisoned, f"the unpickler changed {poisoned} for the whole process"
    finally:
        for v in victims:
            if "torchrelay_poisoned" in vars(v):
                delattr(v, "torchrelay_poisoned")


def _dumped(md: object) -> bytes:
    return pickle.dumps(md, protocol=4)


def _real_metadata(packed: Packed) -> object:
    return dcp_io.read_metadata(packed.bundle / CKPT / "model")


@pytest.mark.launch
def test_metadata_of_the_wrong_shape_is_refused(packed: Packed, tmp_path: Path) -> None:
    """Only allow-listed classes, yet the wrong types where DCP expects others: refused, named, never a crash."""
    import copy

    md = _real_metadata(packed)
    cases = {}
    for name, change in {
        "state_dict_metadata": lambda m: setattr(m, "state_dict_metadata", "x"),
        "storage_data": lambda m: setattr(m, "storage_data", [1, 2]),
        "relative_path": lambda m: setattr(next(iter(m.storage_data.values())), "relative_path", 5),
        "offset": lambda m: setattr(next(iter(m.storage_data.values())), "offset", -8),
        "length": lambda m: setattr(next(iter(m.storage_data.values())), "length", "big"),
        "storage_meta": lambda m: setattr(m, "storage_meta", {1, 2}),
    }.items():
        bad = copy.deepcopy(md)
        change(bad)
        cases[name] = _dumped(bad)
    cases["not-metadata"] = _dumped({"a": 1})
    for name, data in cases.items():
        where = tmp_path / name
        model = _metadata_file(where, data)
        shutil.copyfile(packed.bundle / CKPT / "COMPLETE.json", model.parent / "COMPLETE.json")
        with pytest.raises(UnsafeInput, match=r"\.metadata") as info:
            dcp_io.read_metadata(model)
        assert "Traceback" not in str(info.value), name


@pytest.mark.launch
@pytest.mark.parametrize(
    "escape", ["/dev/zero", "../../../outside.distcp", "__0_0.copy.distcp", "past-the-end"]
)
def test_shard_paths_outside_the_checkpoint_or_its_inventory_are_refused(
    packed: Packed, tmp_path: Path, escape: str
) -> None:
    """Defect: a shard path in .metadata (absolute, '..', unlisted) made the load read another file silently."""
    from torchrelay.checkpoint.reader import load_tensors

    ckpt = tmp_path / "runs" / "run" / CKPT
    shutil.copytree(packed.bundle / CKPT, ckpt)
    model = ckpt / "model"
    md = dcp_io.read_metadata(model)
    shard = sorted(model.glob("*.distcp"))[0]
    # the same bytes where the forged path leads: a silent read would return the right tensors
    shutil.copyfile(shard, tmp_path / "outside.distcp")
    shutil.copyfile(shard, model / "__0_0.copy.distcp")
    victim = next(info for info in md.storage_data.values() if info.relative_path == shard.name)
    if escape == "past-the-end":
        victim.offset = shard.stat().st_size
    else:
        victim.relative_path = escape
    (model / ".metadata").write_bytes(_dumped(md))
    with pytest.raises(UnsafeInput, match=r"\.metadata") as info:
        load_tensors(ckpt)
    assert escape in str(info.value) or "bytes" in str(info.value)


@pytest.mark.launch
def test_recorded_code_paths_never_lead_prepare_out_of_the_source(packed: Packed, tmp_path: Path) -> None:
    """The contract's code.untracked names files by path; from a bundle, '../x' or '/dev/zero' must not be read."""
    from torchrelay.records.contract import contract_sha256

    outside = tmp_path / "outside.py"
    outside.write_text("secret = 1\n")
    for bad in ("../../../outside.py", "/dev/zero", str(outside)):
        bundle = tmp_path / f"bundle-{len(bad)}"
        shutil.copytree(packed.bundle, bundle)
        contract = json.loads((bundle / "resume_contract.json").read_text())
        contract["fields"]["code.untracked"] = {bad: sha256_file(outside)[0]}
        contract["fields"]["code.dirty"] = True  # what a run with an untracked file records
        contract["sha256"] = contract_sha256(contract["fields"])
        (bundle / "resume_contract.json").write_text(json.dumps(contract))
        resign_sums_only(bundle)
        run_dir = tmp_path / f"run-{len(bad)}"
        base = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
        signal.signal(signal.SIGALRM, _too_long)
        signal.alarm(60)  # /dev/zero read to its end never returns
        try:
            with pytest.raises(RelayError, match=r"code\.untracked"):
                prepare(bundle, PrepareOptions(run_dir=run_dir, sets=base), say=lambda s: None)
        finally:
            signal.alarm(0)
        assert not run_dir.exists(), bad


def _too_long(signum: int, frame: object) -> None:
    raise AssertionError("prepare read a recorded path without end (a device)")


@pytest.mark.launch
def test_only_top_level_checkpoints_are_checkpoints(packed: Packed, tmp_path: Path) -> None:
    """prepare copies the folders holding an inventory into the run dir: a forged one elsewhere is no checkpoint."""
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    planted = bundle / "data" / "hooks"
    planted.mkdir()
    (planted / "post-checkout").write_text("#!/bin/sh\ntouch /tmp/pwned\n")
    digest, size = sha256_file(planted / "post-checkout")  # an inventory that checks out
    inventory = {
        "format": 1,
        "update": 1,
        "files": [{"path": "post-checkout", "size": size, "sha256": digest}],
    }
    (planted / "COMPLETE.json").write_text(json.dumps(inventory))
    resign_sums_only(bundle)
    report = verify_bundle(bundle)
    assert not report.ok and report.checkpoints == [CKPT]
    assert any(
        "data/hooks/COMPLETE.json: an inventory outside a checkpoint-N/" in p for p in report.problems()
    )
    with pytest.raises(RelayError):
        prepare(bundle, PrepareOptions(run_dir=tmp_path / "run"), say=lambda s: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("length", [5_000_000, 300])
def test_a_path_longer_than_a_path_can_be_is_refused_in_one_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], length: int
) -> None:
    """A SHA256SUMS line naming a path of 5 million characters (or one name of 300 bytes): verify tried to open
    it, and its ENAMETOOLONG message repeated the whole path (5 MB on one line) and named neither SHA256SUMS nor
    its line; now the line is refused, shortened, naming the file and the line."""
    from helpers import REPO

    bundle = tmp_path / "bundle"
    shutil.copytree(REPO / "tests" / "fixtures" / "legacy-v0.1.0" / "bundle", bundle, symlinks=True)
    lines = (bundle / SUMS_NAME).read_text().count("\n")
    with open(bundle / SUMS_NAME, "a") as f:
        f.write(f"{'0' * 64}  {'x' * length}\n")
    with pytest.raises(UnsafeInput, match="longer than a path can be"):
        verify_bundle(bundle)
    assert main(["verify", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert f"{SUMS_NAME}:{lines + 1}: path 'xxx" in err and len(err) < 1000, err[:300]


def test_the_tree_hash_of_an_extracted_source_reads_a_file_in_bounded_memory(tmp_path: Path) -> None:
    """A bundle's source archive is extracted and its tree hashed (identity/files.git_tree_of_dir) before the
    contract's code.tree refuses it; the hash read each file whole and then copied it behind git's blob header:
    a 1 MB gzip of 1 GiB of zeros took 2.4 GB of memory in `prepare` (a 10 MB one, more than most hosts have).
    Now each file is hashed a block at a time; the hash is still git's own."""
    import subprocess
    import tracemalloc

    from helpers import git
    from torchrelay.identity.files import git_tree_of_dir

    code = tmp_path / "code"
    (code / "sub").mkdir(parents=True)
    (code / "big.bin").write_bytes(bytes(48 << 20))
    (code / "sub" / "run.py").write_text("print('hi')\n")
    (code / "sub" / "run.py").chmod(0o755)
    (code / "link").symlink_to("sub/run.py")
    git(code, "init", "-q")
    git(code, "add", "-A")
    want = subprocess.run(["git", "-C", str(code), "write-tree"], capture_output=True, text=True, check=True)
    tracemalloc.start()
    try:
        got = git_tree_of_dir(code)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == want.stdout.strip()
    assert peak < 16 << 20, f"hashing the tree took {peak:,} bytes"
