"""step.save_now: every rank saves after the update a script asks for (a new best validation loss), agreed like a
stop, kept by retention through later saves; a run resumed from such a checkpoint ends bit for bit where the
uninterrupted run ends (issue 51)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import EXAMPLES, assert_same_final_state, git, launch, metrics
from torchrelay.checkpoint.retention import decide, policy_for
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.cli import main
from torchrelay.config.relay import RelayConfig
from torchrelay.util.hashing import sha256_file

TOTAL = 12


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("save-now") / "code"
    dest.mkdir()
    shutil.copyfile(Path(__file__).with_name("save_now_net.py"), dest / "save_now_net.py")
    shutil.copyfile(EXAMPLES / "zoo" / "samples.jsonl", dest / "samples.jsonl")
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "net")
    return dest


@pytest.mark.launch
def test_saved_now_checkpoints_are_kept_and_a_resume_from_one_is_exact(
    code: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = tmp_path / "whole"
    out = launch(code, whole, script="save_now_net.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    vals = [(r["update"], r["val_loss"]) for r in metrics(whole, 0) if "val_loss" in r]
    best, improved = float("inf"), []
    for update, val in vals:
        if val < best:
            best, improved = val, [*improved, update]
    assert len(improved) >= 2, vals
    # save_every 3, keep 2: of the others only the newest two are left, every saved-now one is
    kept = {c.update: c.saved_now for c in list_checkpoints(whole) if c.complete}
    saved = sorted({3, 6, 9, TOTAL, *improved})
    assert sorted(kept) == sorted({*improved, *saved[-2:]}), (kept, vals)
    assert 3 not in kept
    for update in improved:
        assert kept[update] == f"best val_loss {dict(vals)[update]:.4f}"
        doc = json.loads((whole / f"checkpoint-{update}" / "COMPLETE.json").read_text())
        assert doc["saved_now"] == kept[update]
    assert main(["status", str(whole)]) == 0
    assert "save_now (best val_loss" in " ".join(capsys.readouterr().out.split())

    # resumed from the first saved-now checkpoint (the newer ones removed), on the same 2 ranks: bit for bit
    again = tmp_path / "again"
    shutil.copytree(whole, again, symlinks=True)
    first = improved[0]
    for c in list_checkpoints(again):
        if c.update > first:
            shutil.rmtree(c.path)
    out = launch(code, again, script="save_now_net.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert assert_same_final_state(whole, again, TOTAL) > 0
    assert [r for r in metrics(again, 0) if r["update"] > first and "val_loss" in r] == [
        r for r in metrics(whole, 0) if r["update"] > first and "val_loss" in r
    ]


def test_retention_keeps_what_save_now_saved() -> None:
    cfg = RelayConfig(seed=1, micro_batch=1, grad_accum=1, total_updates=20, manifest="m.jsonl", keep=2)
    verdict = decide(policy_for(cfg, saved_now=[4]), [2, 4, 6, 8, 10])
    assert verdict.kept == {4: "save_now", 8: "latest 2", 10: "latest 2"} and verdict.deleted == [2, 6]


@pytest.mark.launch
def test_an_export_of_a_run_outside_git_names_its_code_in_the_documented_fields(tmp_path: Path) -> None:
    # outside git the export carried code.tree "" and dirty true, the script's digest only under `untracked`
    # (issue 51); the documented fields are {commit, tree, dirty, dirty_sha256}
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("save_now_net.py",):
        shutil.copyfile(Path(__file__).with_name(name), plain / name)
    shutil.copyfile(EXAMPLES / "zoo" / "samples.jsonl", plain / "samples.jsonl")
    run = tmp_path / "run"
    out = launch(plain, run, script="save_now_net.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    code = json.loads((tmp_path / "out" / "torchrelay_export.json").read_text())["source"]["code"]
    files = {"save_now_net.py": sha256_file(plain / "save_now_net.py")[0]}
    assert code["commit"] is None and code["tree"] != "" and code["dirty"] is True
    assert code["files"] == files
    listing = json.dumps(files, sort_keys=True, separators=(",", ":")).encode()
    assert code["dirty_sha256"] == hashlib.sha256(listing).hexdigest()
