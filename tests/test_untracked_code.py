"""A training script git does not track is part of the run's code identity, and `pack` carries it (issue 8 defect 4).

One run is trained from a checkout whose script was never committed (the usual state of a new script): its contract
names the script by content and is dirty; `pack`, given no --code-dir, finds the code from what the run recorded and
carries the script into the bundle, where `prepare` puts it beside the commit's files and the trainer's own check
accepts it; a resume with a changed script is refused naming it. Contracts written before these fields still resume.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from helpers import EXAMPLES, REPO, git, launch, segments
from torchrelay.cli import main
from torchrelay.handoff.pack import PackOptions, pack
from torchrelay.identity import code_changes, code_identity, running_files
from torchrelay.policy.stop import write_request
from torchrelay.records.contract import comparable, contract_diff


@pytest.fixture(scope="module")
def untracked_run(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A run stopped at update 2, trained by a script git does not track."""
    base = tmp_path_factory.mktemp("untracked")
    code = base / "code"
    code.mkdir()
    (code / "README.txt").write_text("the committed part of this checkout\n")
    (code / "lm_extra.py").write_text("WIDTH = 1\n")  # a committed module the script imports
    git(code, "init", "-q", "-b", "main")
    git(code, "add", "README.txt", "lm_extra.py")
    git(code, "commit", "-q", "-m", "readme and a module")
    script = (EXAMPLES / "train_lm.py").read_text()
    anchor = "import torchrelay as tr  # noqa: E402\n"
    (code / "train_lm.py").write_text(script.replace(anchor, anchor + "import lm_extra  # noqa: E402,F401\n"))
    run = base / "run"
    run.mkdir()
    write_request(run, at_update=2)
    out = launch(code, run, config=example["config"])
    assert (run / "checkpoint-2" / "COMPLETE.json").exists(), out.stdout + out.stderr
    return {"base": base, "code": code, "run": run}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.launch
def test_an_untracked_script_is_in_the_contract(untracked_run: dict[str, Path]) -> None:
    fields = json.loads((untracked_run["run"] / "resume_contract.json").read_text())["fields"]
    script = untracked_run["code"] / "train_lm.py"
    assert fields["code.untracked"] == {"train_lm.py": _sha256(script)}
    assert fields["code.dirty"] is True and fields["code.dirty_sha256"] is None
    assert fields["code.commit"] == git(untracked_run["code"], "rev-parse", "HEAD")
    assert segments(untracked_run["run"])[-1]["code"]["untracked"] == {"train_lm.py": _sha256(script)}


@pytest.mark.launch
def test_a_changed_untracked_script_is_refused_naming_it(
    untracked_run: dict[str, Path], tmp_path: Path
) -> None:
    code = tmp_path / "code"
    shutil.copytree(untracked_run["code"], code)
    run = tmp_path / "run"
    shutil.copytree(untracked_run["run"], run)
    recorded = _sha256(code / "train_lm.py")
    with open(code / "train_lm.py", "a") as f:
        f.write("\n# a change nobody committed\n")
    out = launch(code, run)
    assert out.returncode != 0
    line = f"code.untracked[train_lm.py]: '{recorded}' -> '{_sha256(code / 'train_lm.py')}'"
    assert line in out.stderr, out.stderr[-3000:]
    assert (segments(run)[-1]["ended"], segments(run)[-1]["exit_code"]) == ("refused", 2)


