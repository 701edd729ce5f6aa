"""The memory tier's replica without a launch (checkpoint/replica.py, tiers.py, run/saver.py): a part received from
a peer is hostile input (every path, size and field checked before a byte is written, nothing outside the replica
folder, the replica not kept), the part and replica fields of an inventory follow their schemas, the decision to
run the tier at open and the capacity each node needs are pure, and `status` lists the replicas a node holds."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from torchrelay.checkpoint.inventory import INVENTORY, validate_complete, write_inventory
from torchrelay.checkpoint.replica import _pack, keep_replica, receive_part, replica_dir
from torchrelay.checkpoint.replica_resume import survey
from torchrelay.checkpoint.retention import LatestN
from torchrelay.checkpoint.tiers import memory_root
from torchrelay.errors import IntegrityError, RelayError
from torchrelay.paths.rundir import RunDir

UPDATE = 7
FILES = {"model/__0_0.distcp": b"weights" * 100, "rank0.json": b'{"rng": 1}'}


def _entry(rel: str, body: bytes) -> dict[str, Any]:
    return {"path": rel, "size": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def _part(tmp_path: Path, node: int = 0) -> Path:
    """A published part of node `node` as commit_parts writes it (files, then the inventory with `part`)."""
    folder = tmp_path / f"part-{node}"
    for rel, body in FILES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(body)
    entries = [_entry(rel, body) for rel, body in FILES.items()]
    part = {"node": node, "nodes": 2, "checkpoint_sha256": "ab" * 32, "files": 4}
    write_inventory(folder, entries, update=UPDATE, tier="memory", host="node-a", part=part)
    return folder


def _forged(doc: dict[str, Any], bodies: list[bytes]) -> bytes:
    """What a hostile peer sends: any inventory, any bytes after it."""
    head = json.dumps(doc).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(bodies)


def _doc(tmp_path: Path) -> dict[str, Any]:
    return json.loads((_part(tmp_path) / INVENTORY).read_text())


def _refused(tmp_path: Path, data: bytes, caplog: pytest.LogCaptureFixture) -> str:
    """The one line keep_replica says for `data`, after checking that nothing was kept or written outside."""
    root = tmp_path / "memory"
    root.mkdir(exist_ok=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchrelay"):
        assert keep_replica(root, UPDATE, data, source=0, node=1, retention=LatestN(1)) is None
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    folder = replica_dir(root, 0)
    assert not folder.is_dir() or not list(folder.iterdir()), list(folder.rglob("*"))  # no temporary left
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/torchrelay-escaped-replica").exists()
    return lines[0]


def test_a_received_part_is_kept_verified(tmp_path: Path) -> None:
    root = tmp_path / "memory"
    root.mkdir()
    kept = keep_replica(root, UPDATE, _pack(_part(tmp_path)), source=0, node=1, retention=LatestN(1))
    assert kept == replica_dir(root, 0) / "checkpoint-7", kept
    doc = validate_complete(kept)
    assert doc["part"]["node"] == 0 and doc["replica"]["node"] == 1, doc


@pytest.mark.parametrize(
    ("path", "field"),
    [("../../escaped", "files[0].path"), ("/tmp/torchrelay-escaped-replica", "files[0].path"),
     ("a/../../escaped", "files[0].path")],
)  # fmt: skip
def test_a_peer_s_path_out_of_the_replica_folder_is_refused_and_nothing_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, path: str, field: str
) -> None:
    """Before: the received inventory's paths were joined to the replica's temporary and written as they came
    (`../../escaped` was written beside the memory tier)."""
    doc = _doc(tmp_path)
    body = b"hostile"
    doc["files"] = [_entry(path, body)]
    line = _refused(tmp_path, _forged(doc, [body]), caplog)
    assert "replica of node 0 checkpoint-7 refused" in line and "node 0" in line and field in line, line


def test_a_link_planted_as_the_replica_folder_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: replica-node0 as a link to another folder took the replica there."""
    outside = tmp_path / "escaped"
    outside.mkdir()
    root = tmp_path / "memory"
    root.mkdir()
    os.symlink(outside, replica_dir(root, 0))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchrelay"):
        kept = keep_replica(root, UPDATE, _pack(_part(tmp_path)), source=0, node=1, retention=LatestN(1))
    assert kept is None and not list(outside.iterdir())
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1 and "symlink" in lines[0] and "replica folder of node 0" in lines[0], lines


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("extra", "files"),  # bytes past what the inventory lists
        ("short", "files"),  # a size past the bytes that came
        ("header", "header"),  # an inventory length past the payload
        ("json", "not valid JSON"),
        ("node", "part.node"),  # another node's part
        ("part_type", "part.nodes"),
        ("replica_type", "replica"),
        ("twice", "files[1].path"),
        ("sha", "files[0]"),
    ],
)
def test_a_peer_s_sizes_counts_and_fields_are_refused_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str, field: str
) -> None:
    doc = _doc(tmp_path)
    bodies = [FILES[e["path"]] for e in doc["files"]]
    data = _forged(doc, bodies)
    if change == "extra":
        data += b"more"
    elif change == "short":
        data = data[:-3]
    elif change == "header":
        data = (10**9).to_bytes(8, "little") + data[8:]
    elif change == "json":
        data = (5).to_bytes(8, "little") + b"{nope" + b"".join(bodies)
    elif change == "node":
        doc["part"]["node"] = 1
        data = _forged(doc, bodies)
    elif change == "part_type":
        doc["part"]["nodes"] = "many"
        data = _forged(doc, bodies)
    elif change == "replica_type":
        doc["replica"] = 5
        data = _forged(doc, bodies)
    elif change == "twice":
        doc["files"] = [doc["files"][0], doc["files"][0]]
        data = _forged(doc, [bodies[0], bodies[0]])
    elif change == "sha":
        doc["files"][0]["sha256"] = "0" * 64
        data = _forged(doc, bodies)
    line = _refused(tmp_path, data, caplog)
    assert "the part received from node 0" in line and field in line, line


