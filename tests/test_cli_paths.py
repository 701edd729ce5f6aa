"""Every verb, given any wrong path (a file, nothing, a symlink loop, a directory of garbage), answers one
message and exit 2: no traceback, no NotADirectoryError (issue 9, defect 7)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from helpers import REPO
from torchrelay.cli import main

GARBAGE = bytes(range(0x80, 0x100)) * 3  # not UTF-8 from its first byte, not JSON, not a pickle


def _paths(base: Path) -> dict[str, Path]:
    afile = base / "afile"
    afile.write_bytes(GARBAGE)
    loop = base / "loop"
    os.symlink(loop, loop)  # ELOOP on any access: what an unreadable path looks like even to root
    junk = base / "junk"
    for rel in (
        "config.json",
        "resume_contract.json",
        "history.jsonl",
        "SHA256SUMS",
        "bundle.json",
        "data/manifest.jsonl",
        "train/metrics-rank0.jsonl",
        "train/exposures-rank0.jsonl",
        "checkpoint-3/COMPLETE.json",
    ):
        (junk / rel).parent.mkdir(parents=True, exist_ok=True)
        (junk / rel).write_bytes(GARBAGE)
    return {"file": afile, "missing": base / "missing", "loop": loop, "garbage": junk}


VERBS = [
    ["status", "{p}"],
    ["status", "--json", "{p}"],
    ["status", "--last-exit", "{p}"],
    ["stop", "{p}"],
    ["stop", "--before-start", "{p}"],
    ["ledger", "{p}"],
    ["ledger", "--json", "{p}"],
    ["report", "{p}"],
    ["pack", "{p}", "{tmp}/bundle"],
    ["verify", "{p}"],
    ["prepare", "{p}", "--run-dir", "{tmp}/prepared"],
    ["diff", "{p}", "{p}"],
    ["launch", "{p}"],
    ["sbatch", "{p}"],
    ["audit", "--work-dir", "{p}", "--", "python", "{tmp}/never-started.py"],
    ["certify", "{p}", "--", "python", "{tmp}/never-started.py"],
    ["validate", "{p}", "--cmd", "true"],
    ["export", "{p}", "{tmp}/exported"],
]


@pytest.mark.parametrize("kind", ["file", "missing", "loop", "garbage"])
@pytest.mark.parametrize("argv", VERBS, ids=lambda a: " ".join(x for x in a if "{" not in x))
def test_every_verb_refuses_a_wrong_path_in_one_message(
    argv: list[str], kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _paths(tmp_path)[kind]
    if argv[:2] == ["stop", "--before-start"] and kind == "missing":
        pytest.skip("a new directory is exactly what --before-start is for")
    if argv[0] == "audit" and kind == "missing":
        pytest.skip("the audit creates its work directory")
    args = [a.format(p=path, tmp=tmp_path) for a in argv]
    code = main(args)
    out = capsys.readouterr()
    assert code == 2, (code, out.out[-2000:], out.err[-2000:])
    assert "Traceback" not in out.err + out.out
    message = [line for line in out.err.splitlines() if line.strip()]
    assert message and message[0].startswith(f"torchrelay {argv[0]}: error: "), out.err
    # one message: its line, and at most a hint (a refusal may list fields, never a stack)
    assert len(message) <= 2 or all(not line.startswith("  File ") for line in message), out.err
    assert not any((tmp_path / name).exists() for name in ("bundle", "prepared", "exported"))


def test_version_and_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`--version` names the package's version; the library's information reaches stdout unless `-q` (its
    warnings and errors stay); `-v` shows it too; each record names its rank."""
    from torchrelay import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"torchrelay {__version__}\n"

    bundle = (
        tmp_path / "bundle"
    )  # a bundle whose one listed file is missing: prepare says it verifies, then fails
    bundle.mkdir()
    (bundle / "SHA256SUMS").write_text(f"{'0' * 64}  config.json\n")
    said = "verifying the bundle against SHA256SUMS"
    codes = {}
    for flags in ([], ["-v"], ["-q"]):
        codes[tuple(flags)] = main([*flags, "prepare", str(bundle), "--run-dir", str(tmp_path / "run")])
        out, err = capsys.readouterr()
        assert (said in out) == (flags != ["-q"]), (flags, out)
        assert "config.json" in out + err, (flags, out, err)  # the failure itself is never silenced
    assert len(set(codes.values())) == 1 and codes[()] != 0
    said_records = [r for r in caplog.records if r.name == "torchrelay" and r.getMessage() == said]
    assert len(said_records) == 2 and all(getattr(r, "rank", None) == 0 for r in said_records)


def test_report_refuses_a_report_folder_that_is_a_file_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report RUN_DIR` with a file where RUN_DIR/report (its folder) belongs: a wrong path, exit 2 as every
    other verb's (it was a ReportError, exit 1)."""
    run = tmp_path / "run"
    shutil.copytree(REPO / "tests" / "fixtures" / "legacy-v0.1.0" / "run", run, symlinks=True)
    (run / "report").write_bytes(GARBAGE)
    code = main(["report", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, (code, err)
    assert err.startswith(f"torchrelay report: error: {run / 'report'}: cannot create"), err
    assert (run / "report").read_bytes() == GARBAGE


def test_a_link_that_loops_on_the_way_is_said_to_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory that is a link to itself: every open inside it fails with ELOOP, which the opener called
    `RUN/config.json ... is a symbolic link; refusing to follow it` (it is not: the folder loops)."""
    loop = _paths(tmp_path)["loop"]
    for argv in (["status", str(loop)], ["ledger", str(loop)], ["verify", str(loop)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "a symbolic link on the way to it loops" in err and "refusing to follow" not in err, err


def test_an_error_naming_a_path_with_control_characters_shows_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal names the path or value it refuses, which a run's files or a caller's argument may fill with an
    ESC: the one-line error shows it as `\\x1b`, never sends it to the terminal (the hint stays its own line)."""
    for verb in ("status", "ledger", "verify"):
        rc = main([verb, str(tmp_path / "run\x1b]0;pwned\x07\x1b[2J")])
        err = capsys.readouterr().err
        assert rc == 2, (verb, err)
        assert "\x1b" not in err and "\x07" not in err, (verb, err)
        assert "run\\x1b]0;pwned\\x07\\x1b[2J" in err, (verb, err)


def test_a_newline_in_a_path_argument_is_shown_escaped_on_the_one_error_line(tmp_path, capsys):
    from torchrelay.cli import main

    code = main(["export", str(tmp_path / "x\ny"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    first, *rest = err.rstrip("\n").split("\n")
    assert "x\\ny" in first and first.startswith("torchrelay export: error:")
    assert all(line.startswith("  hint:") for line in rest)
