"""The memory tier's replica under faults, on two real "nodes" (tests/nodes.py, one rank each): a forged part that
passes its own node's check at open but does not make the checkpoint it names when the parts are assembled is
refused on every rank in one line and the next tier is used, the run going on to its end bit for bit as the
uninterrupted one (issue 52 (f)); a kill inside the replication is never resumed from (issue 52 (d))."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import assert_same_final_state, assert_same_logs, segments
from nodes import Nodes
from test_multinode import nodes, wait_all  # noqa: F401 - `nodes` is the fixture
from test_replica import U, _kill_after, _launch, _parts, memories  # noqa: F401 - `memories` is the fixture
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.replica_resume import choose
from torchrelay.checkpoint.tiers import Binding
from torchrelay.ledger.exposure import prove
from torchrelay.paths.layout import TMP_CHECKPOINT_PREFIX


def _forge(part: Path) -> Path:
    """Flip a byte of `part`'s largest file and write its new SHA-256 into the part's inventory: the part checks
    against itself, its `part.checkpoint_sha256` still names the checkpoint the other node's part names."""
    inventory = part / "COMPLETE.json"
    doc = json.loads(inventory.read_text())
    entry = max(doc["files"], key=lambda e: e["size"])
    victim = part / entry["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    inventory.write_text(json.dumps(doc))
    validate_complete(part)  # it passes the check a node makes of what it holds
    return victim


@pytest.mark.launch
def test_a_forged_replica_refused_at_assembly_falls_back_to_durable_on_every_rank(
    example: dict[str, Path],
    baseline: Path,
    nodes: Nodes,  # noqa: F811
    tmp_path: Path,
    memories: list[Path],  # noqa: F811
) -> None:
    """(f) Node 1's memory wiped, node 0's replica of it forged: the parts are assembled on both nodes, the
    assembled checkpoint is refused on every rank in one line naming the parts, and the same launch resumes from the
    durable checkpoint-8 and runs to its end, bit for bit as the uninterrupted run."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    paced = {"memory_every": 1, "memory_keep": 2, "params.min_update_s": 0.3}
    _kill_after(run, 11, _launch(nodes, example, run, ["node-a", "node-b"], memories, logs,
                                 config=example["config"], sets=paced))  # fmt: skip
    own = {p.parent.name for p in _parts(memories[0]) if "replica-node" not in str(p)}
    replicas = sorted((p.parent for p in _parts(memories[0]) if "replica-node1" in str(p)),
                      key=lambda p: -int(p.name.split("-")[1]))  # fmt: skip
    assert [r for r in replicas if r.name in own], (own, replicas)  # an update whose every part node 0 holds
    for child in memories[1].iterdir():
        shutil.rmtree(child)
    for replica in replicas:  # every one: each refused in its turn, then the durable tier
        _forge(replica)
    procs = _launch(
        nodes, example, run, ["node-a", "node-c"], memories, logs, sets={"params.min_update_s": 0}
    )
    assert wait_all(procs) == [0, 0], [p.read_text()[-3000:] for p in logs.rglob("*.log")]
    seg = segments(run)[1]
    assert seg["resumed_tier"] == "durable" and seg["resumed_from"] == 8, seg
    refusals = [n for n in seg["notes"] if "assembled from nodes" in n]
    chosen = [r for r in replicas if r.name in own]  # the updates chosen in turn, newest first
    assert len(refusals) == len(chosen) and not any("\n" in n for n in refusals), seg["notes"]
    for replica, refusal in zip(chosen, refusals, strict=True):
        assert refusal.startswith(f"memory {replica.name} assembled from nodes [0, 0] refused: "), refusal
        assert f"replica-node1/{replica.name}/COMPLETE.json" in refusal, refusal
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    assert prove(run).ok


def _kill_rest(procs: list[subprocess.Popen[bytes]], first: int, timeout: float = 240) -> None:
    """Once node `first`'s agent has ended (its rank killed itself at its kill point), SIGKILL what is left of both
    nodes: the other rank waits on a peer that is gone."""
    deadline = time.monotonic() + timeout
    while procs[first].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs[first].poll() is not None, "the kill point was never reached"
    doomed = [psutil.Process(p.pid) for p in procs if p.poll() is None]
    doomed += [c for p in doomed for c in p.children(recursive=True)]
    for proc in doomed:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(doomed, timeout=30)
    wait_all(procs)


@pytest.mark.launch
@pytest.mark.parametrize("moment", ["receive", "send"])
def test_a_kill_inside_replication_never_resumes_from_the_half_replica(
    moment: str,
    example: dict[str, Path],
    baseline: Path,
    nodes: Nodes,  # noqa: F811
    tmp_path: Path,
    memories: list[Path],  # noqa: F811
) -> None:
    """(d) A node's first rank SIGKILLed inside the replication of update 10 (`receive`: node 1, once one file of
    node 0's part is written in its memory; `send`: node 0, before it sends its part), then node 0 lost with its
    memory: the relaunch cannot take node 0's part of update 10 from anywhere (the half replica is removed, never
    chosen), takes update 9 from node 1's complete replica, and ends bit for bit as the uninterrupted run."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    paced = {"memory_every": 1, "memory_keep": 2, "params.min_update_s": 0.3}
    killed = 1 if moment == "receive" else 0
    procs = _launch(nodes, example, run, ["node-a", "node-b"], memories, logs, config=example["config"],
                    sets=paced, args=["--kill-at", f"{moment}:10:{killed}"])  # fmt: skip
    _kill_rest(procs, killed)
    roots = [next(m.glob("*/*")) for m in memories]  # each node's memory root: <lineage>/<run directory>/
    held = roots[1] / "replica-node0"
    half = sorted(held.glob(f"{TMP_CHECKPOINT_PREFIX}10-*"))
    complete = sorted(p.parent.name for p in _parts(held))
    assert "checkpoint-9" in complete and "checkpoint-10" not in complete, complete  # 10's never published
    if moment == "receive":  # one file of node 0's part of update 10 written, the rest never
        assert len(half) == 1 and any(p.is_file() for p in half[0].rglob("*")), list(held.rglob("*"))
    else:
        assert not half, half
    assert (roots[0] / "checkpoint-10" / "COMPLETE.json").exists()  # node 0's own part was published
    for child in memories[0].iterdir():  # node 0 lost: a replacement with empty memory
        shutil.rmtree(child)
    procs = _launch(
        nodes, example, run, ["node-c", "node-b"], memories, logs, sets={"params.min_update_s": 0}
    )
    assert wait_all(procs) == [0, 0], [p.read_text()[-3000:] for p in logs.rglob("*.log")]
    seg = segments(run)[1]
    assert seg["resumed_tier"] == "replica" and seg["resumed_from"] == 9, seg
    assert not list(held.glob(f"{TMP_CHECKPOINT_PREFIX}*")), list(held.iterdir())  # removed at open
    assert_same_final_state(baseline, run, U)
    assert_same_logs(baseline, run)
    assert prove(run).ok


