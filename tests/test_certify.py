"""`torchrelay certify`: a checkpoint replayed K updates under real torchrun reproduces the training's per-update
digests; corruption staged before the hashing (the inventory matches the bad bytes) is caught, naming the update."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import TORCHRUN
from torchrelay.audit.certify import certify, read_certificate
from torchrelay.checkpoint import dcp_io
from torchrelay.checkpoint.inventory import (
    INVENTORY,
    inventory_entries,
    list_files,
    validate_complete,
    write_inventory,
)
from torchrelay.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("TORCHRELAY_RUN_DIR", "TORCHRELAY_OVERRIDES", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)


def _launch(example: dict[str, Path]) -> list[str]:
    script = str(example["code"] / "train_lm.py")
    return [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", script]


def _files_sha(ckpt: Path) -> str:
    h = hashlib.sha256()
    for rel in list_files(ckpt):
        h.update(rel.encode() + (ckpt / rel).read_bytes())
    return h.hexdigest()


def _corrupt_a_weight_and_rehash(ckpt: Path, prefix: str = "model.") -> str:
    """Change one element of the largest tensor named `prefix`... (a weight; `optim.`: an optimizer's moment) in
    its DCP file, then write the inventory again over the changed bytes: what a fault in staging, before the
    hashing, leaves (the checkpoint verifies)."""
    model = ckpt / "model"
    md = dcp_io.read_metadata(model)
    index, info = max(
        ((i, s) for i, s in md.storage_data.items() if i.fqn.startswith(prefix)), key=lambda p: p[1].length
    )
    path = model / info.relative_path
    data = bytearray(path.read_bytes())
    item = bytes(data[info.offset : info.offset + info.length])
    tensor = torch.load(io.BytesIO(item), weights_only=True)
    tensor.view(-1)[0] += 0.01
    again = io.BytesIO()
    torch.save(tensor, again)
    assert len(again.getvalue()) == info.length  # the same record, written over in place
    data[info.offset : info.offset + info.length] = again.getvalue()
    path.write_bytes(bytes(data))
    doc = json.loads((ckpt / INVENTORY).read_text())
    (ckpt / INVENTORY).unlink()
    info_keys = {k: v for k, v in doc.items() if k not in ("format", "files")}
    write_inventory(ckpt, inventory_entries(ckpt, list_files(ckpt)), **info_keys)
    return index.fqn


@pytest.mark.launch
def test_certify_reproduces_the_recorded_updates_and_names_where_a_corrupt_checkpoint_parts(
    baseline: Path, example: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    before = _files_sha(run / "checkpoint-8")
    launch = [*_launch(example), "--config", str(example["config"])]
    cert = certify(run, launch, checkpoint=8, updates=2)
    assert cert.certified and cert.first_differing is None and cert.compared == 4, cert.line()
    assert cert.numerics_same is True
    recorded = read_certificate(run, 8)
    assert recorded is not None and recorded["certified"] is True and recorded["updates"] == 2
    assert _files_sha(run / "checkpoint-8") == before  # the checkpoint is never touched
    assert not (run / "checkpoint-10").exists()  # the replay ran on a copy

    # a moment of the optimizer: the load cannot tell (the digest covers the parameters), the replay's first
    # update can
    name = _corrupt_a_weight_and_rehash(run / "checkpoint-8", "optim.")
    assert validate_complete(run / "checkpoint-8")["update"] == 8  # every file matches its inventory
    code = main(["certify", str(run), "--checkpoint", "8", "--updates", "2", "--", *launch])
    said = capsys.readouterr()
    out = said.out.strip().splitlines()
    assert code == 1, (name, said.out, said.err[-3000:])
    assert out == [
        "checkpoint-8: NOT certified: the replay parts from the training at update 9 (rank(s) 0, 1)"
    ], (said.out, said.err[-3000:])
    assert read_certificate(run, 8)["certified"] is False
    # a weight: the replay's load itself refuses it (the parameters once loaded against update 8's digest)
    name = _corrupt_a_weight_and_rehash(run / "checkpoint-8")
    code = main(["certify", str(run), "--checkpoint", "8", "--updates", "2", "--", *launch])
    said = capsys.readouterr()
    assert code == 1, (name, said.out, said.err[-3000:])
    assert said.out.strip().splitlines() == [
        "checkpoint-8: NOT certified: its parameters, once loaded, are not those update 8 trained (the replay's "
        "load refused it)"
    ], (said.out, said.err[-3000:])
    assert read_certificate(run, 8)["loaded_differs"] is True


def test_certify_chooses_by_the_updates_recorded_not_by_every_rank_that_ever_recorded(tmp_path: Path) -> None:
    from torchrelay.audit.certify import choose, compare
    from torchrelay.audit.runner import AuditError

    # 4 ranks up to update 8, moved to 2 (launch --reshard): ranks 2 and 3 record nothing after it
    moved = {r: {u: f"d{u}" for u in range(1, 9 if r > 1 else 13)} for r in range(4)}
    assert choose(moved, [4, 8, 10], None, 2, tmp_path) == 10
    assert choose(moved, [4, 8, 10], 10, 2, tmp_path) == 10
    assert compare(moved, {0: moved[0], 1: moved[1]}, 11, 12) == (None, [], 4)
    assert compare(moved, {0: moved[0], 1: {**moved[1], 12: "x"}}, 11, 12) == (12, [1], 4)
    # replayed on 1 rank where the training had 2 after the checkpoint: not a parting, a wrong launch
    with pytest.raises(
        AuditError, match=r"update 11: the training recorded digests on 2 rank\(s\), the replay on 1"
    ):
        compare(moved, {0: moved[0]}, 11, 12)
    # trained to 6 by a torchrelay without digests, then resumed: checkpoint-4 has none after it
    older = {r: {u: f"d{u}" for u in range(7, 13)} for r in range(2)}
    with pytest.raises(
        AuditError, match=r"--checkpoint 4 --updates 1: the run recorded no digest of update 5 "
    ):
        choose(older, [4, 6, 8], 4, 1, tmp_path)
    assert choose(older, [4, 6, 8], 6, 2, tmp_path) == 6
    with pytest.raises(AuditError, match=r"no complete checkpoint has 1 recorded update\(s\) after it"):
        choose(older, [4], None, 1, tmp_path)