def test_receive_part_writes_nothing_for_a_hostile_path_at_assembly(tmp_path: Path) -> None:
    """The resume's broadcast of a missing part goes through the same checks (settle_after_open)."""
    doc = _doc(tmp_path)
    doc["files"] = [_entry("../escaped", b"x")]
    with pytest.raises(RelayError, match=r"node 1 \(rank 2\), field 'files\[0\]\.path'.*climbs out") as info:
        receive_part(_forged(doc, [b"x"]), tmp_path / "asm", peer="node 1 (rank 2)", node=0, update=UPDATE)
    assert "\n" not in info.value.message and not (tmp_path / "escaped").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [("part", {"node": "x", "nodes": 2, "checkpoint_sha256": "ab" * 32, "files": 4}), ("replica", 5),
     ("part", {"node": 0, "nodes": 2, "checkpoint_sha256": "zz", "files": 4}),
     ("replica", {"held_on": 7, "node": 0})],
)  # fmt: skip
def test_part_and_replica_fields_of_a_held_inventory_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: object
) -> None:
    """Before: a `replica` of 5 in a held part's COMPLETE.json was an AttributeError at the choice (`.get` of an
    int); the survey now refuses it naming the file and the field."""
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(tmp_path / "shm"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    run = tmp_path / "run"
    run.mkdir()
    (run / "lineage.json").write_text(json.dumps({"lineage": "L1", "parent_lineage": None}))
    root = memory_root("L1", RunDir(run))
    part = _part(tmp_path)
    doc = json.loads((part / INVENTORY).read_text())
    doc[field] = value
    (part / INVENTORY).write_text(json.dumps(doc))
    root.mkdir(parents=True)
    part.rename(root / "checkpoint-7")
    with pytest.raises(IntegrityError, match=f"field '{field}"):
        validate_complete(root / "checkpoint-7")
    held = survey(RunDir(run), 0, 2)
    assert held is not None and len(held["parts"]) == 1, held
    why = held["parts"][0]["why"]
    assert why and f"field '{field}" in why and "\n" not in why, why


# ------------------------------------------------------------------------------- the decisions at open
def test_the_tier_at_open_turns_off_for_a_deepspeed_engine_on_several_nodes_in_one_line() -> None:
    """Before: a DeepSpeed engine's memory save on two nodes took the one-folder commit, which each node staged in
    its own memory and rank 0 inventoried alone (a failure at the first memory save, mid-run)."""
    from torchrelay.checkpoint.deepspeed_engine import declares_engine
    from torchrelay.checkpoint.tiers import tier_at_open

    ds = {"deepspeed": {"train_micro_batch_size_per_gpu": 2}}
    trainer = {"training_args": {"deepspeed": {"zero_optimization": {"stage": 2}}}}
    assert declares_engine(ds) and declares_engine(trainer) and not declares_engine({"lr": 1.0})
    kw: dict[str, Any] = {"hosts": 2, "nodes": 2, "async_save": True}
    on, line = tier_at_open(1, "L", deepspeed=declares_engine(ds), **kw)
    assert not on and line is not None and "\n" not in line, line
    assert line.startswith("memory tier off: a DeepSpeed engine") and "2 nodes" in line, line
    assert tier_at_open(1, "L", deepspeed=False, **kw) == (True, None)
    assert tier_at_open(1, "L", hosts=1, nodes=1, async_save=True, deepspeed=True) == (True, None)  # one node
    assert tier_at_open(0, "L", deepspeed=True, **kw) == (False, None)  # not asked for: nothing said
    on, line = tier_at_open(1, "L", hosts=2, nodes=2, async_save=False, deepspeed=False)
    assert not on and line is not None and "async_save true" in line
    on, line = tier_at_open(1, "L", hosts=2, nodes=1, async_save=True, deepspeed=False)
    assert not on and line is not None and "LOCAL_WORLD_SIZE" in line


def test_capacity_counts_each_node_s_part_and_the_replica_it_holds() -> None:
    """Before: every rank's state summed against rank 0's node only: node 1, short of memory, was never asked,
    and on two nodes neither node's count held the replica of its partner's part."""
    from torchrelay.checkpoint.tiers import node_capacity

    gib = 1 << 30
    roomy = (100 * gib, 100 * gib)
    # 2 nodes of 2 ranks, 1 GiB a rank: each node holds 2 GiB of its own and 2 GiB of its partner's a slot
    per_rank = [(gib, *roomy), (gib, *roomy), (gib, 9 * gib, 100 * gib), (gib, 9 * gib, 100 * gib)]
    keep, line = node_capacity(per_rank, 2, 2)  # 3 slots of 4 GiB = 12 GiB > node 1's 9 GiB of /dev/shm
    assert keep == 1 and line is not None and "\n" not in line, line
    assert "memory_keep 1: 2 + 1 slots of 4.00 GiB need 12.00 GiB" in line, line
    assert "node 1 (its part and the replica of node 0's) has 9.00 GiB free in /dev/shm" in line, line
    per_rank[2] = per_rank[3] = (gib, 100 * gib, 7 * gib)  # node 1's RAM short for 2 slots: off
    keep, line = node_capacity(per_rank, 2, 2)
    assert keep == 0 and line is not None and line.startswith("memory tier off for this segment"), line
    assert "on node 1 (its part and the replica of node 0's)" in line, line
    assert node_capacity([(gib, *roomy)] * 4, 2, 2) == (2, None)
    # one node: the whole state, no replica, as before
    keep, line = node_capacity([(2 * gib, 7 * gib, 100 * gib)] * 2, 2, 4)
    assert keep == 0 and line is not None and "this node" in line, line
    assert node_capacity([(2 * gib, 13 * gib, 100 * gib)] * 2, 2, 4)[0] == 2


# ------------------------------------------------------------------------------------------------- status
def test_status_lists_the_replicas_a_node_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `status` listed the node's own memory checkpoints only, never replica-node<n>/."""
    from test_hostile_records import _cli, make_run
    from torchrelay.records.summary import summarize

    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(tmp_path / "shm"))
    run = make_run(tmp_path)
    lineage = summarize(run)["lineages"][-1]
    root = memory_root(lineage, RunDir(run))
    root.mkdir(parents=True)
    _part(tmp_path, node=0).rename(root / "checkpoint-7")
    assert keep_replica(root, UPDATE, _pack(_part(tmp_path, node=1)), source=1, node=0, retention=LatestN(1))
    (replica_dir(root, 1) / "checkpoint-5").mkdir()  # a replica without its marker: listed incomplete
    tier = summarize(run)["memory_tier"]
    assert [c["update"] for c in tier["checkpoints"]] == [7], tier
    assert [(r["source"], r["update"], r["complete"]) for r in tier["replicas"]] == [
        (1, 5, False),
        (1, 7, True),
    ]
    code, out, err = _cli(["status", "--json", str(run)])
    assert code == 0 and json.loads(out)["memory_tier"]["replicas"][1]["source"] == 1, err
    monkeypatch.setenv("COLUMNS", "250")
    code, out, err = _cli(["status", str(run)])
    assert code == 0, err
    lines = out.splitlines()
    assert any("checkpoint-7" in x and "complete (replica-node1: node 1's part, held on this node)" in x
               for x in lines), out[-3000:]  # fmt: skip
    assert any("checkpoint-5" in x and "incomplete" in x and "replica-node1" in x for x in lines), out[-3000:]


def test_status_looks_for_the_memory_tier_under_the_newest_segment_s_lineage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the alphabetically last lineage of the history was taken, not the one the run trains under now (a
    reclaim or a fork starts a new one), so status looked in another run's memory folder."""
    from test_hostile_records import make_run
    from torchrelay.records.summary import summarize

    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(tmp_path / "shm"))
    run = make_run(tmp_path)
    history = run / "history.jsonl"
    last = json.loads(history.read_text().splitlines()[-1])
    newer = "0" * len(last["lineage"])  # sorts before the first lineage
    history.write_text(history.read_text() + json.dumps({**last, "lineage": newer}) + "\n")
    tier = summarize(run)["memory_tier"]
    assert tier["root"] == str(memory_root(newer, RunDir(run))), tier