def _holding(node: int, host: str, parts: list[tuple[int, int, bool]]) -> dict[str, Any]:
    """What `survey` reports of a node now numbered `node` on `host`: (part's node, update, is a replica)."""
    items = []
    for source, update, replica in parts:
        doc = {"tier": "memory", "lineage": "L", "run_dir": "/r", "contract_sha256": "c", "world_size": 2,
               "micro_batch": 1, "grad_accum": 1, "segment": "s", "update": update,
               "host": host if not replica else f"host-of-{source}",
               "part": {"node": source, "nodes": 2, "checkpoint_sha256": f"d{update}"}}  # fmt: skip
        if replica:
            doc["replica"] = {"held_on": host, "node": node}
        items.append({"source": source, "held_by": node, "replica": replica, "update": update, "doc": doc,
                      "why": None})  # fmt: skip
    return {"node": node, "host": host, "parts": items}


def test_a_relaunch_that_numbers_the_nodes_otherwise_still_resumes_from_their_memory() -> None:
    """torchrun's rendezvous numbers the nodes as they join: the node that was 1 may be 0 at the relaunch. Each
    node's part is found where it is (its own memory first), and a part whose node was refused before is not."""
    binding = Binding(
        lineage="L", run_dir="/r", contract_sha256="c", world_size=2, micro_batch=1, grad_accum=1
    )
    swapped = [_holding(0, "node-b", [(1, 10, False), (0, 9, True)]),
               _holding(1, "node-a", [(0, 10, False), (1, 9, True)])]  # fmt: skip
    got = choose(swapped, binding, 8, {"s"})
    assert (got.update, got.plan, got.tier, got.refused) == (10, [1, 0], "memory", []), got
    lost = [_holding(0, "node-c", []), _holding(1, "node-b", [(1, 10, False), (1, 9, False), (0, 9, True)])]
    got = choose(
        lost, binding, 8, {"s"}
    )  # node a lost, node b now node 1: node 0's part of 9 from its replica
    assert (got.update, got.plan, got.tier, got.refused) == (9, [1, 1], "replica", []), got


def test_a_part_taken_from_a_replica_is_a_note_of_the_segment(tmp_path: Path) -> None:
    """A replacement node holds nothing: its part comes from the replica its partner holds, and the segment's
    notes say so (which node's part, from where), beside `resumed_tier` "replica"."""
    from types import SimpleNamespace

    from torchrelay.paths.rundir import RunDir
    from torchrelay.run.directory import _across_nodes

    binding = Binding(
        lineage="L", run_dir="/r", contract_sha256="c", world_size=2, micro_batch=1, grad_accum=1
    )
    replaced = [_holding(0, "n1", [(0, 10, False), (1, 10, True)]), _holding(1, "n3", [])]
    got = _across_nodes(
        RunDir(tmp_path), "L", replaced, binding, SimpleNamespace(checkpoint=None, update=8), {"s"}
    )
    assert (got.update, got.plan, got.tier) == (10, [0, 0], "replica"), got
    assert got.notes == ["node 1's part of memory checkpoint-10 from its replica on n1 (node 0)"], got.notes
    same = [
        _holding(0, "n1", [(0, 10, False), (1, 10, True)]),
        _holding(1, "n2", [(1, 10, False), (0, 10, True)]),
    ]
    got = _across_nodes(
        RunDir(tmp_path), "L", same, binding, SimpleNamespace(checkpoint=None, update=8), {"s"}
    )
    assert (got.plan, got.tier, got.notes) == ([0, 1], "memory", []), got