@pytest.mark.launch
def test_pack_carries_the_untracked_script_without_code_dir(
    untracked_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "source"
    shutil.copytree(untracked_run["run"], source)
    bundle = tmp_path / "bundle"
    result = pack(source, bundle, PackOptions())  # no code_dir: found from the recorded script
    info = json.loads((bundle / "bundle.json").read_text())["source"]
    assert info["untracked_files"] == ["train_lm.py"] and info["untracked"].endswith(".untracked.tar.gz")
    with tarfile.open(bundle / info["untracked"]) as tar:
        member = tar.getmember(f"{info['archive_prefix']}/train_lm.py")
        data = tar.extractfile(member)
        assert data is not None and data.read() == (untracked_run["code"] / "train_lm.py").read_bytes()
    sums = (bundle / "SHA256SUMS").read_text()
    assert (
        info["untracked"] in sums
        and f"{info['archive_prefix']}/train_lm.py"
        in (bundle / "source" / "source_manifest.sha256").read_text()
    )
    assert not result.warnings, result.warnings
    assert main(["verify", str(bundle)]) == 0
    # prepare lays the script beside the commit's files; the trainer's own check accepts that tree
    prepared = tmp_path / "prepared"
    assert main(["prepare", str(bundle), "--run-dir", str(prepared)]) == 0
    out = capsys.readouterr().out
    assert "PREPARE_OK" in out, out
    tree = prepared / "source" / info["archive_prefix"]
    assert (tree / "train_lm.py").read_bytes() == (untracked_run["code"] / "train_lm.py").read_bytes()
    assert (tree / "README.txt").is_file()


@pytest.mark.launch
def test_pack_refuses_an_untracked_script_changed_since_training(
    untracked_run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = tmp_path / "code"
    shutil.copytree(untracked_run["code"], code)
    (code / "train_lm.py").write_text("print('not what ran')\n")
    source = tmp_path / "source"
    shutil.copytree(untracked_run["run"], source)
    assert main(["pack", str(source), str(tmp_path / "bundle"), "--code-dir", str(code)]) == 2
    err = capsys.readouterr().err
    assert "train_lm.py changed since the run recorded it" in err and "must carry the code that ran" in err
    assert not (tmp_path / "bundle").exists()


def test_identity_of_the_program_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported modules under the code dir count, tracked or not; a virtual environment inside it does not."""
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "model.py").write_text("WIDTH = 1\n")
    venv = code / ".venv" / "lib" / "python3" / "site-packages"
    venv.mkdir(parents=True)
    (venv / "vendored_mod_x.py").write_text("X = 1\n")
    git(code, "init", "-q", "-b", "main")
    git(code, "add", "pkg")
    git(code, "commit", "-q", "-m", "pkg")
    (code / "helper_mod_x.py").write_text("H = 1\n")  # untracked
    (code / "pkg" / "model.py").write_text("WIDTH = 2\n")  # modified
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.syspath_prepend(str(venv))
    for name in ("helper_mod_x", "pkg.model", "vendored_mod_x"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        __import__(name)
    files = running_files(code)
    assert {"helper_mod_x.py", "pkg/model.py", "pkg/__init__.py"} <= set(files)
    assert not any(".venv" in f for f in files)
    ident = code_identity(code, files=files)
    assert ident["untracked"] == {"helper_mod_x.py": _sha256(code / "helper_mod_x.py")}
    assert ident["modified"] == {"pkg/model.py": _sha256(code / "pkg" / "model.py")}
    assert ident["dirty"] is True and ident["_tracked_dirty"] is True
    # the same tree without git (a bundle's), told which files were untracked: the commit's tree, plus them
    (code / "pkg" / "model.py").write_text("WIDTH = 1\n")
    clean = code_identity(code, files=files)
    plain = code_identity(code, use_git=False, known={"code.untracked": clean["untracked"]})
    assert plain["tree"] == clean["tree"] and plain["untracked"] == clean["untracked"]
    assert not plain["modified"] and clean["modified"] == {}


def test_a_contract_written_before_the_new_fields_still_compares_equal() -> None:
    old = {"seed": 1, "code.commit": "c", "code.tree": "t", "code.dirty": False, "code.dirty_sha256": None}
    new = {**old, "code.dirty": True, "code.untracked": {"train.py": "ab"}, "code.modified": {}}
    recomputed = {"fields": new, "sha256": "x", "compat": {"code.dirty": False}}
    assert comparable(old, recomputed)["fields"] == old  # as the old run recorded it: same digest, resumes
    assert contract_diff(old, comparable(old, recomputed)["fields"]) == []
    # a new contract compares file by file, naming the file
    later = {**new, "code.untracked": {"train.py": "cd", "extra.py": "ef"}}
    assert contract_diff(new, later) == [
        ("code.untracked[extra.py]", "<absent>", "ef"),
        ("code.untracked[train.py]", "ab", "cd"),
    ]


# The code is the commit plus the program's files; any other changed file of the tree is warned about and recorded
# in the segment, not refused, unless strict_code (issue 19 defects 1 and 6).


@pytest.mark.launch
def test_in_git_an_edited_file_never_imported_warns_an_edited_module_refuses(
    untracked_run: dict[str, Path], tmp_path: Path
) -> None:
    code = tmp_path / "code"
    shutil.copytree(untracked_run["code"], code)
    run = tmp_path / "run"
    shutil.copytree(untracked_run["run"], run)
    (code / "README.txt").write_text("edited: tracked, and never imported\n")
    write_request(run, at_update=3)
    out = launch(code, run)
    assert segments(run)[-1]["ended"] == "request", out.stderr[-3000:]  # stopped as asked, at 3
    assert (run / "checkpoint-3" / "COMPLETE.json").is_file()
    assert "README.txt (changed); recorded, not refused" in out.stderr, out.stderr[-3000:]
    assert any("README.txt (changed)" in note for note in segments(run)[-1]["notes"])
    (code / "lm_extra.py").write_text("WIDTH = 2\n")
    out = launch(code, run)
    assert out.returncode != 0, out.stderr[-3000:]
    assert f"code.modified[lm_extra.py]: '<absent>' -> '{_sha256(code / 'lm_extra.py')}'" in out.stderr
    assert "README.txt" not in out.stderr.split("code.modified[lm_extra.py]")[0].splitlines()[-1]
    fields = json.loads((run / "resume_contract.json").read_text())["fields"]
    assert fields["code.program"] == ["lm_extra.py", "train_lm.py"] and fields["code.changed"] == {}


@pytest.mark.launch
def test_outside_git_a_file_beside_the_script_warns_and_strict_code_refuses_it(
    example: dict[str, Path], tmp_path: Path
) -> None:
    code = tmp_path / "plain"  # no git anywhere above a pytest tmp dir
    code.mkdir()
    shutil.copyfile(EXAMPLES / "train_lm.py", code / "train_lm.py")
    run = tmp_path / "run"
    run.mkdir()
    write_request(run, at_update=2)
    out = launch(code, run, nproc=1, config=example["config"])
    assert (run / "checkpoint-2" / "COMPLETE.json").is_file(), out.stderr[-3000:]
    (code / "NOTES.txt").write_text("what I tried today\n")
    out = launch(code, run, nproc=1, sets={"strict_code": True})
    assert out.returncode != 0, out.stderr[-3000:]
    assert f"code.changed[NOTES.txt]: '<absent>' -> '{_sha256(code / 'NOTES.txt')}'" in out.stderr
    write_request(run, at_update=3)
    out = launch(code, run, nproc=1)
    assert segments(run)[-1]["ended"] == "request", out.stderr[-3000:]
    assert (run / "checkpoint-3" / "COMPLETE.json").is_file()
    assert "NOTES.txt (new); recorded, not refused" in out.stderr
    assert any("NOTES.txt (new)" in note for note in segments(run)[-1]["notes"])
    fields = json.loads((run / "resume_contract.json").read_text())["fields"]
    assert fields["code.commit"] is None and fields["code.program"] == ["train_lm.py"]
    assert fields["code.untracked"] == {"train_lm.py": _sha256(code / "train_lm.py")}


@pytest.mark.launch
def test_a_bundle_of_this_repository_verifies_prepares_and_continues(
    example: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh clone of this repository tracks two run directories (tests/fixtures/legacy-v0.1.0/): the packed
    source hashes as git does, so prepare proves it and the trainer continues from the extracted tree."""
    clone = tmp_path / "torchrelay"
    git(tmp_path, "clone", "-q", str(REPO), str(clone))
    assert (clone / "tests" / "fixtures" / "legacy-v0.1.0" / "run" / "resume_contract.json").is_file()
    run = tmp_path / "run"
    run.mkdir()
    write_request(run, at_update=2)
    script = "examples/train_lm.py"
    out = launch(clone, run, nproc=1, config=example["config"], script=script)
    assert (run / "checkpoint-2" / "COMPLETE.json").is_file(), out.stderr[-3000:]
    bundle = tmp_path / "bundle"
    assert main(["pack", str(run), str(bundle)]) == 0  # the code dir: the recorded script's git top level
    assert main(["verify", str(bundle)]) == 0
    prepared = tmp_path / "prepared"
    capsys.readouterr()
    assert main(["prepare", str(bundle), "--run-dir", str(prepared)]) == 0
    said = capsys.readouterr().out
    assert "PREFLIGHT: PASS" in said and said.strip().splitlines()[-1] == "PREPARE_OK", said
    tree = prepared / "source" / json.loads((bundle / "bundle.json").read_text())["source"]["archive_prefix"]
    write_request(prepared, at_update=3)
    out = launch(tree, prepared, nproc=1, script=script)
    assert segments(prepared)[-1]["ended"] == "request", out.stderr[-3000:]
    assert (prepared / "checkpoint-3" / "COMPLETE.json").is_file()
    assert "recorded, not refused" not in out.stderr  # the extracted tree is the commit's, exactly


def test_a_tree_without_git_hashes_as_git_does_tracked_run_directories_included(tmp_path: Path) -> None:
    code = tmp_path / "repo"
    (code / "fixtures" / "run").mkdir(parents=True)
    (code / "fixtures" / "run" / "resume_contract.json").write_text("{}\n")  # a small run the repo tracks
    (code / "train.py").write_text("print('hi')\n")
    git(code, "init", "-q", "-b", "main")
    git(code, "add", "-A")
    git(code, "commit", "-q", "-m", "with a tracked run directory")
    extracted = tmp_path / "extracted"
    extracted.mkdir()
    archive = subprocess.run(["git", "-C", str(code), "archive", "HEAD"], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(extracted, filter="data")
    recorded = {
        "code.commit": git(code, "rev-parse", "HEAD"),
        "code.tree": git(code, "rev-parse", "HEAD^{tree}"),
    }
    plain = code_identity(extracted, use_git=False, known={**recorded, "code.program": ["train.py"]})
    assert plain["tree"] == recorded["code.tree"] and plain["changed"] == {}


def test_the_rule_compares_file_by_file() -> None:
    """In-process, the rule's corner cases: a file that becomes a module keeps its content; a legacy contract
    refuses any change of its tree; strict refuses what is otherwise a warning."""
    base = {"code.commit": None, "code.tree": "t1", "code.dirty": True, "code.dirty_sha256": None}
    old = {**base, "code.program": ["a.py"], "code.untracked": {"a.py": "1"}, "code.modified": {}}
    old["code.changed"] = {"b.py": "2", "NOTES.txt": "3"}
    now = {
        **old,
        "code.tree": "t2",
        "code.program": ["a.py", "b.py"],
        "code.untracked": {"a.py": "1", "b.py": "2"},
    }
    now["code.changed"] = {"NOTES.txt": "4"}
    refused, other = code_changes(old, now)
    assert refused == [] and other == [("code.changed[NOTES.txt]", "3", "4"), ("code.tree", "t1", "t2")]
    assert code_changes(old, now, strict=True) == (other, [])
    now["code.untracked"] = {"a.py": "1", "b.py": "5"}
    assert code_changes(old, now)[0] == [("code.untracked[b.py]", "2", "5")]
    legacy = {k: v for k, v in old.items() if k not in ("code.program", "code.changed")}
    assert code_changes(legacy, {**legacy, "code.tree": "t2"})[0] == [("code.tree", "t1", "t2")]
    git_old = {**old, "code.commit": "c1", "code.tree": "t1"}
    assert code_changes(git_old, {**git_old, "code.commit": "c2"})[0] == [("code.commit", "c1", "c2")]
