"""A path a recorded contract or a bundle's config.json names is hostile until checked: the code identity reads no
`code.untracked` / `code.modified` key outside the code directory (git checkout or plain tree), and `prepare` reads
no external file the bundle names that its contract does not vouch for, nor prints the digest of one it did not
ship. Each refusal names the field; the file's SHA-256 is never in it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from handoff_fixtures import Packed
from helpers import git
from test_security import resign_sums_only
from torchrelay.errors import RelayError, UnsafeInput
from torchrelay.handoff.prepare import PrepareOptions, prepare
from torchrelay.identity import code_identity
from torchrelay.records.contract import contract_sha256


def _checkout(tmp_path: Path) -> tuple[Path, Path, str]:
    """A git checkout with one committed script, a secret beside it (outside) and a link out of it."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print('train')\n")
    git(code, "init", "-q", "-b", "main")
    git(code, "add", "train.py")
    git(code, "commit", "-q", "-m", "train")
    secret = tmp_path / "secret.txt"
    secret.write_text("the trainer can read this, the bundle's author cannot\n")
    (code / "up").symlink_to(tmp_path)
    return code, secret, hashlib.sha256(secret.read_bytes()).hexdigest()


@pytest.mark.parametrize("use_git", [True, False])
@pytest.mark.parametrize("field", ["code.untracked", "code.modified"])
def test_a_recorded_code_path_outside_the_code_directory_is_refused_unread(
    tmp_path: Path, field: str, use_git: bool
) -> None:
    """In a git checkout the keys went to `git hash-object` and sha256 as given: an absolute key hashed any file,
    and the refusal printed its SHA-256 (a content oracle)."""
    code, secret, digest = _checkout(tmp_path)
    for bad in (str(secret), "../secret.txt", "up/secret.txt", "sub/../../secret.txt", "a\0b"):
        known = {"code.program": ["train.py"], field: {bad: "0" * 64}}
        with pytest.raises(UnsafeInput) as info:
            code_identity(code, use_git=use_git, known=known)
        message = str(info.value)
        assert info.value.message.startswith(f"contract field {field}: "), message
        assert "\n" not in info.value.message and digest not in message, message
    # a key inside the checkout is still hashed (untracked, beside the commit)
    (code / "extra.py").write_text("X = 1\n")
    ident = code_identity(
        code, use_git=use_git, known={"code.program": ["train.py"], field: {"extra.py": "0"}}
    )
    found = {**ident["untracked"], **ident["modified"]}  # git says which of the two it is
    assert found["extra.py"] == hashlib.sha256(b"X = 1\n").hexdigest()


def _bundle_naming(packed: Packed, tmp_path: Path, path: Path, want: str | None) -> Path:
    """A copy of the packed bundle whose config.json names `path` as external file 'spy' (and whose contract
    records `want` for it, re-hashed), re-summed as a forger would."""
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    config = json.loads((bundle / "config.json").read_text())
    config["external_files"]["spy"] = str(path)
    (bundle / "config.json").write_text(json.dumps(config))
    if want is not None:
        contract = json.loads((bundle / "resume_contract.json").read_text())
        contract["fields"]["external.spy.sha256"] = want
        contract["sha256"] = contract_sha256(contract["fields"])
        (bundle / "resume_contract.json").write_text(json.dumps(contract))
    resign_sums_only(bundle)
    return bundle


@pytest.mark.launch
@pytest.mark.parametrize("want", [None, "0" * 64])
def test_prepare_never_shows_the_digest_of_an_external_file_only_the_bundle_names(
    packed: Packed, tmp_path: Path, want: str | None
) -> None:
    """config.json's `external_files` named /any/file: prepare hashed it and printed 'has SHA-256 <its digest>, the
    run was trained with None'."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not the bundle's\n")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    bundle = _bundle_naming(packed, tmp_path, secret, want)
    sets = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
    with pytest.raises(RelayError) as info:
        prepare(bundle, PrepareOptions(run_dir=tmp_path / "run", sets=sets), say=lambda s: None)
    text = str(info.value)
    assert "external file 'spy'" in text and digest not in text, text
    if want is None:
        assert "records no external.spy.sha256; nothing was read" in text, text
    assert not (tmp_path / "run").exists()
    # named here, it is the user's own file: read, and its digest shown
    with pytest.raises(RelayError) as info:
        prepare(
            bundle,
            PrepareOptions(run_dir=tmp_path / "run", sets={**sets, "external_files.spy": str(secret)}),
            say=lambda s: None,
        )
    assert f"has SHA-256 {digest}" in str(info.value)
