"""The run's contract binds its manifest's content, whatever its saved index says, and the data root stays a runtime
field on every path that moves it: a relaunch's override, `prepare`, a kill between the two writes of a move.

In-process runs (one process, no process group) of a few updates, made with the library as a script makes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import make_code_repo, make_data
from test_hostile_records import _cli
from torchrelay import RelayConfig, Run
from torchrelay.errors import EXIT_REFUSED, ConfigError, ContractMismatch
from torchrelay.handoff.pack import PackOptions, pack
from torchrelay.handoff.prepare import PrepareOptions, prepare
from torchrelay.ledger.exposure import prove
from torchrelay.manifest import Manifest, index_path
from torchrelay.policy.stop import write_request
from torchrelay.records.contract import contract_sha256
from torchrelay.records.history import read_history

BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("binding")
    code = make_code_repo(base / "code")
    root, manifest = make_data(base / "data")
    marked = base / "data" / "marked.jsonl"  # the same manifest as a Windows tool exports it
    marked.write_bytes(BOM + manifest.read_bytes())
    return {"base": base, "code": code, "root": root, "manifest": manifest, "marked": marked}


def _config(data: dict[str, Path], manifest: str = "manifest", **changes: Any) -> RelayConfig:
    fields: dict[str, Any] = {
        "seed": 3,
        "micro_batch": 2,
        "total_updates": 6,
        "manifest": str(data[manifest]),
        "data_root": str(data["root"]),
        "save_every": 3,
        **changes,
    }
    return RelayConfig(**fields)


def _train(run_dir: Path, cfg: RelayConfig | None, code: Path, **open_kw: Any) -> tuple[int, list[str]]:
    """A launch of a small script, in this process: (exit code, the first sample's path in each update)."""
    seen: list[str] = []
    with Run.open(run_dir, cfg, code_dir=code, **open_kw) as run:
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        records = run.manifest.records
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, batch in step.micro_batches():
                seen.append(records[int(batch[0])]["path"])
                model(torch.randn(2, 8) + float(sum(batch))).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return run.exit_code, seen


def _stopped(data: dict[str, Path], run_dir: Path, manifest: str = "manifest") -> Path:
    run_dir.mkdir(parents=True)
    write_request(run_dir, at_update=3)
    code, _ = _train(run_dir, _config(data, manifest), data["code"])
    assert code == 4 and (run_dir / "checkpoint-3" / "COMPLETE.json").exists()
    return run_dir


def _contract(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "resume_contract.json").read_text())


def _replace_manifest_and_index(run_dir: Path, data_root: str) -> None:
    """What silently changed the training data: other samples in the run's copy (two swapped, one renamed) and
    an index written for them that still says the fingerprint the run was created with (its meta is the
    replaced file's SHA-256 and size, every entry a whole line of it: nothing a reader of the index checks)."""
    copy = run_dir / "data" / "manifest.jsonl"
    recorded = _contract(run_dir)["fields"]["data.fingerprint"]
    recs = [json.loads(line) for line in copy.read_text(encoding="utf-8-sig").splitlines()]
    recs[0]["id"], recs[0], recs[1] = "planted", recs[1], recs[0]
    copy.write_text("".join(json.dumps(r) + "\n" for r in recs))
    forged = Manifest.load(copy, data_root)
    forged._fingerprint = recorded
    forged.save_index(index_path(copy))
    believed = Manifest.load(copy, data_root, index=index_path(copy))  # by a reader of the index alone
    assert believed.indexed and believed.fingerprint() == recorded


def _refused_naming_the_manifest(run_dir: Path, cfg: RelayConfig | None, code: Path) -> None:
    with pytest.raises(ContractMismatch) as info:
        _train(run_dir, cfg, code)
    assert info.value.exit_code == EXIT_REFUSED
    text = str(info.value)
    assert "data.fingerprint: 'fingerprint_v1:" in text, text
    assert (
        f"({run_dir / 'data' / 'manifest.jsonl'} lists other samples than the manifest this run was" in text
    )


