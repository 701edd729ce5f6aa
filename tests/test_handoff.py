"""Handoff end to end: train -> stop -> pack -> verify -> move everything -> prepare -> continue == uninterrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from handoff_fixtures import STOP_AT, TOTAL, Packed
from helpers import assert_same_final_state, assert_same_logs, launch, segments
from torchrelay.checkpoint.commit import clean_stale
from torchrelay.checkpoint.handed_off import read_marker
from torchrelay.checkpoint.resume_check import validate_resume
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.cli import main
from torchrelay.config.relay import stored_config
from torchrelay.errors import ConfigError, ForkRefused, RelayError
from torchrelay.handoff.diff import diff
from torchrelay.handoff.pack import PackOptions, pack
from torchrelay.handoff.prepare import PrepareOptions, PrepareRefused, prepare
from torchrelay.handoff.verify import verify_bundle
from torchrelay.ledger.exposure import prove
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import write_request
from torchrelay.util import kill_points

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch


def test_bundle_contents_and_readme(packed: Packed) -> None:
    b = packed.bundle
    for rel in (
        f"checkpoint-{STOP_AT}/COMPLETE.json",
        "resume_contract.json",
        "config.json",
        "data/manifest.jsonl",
        "data/manifest_info.json",
        "data/training_progress.json",
        "history.jsonl",
        "README.md",
        "SHA256SUMS",
        "source/source_manifest.sha256",
        "train/exposures-rank0.jsonl",
        "train/metrics-rank1.jsonl",
    ):
        assert (b / rel).is_file(), rel
    assert not (b / f"checkpoint-{STOP_AT}" / "HANDED_OFF.json").exists()
    assert list((b / "source").glob("code-*.tar.gz")) and list((b / "source").glob("main.bundle"))
    # logs trimmed to the checkpoint
    last = [json.loads(x)["update"] for x in (b / "train/metrics-rank0.jsonl").read_text().splitlines()]
    assert max(last) == STOP_AT
    readme = (b / "README.md").read_text()
    for needle in (
        "Invariants: do not change",
        "sha256sum -c",
        "torchrelay prepare",
        f"update {STOP_AT}",
        "History",
    ):
        assert needle in readme, needle
    # SHA256SUMS is what coreutils reads
    out = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=b, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # the git bundle holds the recorded commit
    info = json.loads((b / "bundle.json").read_text())
    clone = packed.base / "clone"
    subprocess.run(
        ["git", "clone", "-q", "-b", "main", str(b / "source/main.bundle"), str(clone)], check=True
    )
    assert (
        info["source"]["commit"]
        in subprocess.run(
            ["git", "-C", str(clone), "log", "--format=%H"], capture_output=True, text=True, check=True
        ).stdout
    )


def test_verify_cli_passes(packed: Packed, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(packed.bundle), "--jobs", "2"]) == 0
    assert "VERIFY_OK" in capsys.readouterr().out


def test_fork_guard_refuses_source_and_second_pack(packed: Packed, tmp_path: Path) -> None:
    marker = json.loads((packed.source / f"checkpoint-{STOP_AT}" / "HANDED_OFF.json").read_text())
    assert marker["lineage"] == packed.lineage
    out = launch(packed.code, packed.source)
    assert out.returncode != 0
    assert "handed off" in out.stdout + out.stderr and "TORCHRELAY_RECLAIM" in out.stdout + out.stderr
    refused = segments(packed.source)[-1]  # the refusal is on record (issue 8 defect 5)
    assert (refused["ended"], refused["exit_code"]) == ("refused", 2) and "handed off" in refused["notes"][-1]
    with pytest.raises(ForkRefused, match="already handed off"):
        pack(packed.source, tmp_path / "again", PackOptions(code_dir=packed.code))
    # reclaiming is explicit, and then the trainer's validation lets it through
    cfg = stored_config(RunDir(packed.source))
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHRELAY_RECLAIM", "1")
    try:
        check = validate_resume(packed.source, cfg, 2, packed.code)
    finally:
        mp.undo()
    assert check.update == STOP_AT


def test_end_to_end_elsewhere_bit_for_bit(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the bundle is downloaded elsewhere, the data lives under another root, the teacher at another path
    bundle = tmp_path / "download" / "bundle"
    shutil.copytree(packed.bundle, bundle)
    assert main(["verify", str(bundle)]) == 0
    new_root = tmp_path / "cluster2" / "data-root"
    shutil.copytree(packed.root, new_root)
    teacher = tmp_path / "cluster2" / "models" / "teacher.bin"
    teacher.parent.mkdir(parents=True)
    shutil.copyfile(packed.teacher, teacher)
    run_dir = tmp_path / "cluster2" / "run"
    argv = [
        "prepare",
        str(bundle),
        "--run-dir",
        str(run_dir),
        "--set",
        f"data_root={new_root}",
        "--set",
        f"external_files.teacher={teacher}",
        "--set",
        "num_workers=2",
        "--check-files",
    ]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PREFLIGHT: PASS" in out and out.strip().splitlines()[-1] == "PREPARE_OK", out
    assert "fingerprint unchanged" in out
    record = json.loads((run_dir / "REBASE_RECORD.json").read_text())
    assert set(record["changes"]) == {"data_root", "external_files.teacher", "num_workers"}
    assert record["changes"]["num_workers"] == [0, 2]
    assert (run_dir / "config.json.orig").is_file() and (run_dir / "data/manifest.jsonl.orig").is_file()
    assert str(new_root) in (run_dir / "data/manifest.jsonl").read_text()
    # running it twice is harmless
    assert main(argv) == 0
    assert "already prepared" in capsys.readouterr().out

    # the old cluster's data and teacher are gone from view while the continuation runs
    hidden_root, hidden_teacher = packed.root.with_name("root-hidden"), packed.teacher.with_name("hidden.bin")
    packed.root.rename(hidden_root)
    packed.teacher.rename(hidden_teacher)
    try:
        code = next((run_dir / "source").iterdir())
        # The script passes the config it was written with (the old cluster's paths): prepare's fields win.
        result = launch(code, run_dir, config=packed.config)
    finally:
        hidden_root.rename(packed.root)
        hidden_teacher.rename(packed.teacher)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SCHEDULE_GATE_PASS ({TOTAL}, 2)" in result.stdout
    assert f"warning: kept data_root={str(new_root)!r} set by prepare" in result.stderr
    # One contract digest everywhere: prepare's proof, the training's line, the record and the bundle.
    digest = json.loads((packed.bundle / "resume_contract.json").read_text())["sha256"]
    assert f"contract {digest} matches" in out
    assert {line.split()[-1] for line in result.stdout.splitlines() if "TRAINING_CONTRACT" in line} == {
        digest
    }
    assert (
        record["contract_sha256"]
        == digest
        == json.loads((bundle / "bundle.json").read_text())["contract_sha256"]
    )

    assert assert_same_final_state(packed.baseline, run_dir, TOTAL) > 10
    assert_same_logs(packed.baseline, run_dir)
    ledger = prove(run_dir)
    assert ledger.ok and ledger.exposures == ledger.distinct == TOTAL * 16
    seg = segments(run_dir)[-1]
    assert seg["lineage"] == packed.lineage
    assert seg["parent_lineage"] == json.loads((packed.source / "lineage.json").read_text())["lineage"]
    assert seg["runtime_changes"] == {} and seg["resumed_from"] == STOP_AT
    kept = [n for n in seg["notes"] if n.startswith("kept ")]
    assert [n.split("=")[0] for n in kept] == [
        "kept data_root",
        "kept external_files.teacher",
        "kept num_workers",
    ]
    assert json.loads((run_dir / "config.json").read_text())["data_root"] == str(new_root)
    # diff: same contract, runtime fields marked
    report = diff(packed.bundle, run_dir)
    assert report.same_contract
    assert {d.key for d in report.runtime} >= {"data_root", "num_workers", "external_files.teacher"}


def _prepare(packed: Packed, run_dir: Path, **sets: object) -> None:
    base = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
    prepare(
        packed.bundle,
        PrepareOptions(run_dir=run_dir, sets={**base, **sets}, check_files=True),
        say=lambda s: None,
    )


def test_set_of_a_contract_field_is_refused(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["prepare", str(packed.bundle), "--run-dir", str(tmp_path / "r"), "--set", "seed=7"])
    err = capsys.readouterr().err
    assert code == 2 and "seed" in err and "allowed keys: data_root" in err and "num_workers" in err
    with pytest.raises(ConfigError, match="params.lr"):
        _prepare(packed, tmp_path / "r", **{"params.lr": 0.1})
    assert not (tmp_path / "r").exists()


def test_missing_data_file_with_check_files(packed: Packed, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(packed.root, root)
    victim = sorted(root.iterdir())[0]
    victim.unlink()
    with pytest.raises(PrepareRefused) as info:
        _prepare(packed, tmp_path / "r", data_root=str(root))
    text = str(info.value)
    n = len((packed.bundle / "data/manifest.jsonl").read_text().splitlines())
    assert "manifest files missing" in text and f"of {n}" in text and victim.name in text
    assert not (tmp_path / "r").exists() and not list(tmp_path.glob(".r.prepare-tmp-*"))


def test_teacher_with_wrong_hash_is_refused(packed: Packed, tmp_path: Path) -> None:
    wrong = tmp_path / "teacher.bin"
    data = bytearray(packed.teacher.read_bytes())
    data[-1] ^= 0xFF  # always another byte (setting it to 0 was a no-op for 1 teacher in 256)
    wrong.write_bytes(bytes(data))
    with pytest.raises(PrepareRefused, match="external file 'teacher'.*SHA-256"):
        _prepare(packed, tmp_path / "r", **{"external_files.teacher": str(wrong)})
    assert not (tmp_path / "r").exists()


def test_nonempty_unrelated_run_dir_is_refused(packed: Packed, tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty"):
        _prepare(packed, run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_hardlink_prepare_shares_checkpoint_files(packed: Packed, tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    shutil.copytree(packed.bundle, bundle)
    run_dir = tmp_path / "r"
    base = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
    prepare(bundle, PrepareOptions(run_dir=run_dir, sets=base, copy_mode="hardlink"), say=lambda s: None)
    shard = next((run_dir / f"checkpoint-{STOP_AT}" / "model").glob("*.distcp"))
    assert shard.stat().st_nlink == 2
    assert (run_dir / "train/metrics-rank0.jsonl").stat().st_nlink == 1  # appended to later: never linked
    assert verify_bundle(bundle).ok


def test_diff_names_contract_fields(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrelay.records.contract import contract_sha256

    other = tmp_path / "other"
    shutil.copytree(packed.bundle, other)
    contract = json.loads((other / "resume_contract.json").read_text())
    contract["fields"]["seed"] = 99
    contract["sha256"] = contract_sha256(contract["fields"])
    (other / "resume_contract.json").write_text(json.dumps(contract))
    assert main(["diff", str(packed.source / f"checkpoint-{STOP_AT}"), str(other)]) == 1
    out = capsys.readouterr().out
    assert "seed: 1234 -> 99" in out and "one cannot continue the other" in out
    assert main(["diff", str(packed.source), str(packed.bundle)]) == 0


def test_pack_refuses_a_dirty_tree_and_a_second_handoff(
    packed: Packed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrelay.handoff.source import write_source

    dirty = {"commit": "0" * 40, "tree": "1" * 40, "dirty": True, "dirty_sha256": "2" * 64}
    with pytest.raises(ConfigError, match="uncommitted changes"):
        write_source(dirty, packed.code, tmp_path / "src", allow_dirty=False)
    info = write_source({**dirty, "tree": None}, packed.code, tmp_path / "src2", allow_dirty=True)
    assert any("uncommitted" in w for w in info.warnings)
    code = main(["pack", str(packed.source), str(tmp_path / "b2"), "--code-dir", str(packed.code)])
    assert code == 2 and "already handed off" in capsys.readouterr().err
    assert not (tmp_path / "b2").exists()


def test_reclaiming_the_source_starts_a_new_lineage_on_record(packed: Packed, tmp_path: Path) -> None:
    """TORCHRELAY_RECLAIM=1 continues the handed-off source on purpose; status then shows two lineages."""
    source = tmp_path / "source"
    shutil.copytree(packed.source, source)
    before = json.loads((source / "lineage.json").read_text())
    # keep_updates holds the reclaimed checkpoint past retention, so that its record can be checked
    out = launch(packed.code, source, sets={"keep_updates": [STOP_AT]}, env={"TORCHRELAY_RECLAIM": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = source / f"checkpoint-{STOP_AT}"
    assert not (ckpt / "HANDED_OFF.json").exists()
    assert len(list(ckpt.glob("HANDED_OFF.reclaimed-*.json"))) == 1
    after = json.loads((source / "lineage.json").read_text())
    assert after["parent_lineage"] == before["lineage"] and after["lineage"] != before["lineage"]
    seg = segments(source)[-1]
    assert seg["lineage"] == after["lineage"] and seg["command"][-4:-2] == ["--run-dir", str(source)]
    assert any(f"reclaimed checkpoint-{STOP_AT}" in note for note in seg["notes"])
    from torchrelay.records.summary import summarize

    assert len(summarize(source)["lineages"]) == 2
    assert_same_final_state(packed.baseline, source, TOTAL)
    # the reclaimed checkpoint packed again verifies: its old record is a file beside the inventory for verify
    # as it is for the trainer (both ask checkpoint/inventory.py; they once disagreed and verify failed here)
    again = pack(source, tmp_path / "again", PackOptions(code_dir=packed.code, checkpoint=STOP_AT)).bundle
    assert len(list((again / f"checkpoint-{STOP_AT}").glob("HANDED_OFF.reclaimed-*.json"))) == 1
    report = verify_bundle(again)
    assert report.ok, report.problems()


# --- kills at every step of pack and prepare ------------------------------------------------------------------

PACK_STEPS = ("pack:written", "pack:renamed", "pack:marking", "pack:marked", "pack:summed", "pack:finishing")


def _killed_at(step: str, work: Callable[[], object]) -> None:
    """Run `work` in a forked child that SIGKILLs itself at `step` (kill_points.arm): a real kill, cheap."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 3
        try:
            kill_points.arm(step)
            work()
        except BaseException:  # noqa: BLE001 - any way out but the kill is reported by the exit code
            code = 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"{step}: not killed there ({status})"
    )


