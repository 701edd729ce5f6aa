"""The memory tier's replica on a partner node (checkpoint/replica.py), on two real "nodes" (tests/nodes.py), one
rank each, each node's memory its own folder (bound at one path, TORCHRELAY_MEMORY_ROOT): every rank SIGKILLed,
node 1's memory wiped (a replacement node under another name), the relaunch takes node 1's part from node 0's
replica and ends bit for bit as the uninterrupted run; a replica with one flipped byte is refused in one line
naming the file and the durable tier is used."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import assert_same_final_state, assert_same_logs, segments, wait_for_update
from nodes import Nodes, torchrun_2node
from test_multinode import free_port, nodes, wait_all  # noqa: F401 - `nodes` is the fixture
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.replica import nodes_of
from torchrelay.ledger.exposure import prove

U = 16  # the example's schedule (save_every 8)
TARGET = Path("/tmp/torchrelay-test-memory")  # where each node sees its own memory folder


def test_nodes_by_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    where = nodes_of(5, 8)
    assert (where.node, where.nodes, where.leader, where.partner, where.source) == (2, 4, 4, 3, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # not a divisor: one node, nothing replicated
    assert nodes_of(1, 8).nodes == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert nodes_of(0, 2).nodes == 1


@pytest.fixture
def memories(tmp_path: Path) -> Iterator[list[Path]]:
    mems = [tmp_path / "memory-node0", tmp_path / "memory-node1"]
    for m in mems:
        m.mkdir()
    TARGET.mkdir(exist_ok=True)
    yield mems
    with_left = [m for m in mems if m.exists()]
    for m in with_left:
        shutil.rmtree(m, ignore_errors=True)


def _launch(
    nodes: Nodes,  # noqa: F811
    example: dict[str, Path],
    run: Path,
    names: list[str],
    mems: list[Path],
    logs: Path,
    **kw: Any,
) -> list[subprocess.Popen[bytes]]:
    port = 29700 + len(list(logs.glob("*"))) if nodes.netns else free_port()
    return torchrun_2node(
        nodes,
        names,
        example["code"],
        run,
        port=port,
        logs=logs / f"{names[0]}-{names[1]}-{port}",
        env={"TORCHRELAY_MEMORY_ROOT": str(TARGET)},
        binds={0: [(mems[0], TARGET)], 1: [(mems[1], TARGET)]},
        **kw,
    )


def _kill_after(run: Path, update: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every process of both nodes once rank 0 logged `update` and a later memory save was replicated."""
    before = len(segments(run)) if (run / "history.jsonl").exists() else 0
    deadline = time.monotonic() + 240
    while (
        not (run / "history.jsonl").exists() or len(segments(run)) == before
    ) and time.monotonic() < deadline:
        time.sleep(0.05)  # this launch's segment opened: the logs were trimmed to its checkpoint
    wait_for_update(run, update, procs[0], timeout=240)  # type: ignore[arg-type]
    doomed = [psutil.Process(p.pid) for p in procs]
    doomed += [
        c for p in doomed for c in p.children(recursive=True)
    ]  # torchrun's ranks have sessions of their own
    for proc in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(doomed, timeout=30)
    wait_all(procs)


def _parts(mem: Path, sub: str = "") -> list[Path]:
    return sorted((mem / sub).rglob("checkpoint-*/COMPLETE.json"))


@pytest.mark.launch
def test_a_wiped_node_resumes_from_its_partners_replica_and_a_flipped_byte_falls_back(
    example: dict[str, Path],
    baseline: Path,
    nodes: Nodes,  # noqa: F811
    tmp_path: Path,
    memories: list[Path],
) -> None:
    run, logs = tmp_path / "run", tmp_path / "logs"
    paced = {"memory_every": 1, "params.min_update_s": 0.3}

    # (c) node 1's memory wiped and node 0's replica of it damaged: refused in one line, the durable tier used
    _kill_after(run, 11, _launch(nodes, example, run, ["node-a", "node-b"], memories, logs,
                                 config=example["config"], sets=paced))  # fmt: skip
    replicas = [p.parent for p in _parts(memories[0], "") if "replica-node1" in str(p)]
    assert len(replicas) == 1 and _parts(memories[1]), (
        list(memories[0].rglob("*")),
        list(memories[1].rglob("*")),
    )
    replica = replicas[0]
    doc = json.loads((replica / "COMPLETE.json").read_text())
    assert doc["part"]["node"] == 1 and doc["replica"]["held_on"] == "node-a" and doc["host"] == "node-b", doc
    validate_complete(replica)
    for child in memories[1].iterdir():
        shutil.rmtree(child)
    victim = max((replica / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    _kill_after(run, 10, _launch(nodes, example, run, ["node-a", "node-c"], memories, logs, sets=paced))
    seg = segments(run)[1]
    assert seg["resumed_tier"] == "durable" and seg["resumed_from"] == 8, seg
    shown = str(victim).replace(str(memories[0]), str(TARGET))  # the path as node a sees it
    refusal = [n for n in seg["notes"] if n.startswith("replica of node 1")]
    assert refusal == [
        f"replica of node 1 {replica.name} on node-a refused: {shown} does not match its SHA-256 in COMPLETE.json"
    ], seg["notes"]

    # (b) every rank killed again, node 1 (node-c) replaced by node-d with empty memory: node 0's replica serves it
    assert [p for p in _parts(memories[0]) if "replica-node1" in str(p)]
    for child in memories[1].iterdir():
        shutil.rmtree(child)
    procs = _launch(
        nodes, example, run, ["node-a", "node-d"], memories, logs, sets={"params.min_update_s": 0}
    )
    assert wait_all(procs) == [0, 0], [p.read_text()[-3000:] for p in (logs).rglob("*.log")]
    seg = segments(run)[2]
    assert seg["resumed_tier"] == "replica" and seg["resumed_from"] > 8, seg
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    assert prove(run).ok
    # the finished run's memory tier is given back on every node: parts and replicas alike
    assert [list(m.rglob("checkpoint-*")) for m in memories] == [[], []]