def test_a_replaced_manifest_whose_index_was_rewritten_to_match_is_refused_at_resume(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """Before: the resume read the fingerprint from the index, whose only tie to the bytes is its own meta:
    it trained on the replaced samples (TRAINING_CONTRACT unchanged, `ledger` OK, `diff` identical). Now the
    contract records the manifest's SHA-256 at creation (data.sha256): the index is believed for those bytes
    only, any others are read line by line, and the fingerprint compared is theirs."""
    run = _stopped(data, tmp_path / "run")
    _replace_manifest_and_index(run, str(data["root"]))
    # `ledger` said OK: its exposures name manifest lines, and these are others
    code, _, err = _cli(["ledger", str(run)])
    assert code == EXIT_REFUSED and f"{run / 'data' / 'manifest.jsonl'}: lists other samples than" in err, err
    # `pack` wrote a bundle of it, that prepare refused later: now it refuses, and hands nothing off
    code, _, err = _cli(["pack", str(run), str(tmp_path / "bundle"), "--code-dir", str(data["code"])])
    assert code == EXIT_REFUSED and "lists other samples than" in err, err
    assert not (tmp_path / "bundle").exists() and not list(run.glob("checkpoint-*/HANDED_OFF.json"))
    _refused_naming_the_manifest(run, _config(data), data["code"])
    _refused_naming_the_manifest(run, None, data["code"])  # the stored configuration: the same
    assert not (run / "checkpoint-6").exists()
    fields = _contract(run)["fields"]
    assert fields["data.sha256"] == Manifest.load(data["manifest"], str(data["root"])).sha256()


def test_a_run_made_before_data_sha256_still_resumes_and_reads_its_manifest(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """A contract written by the previous version has no data.sha256 ("not recorded"): its run resumes, its
    contract digest unchanged, and no index is believed for its fingerprint, so the same forgery is refused."""
    old = _stopped(data, tmp_path / "old")
    doc = _contract(old)
    doc["fields"].pop("data.sha256", None)
    doc["sha256"] = contract_sha256(doc["fields"])
    (old / "resume_contract.json").write_text(json.dumps(doc, sort_keys=True))
    forged = tmp_path / "forged"
    shutil.copytree(old, forged)
    assert _train(old, _config(data), data["code"])[0] == 0
    assert _contract(old) == doc and read_history(old)[-1]["contract_sha256"] == doc["sha256"]
    _replace_manifest_and_index(forged, str(data["root"]))
    _refused_naming_the_manifest(forged, _config(data), data["code"])


def test_a_relaunch_may_set_data_root_and_the_copy_follows_it(data: dict[str, Path], tmp_path: Path) -> None:
    """`--set data_root=...` on a relaunch (docs/CORE_API.md: a runtime field) was refused: the run's copy still
    named the old root, so its fingerprint under the new one differed. Now the copy is re-pointed (as prepare
    does), its fingerprint proven unchanged, and the change recorded; a contract field is still refused, in one
    line naming it."""
    run = _stopped(data, tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.copytree(data["root"], moved)
    before = _contract(run)
    code, seen = _train(run, _config(data), data["code"], overrides={"data_root": str(moved)})
    assert code == 0 and seen and all(p.startswith(f"{moved}/") for p in seen), seen
    assert _contract(run) == before  # the contract, and its digest, as recorded
    assert json.loads((run / "config.json").read_text())["data_root"] == str(moved)
    copy = (run / "data" / "manifest.jsonl").read_text()
    assert f'"{moved}/' in copy and f'"{data["root"]}/' not in copy
    segment = read_history(run)[-1]
    assert segment["runtime_changes"]["data_root"] == [str(data["root"]), str(moved)]
    assert any("re-pointed from data_root" in note for note in segment["notes"])
    report = prove(run)
    assert report.ok and report.exposures == 6 * 2

    with pytest.raises(ConfigError) as info:
        _train(run, _config(data), data["code"], overrides={"seed": 7})
    assert str(info.value).splitlines()[0] == (
        "resume refused: override seed: 3 -> 7 changes the training contract (not a runtime field)"
    )
    assert info.value.exit_code == EXIT_REFUSED


def test_a_kill_between_the_copy_and_config_json_leaves_a_run_that_resumes(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """A relaunch that re-pointed the copy (its index saved first) and was killed before config.json named the
    root: the next launch finds the copy's root by its index and re-points it at the root it is given."""
    run = _stopped(data, tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.copytree(data["root"], moved)
    copy = run / "data" / "manifest.jsonl"  # as the killed launch left it: re-pointed, its index saved
    copy.write_text(copy.read_text().replace(f'"{data["root"]}/', f'"{moved}/'))
    Manifest.load(copy, str(moved)).save_index(index_path(copy))
    code, seen = _train(run, _config(data), data["code"])  # the script's own root, config.json's too
    assert code == 0 and all(p.startswith(f"{data['root']}/") for p in seen), seen
    assert f'"{data["root"]}/' in copy.read_text()


def test_a_manifest_with_a_byte_order_mark_runs_is_packed_prepared_and_resumes(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """A manifest exported with a UTF-8 BOM makes a run (it was refused: line 1 not a JSON object); its
    fingerprint is the file's without the BOM, its index is used, `ledger` proves it, and a bundle of it is
    prepared under another data root and resumes; there data.sha256 vouches for no bytes (prepare rewrote
    them), so the copy is read line by line, and the forgery is refused there too."""
    run = _stopped(data, tmp_path / "run", manifest="marked")
    fields = _contract(run)["fields"]
    plain = Manifest.load(data["manifest"], str(data["root"]))
    assert (fields["data.fingerprint"], fields["data.samples"]) == (plain.fingerprint(), len(plain))
    copy = run / "data" / "manifest.jsonl"
    assert copy.read_bytes().startswith(BOM)
    assert Manifest.load(copy, str(data["root"]), index=index_path(copy)).indexed
    assert prove(run).ok

    moved = tmp_path / "moved"
    shutil.copytree(data["root"], moved)
    pack(run, tmp_path / "bundle", PackOptions(code_dir=data["code"]))
    result = prepare(
        tmp_path / "bundle", PrepareOptions(run_dir=tmp_path / "prep", sets={"data_root": str(moved)})
    )
    prepared = result.run_dir
    assert _contract(prepared) == _contract(run)
    forged = tmp_path / "forged"
    shutil.copytree(prepared, forged)
    # the script passes the configuration it was written with: prepare's data_root is kept
    code, seen = _train(prepared, _config(data, "marked"), data["code"])
    assert code == 0 and seen and all(p.startswith(f"{moved}/") for p in seen), seen
    assert prove(prepared).ok
    _replace_manifest_and_index(forged, str(moved))
    _refused_naming_the_manifest(forged, _config(data, "marked"), data["code"])


def test_launch_preflight_checks_the_files_where_a_data_root_override_points(
    data: dict[str, Path], tmp_path: Path
) -> None:
    """`launch` with train.overrides.data_root on a resume checked the run's copy under the new root, where none of
    its paths (still the old root's) lay: "0 file(s) ... present", a pass whatever was missing. Now the files are
    checked as the launch re-points them."""
    from torchrelay.controller.plan import Plan
    from torchrelay.controller.preflight import PreflightFailed, run_preflight

    run = _stopped(data, tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.copytree(data["root"], moved)
    plan = Plan.from_dict(
        {"run_dir": str(run), "train": {"script": "train_lm.py", "overrides": {"data_root": str(moved)}}},
        data["code"],
    )
    report = run_preflight(plan, {})
    line = next(r.detail for r in report.results if r.name == "manifest")
    files = len(list(Manifest.load(run / "data" / "manifest.jsonl", str(data["root"])).paths()))
    samples = len(Manifest.load(run / "data" / "manifest.jsonl", str(data["root"])))
    assert line == f"{samples} samples, {files} file(s) under {moved} present", line
    gone = next(moved.rglob("*.py"))
    gone.unlink()
    with pytest.raises(PreflightFailed, match="preflight check 'manifest' failed") as info:
        run_preflight(plan, {})
    assert str(gone) in str(info.value)