def _usable(bundle: Path) -> bool:
    try:
        return verify_bundle(bundle).ok
    except RelayError:
        return False


def _leftovers(*dirs: Path) -> list[str]:
    return [
        str(p)
        for d in dirs
        for p in d.rglob("*")
        if ".pack-tmp-" in p.name or ".HANDED_OFF.json.tmp" in p.name
    ]


def test_a_pack_killed_at_any_step_leaves_no_usable_bundle_without_its_record(
    packed: Packed, tmp_path: Path
) -> None:
    """Defect: killed after the bundle's rename, before HANDED_OFF.json, a pack left a usable bundle and no fork
    guard (a second pack made a second lineage); killed inside the record's write, it wedged the trainer."""
    name = f"checkpoint-{STOP_AT}"
    cfg = stored_config(RunDir(packed.source))
    for step in PACK_STEPS:
        source = tmp_path / step.replace(":", "-") / "source"
        shutil.copytree(packed.source, source)
        (source / name / "HANDED_OFF.json").unlink()  # a stopped run never packed
        bundle = source.parent / "bundle"
        _killed_at(step, lambda s=source, b=bundle: pack(s, b, PackOptions(code_dir=packed.code)))  # type: ignore[misc]

        usable, record = _usable(bundle), read_marker(source / name)
        assert usable == (step in ("pack:summed", "pack:finishing")), step
        if usable:  # the invariant: a bundle that verifies is always recorded as handed off
            assert (
                record is not None
                and record["lineage"] == json.loads((bundle / "bundle.json").read_text())["lineage"]
            )
        assert (record is not None) == (step in ("pack:marked", "pack:summed", "pack:finishing")), step
        if step == "pack:marking":
            # the trainer itself continues the healthy checkpoint past a half-written record (was: refused)
            trainer = source.parent / "trainer"
            shutil.copytree(source, trainer)
            assert list(trainer.glob(f"{name}/.HANDED_OFF.json.tmp-*"))
            write_request(trainer, at_update=STOP_AT + 1)
            out = launch(packed.code, trainer)
            seg = segments(trainer)[-1]
            assert (seg["resumed_from"], seg["ended"]) == (STOP_AT, "request"), out.stdout + out.stderr
        # status and the trainer's own validation agree on the checkpoint
        clean_stale(source)  # what Run.open does first
        assert [c.handed_off for c in list_checkpoints(source) if c.update == STOP_AT] == [record is not None]
        if record is None:
            assert validate_resume(source, cfg, 2, packed.code).update == STOP_AT
        else:
            with pytest.raises(
                ForkRefused, match="interrupted" if record["state"] == "packing" else "handed off"
            ):
                validate_resume(source, cfg, 2, packed.code)

        # the next pack cleans up after the killed one: one usable bundle, one lineage, on record
        if usable:
            with pytest.raises(ForkRefused, match="already handed off"):
                pack(source, source.parent / "again", PackOptions(code_dir=packed.code))
            lineage = json.loads((bundle / "bundle.json").read_text())["lineage"]
        else:
            lineage = pack(source, bundle, PackOptions(code_dir=packed.code)).lineage
            assert _usable(bundle), step
        final = read_marker(source / name)
        assert final is not None and (final["lineage"], final["state"]) == (lineage, "handed-off"), step
        assert not (source.parent / "again").exists() and not _leftovers(source, source.parent), step


def test_a_prepare_killed_at_any_step_leaves_nothing_or_a_prepared_run(
    packed: Packed, tmp_path: Path
) -> None:
    base = {"data_root": str(packed.root), "external_files.teacher": str(packed.teacher)}
    for step in ("prepare:assembled", "prepare:renamed"):
        run_dir = tmp_path / step.replace(":", "-") / "run"
        run_dir.mkdir(parents=True)  # an empty run dir, as a user makes one
        options = PrepareOptions(run_dir=run_dir, sets=base)
        _killed_at(step, lambda o=options: prepare(packed.bundle, o, say=lambda s: None))  # type: ignore[misc]
        if step == "prepare:assembled":
            assert not run_dir.exists() or not any(run_dir.iterdir())
        else:
            assert (run_dir / "REBASE_RECORD.json").is_file()
        again = prepare(packed.bundle, options, say=lambda s: None)
        assert again.already_prepared == (step == "prepare:renamed")
        assert not list(run_dir.parent.glob(".run.prepare-tmp-*"))
        assert any("SCHEDULE_GATE_PASS" in line for line in again.passed)  # the trainer's validation passed
