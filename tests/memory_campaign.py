"""Random SIGKILLs of a 2-node job saving to its memory tier every K updates, replicated to the partner node: each
kill takes the ranks of one node or of both at a random moment once the launch has trained past its resume point
(in a save, a replication or an update), the job is relaunched, and each relaunch's resume is judged: it opened
(no unusable state), and the work lost (the last update rank 0 logged before the kill, less the update resumed
from) is counted. Shared by tests/test_benchmarks.py (a toy size) and benchmarks/bench_memory_kills.py (100 and
more). Test support, not product code: it drives torchrun on the two "nodes" of tests/nodes.py like a user's job."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import last_logged, segments
from kill_campaign import kill_job
from nodes import Nodes, torchrun_2node
from torchrelay.paths.layout import TMP_CHECKPOINT_PREFIX
from torchrelay.util.proctree import Tree

NAMES = ["node-a", "node-b"]
SCOPES = ("both", "node0", "node1")


@dataclass
class Campaign:
    kills: list[dict[str, Any]] = field(default_factory=list)
    launches: int = 0
    unusable: list[str] = field(default_factory=list)  # a relaunch that did not open, or refused a state
    returncodes: list[int] = field(default_factory=list)  # the last launch's agents
    seconds: float = 0.0


def _landed(run: Path, mems: list[Path]) -> str:
    """Where the frozen job was: a memory save (a staged part in a node's memory), a replication (a replica being
    written), a durable save (a staged checkpoint in the run directory), else an update."""
    for mem in mems:
        if any(mem.rglob(f"replica-node*/{TMP_CHECKPOINT_PREFIX}*")):
            return "replication"
    for mem in mems:
        if any(mem.glob(f"*/*/{TMP_CHECKPOINT_PREFIX}*")):
            return "memory save"
    if any(run.glob(f"{TMP_CHECKPOINT_PREFIX}*")) or any(run.glob(".tmp*")):
        return "durable save"
    return "update"


def _kill(
    procs: list[subprocess.Popen[bytes]], trees: list[Tree], scope: str, run: Path, mems: list[Path]
) -> str:
    """Freeze the chosen node(s), note where the job was, SIGKILL them; what a one-node kill left of the other node
    ends on its own (its rank loses its peer) or is killed after 20 s."""
    chosen = [0, 1] if scope == "both" else [int(scope[-1])]
    for i in chosen:
        trees[i].collect()
        trees[i].send(signal.SIGSTOP)
    landed = _landed(run, mems)
    for i in chosen:
        kill_job(trees[i], procs[i])  # type: ignore[arg-type]
    rest = [i for i in (0, 1) if i not in chosen]
    deadline = time.monotonic() + 20
    while any(procs[i].poll() is None for i in rest) and time.monotonic() < deadline:
        time.sleep(0.1)
    for i in rest:
        if procs[i].poll() is None:
            kill_job(trees[i], procs[i])  # type: ignore[arg-type]
    return landed


def run_campaign(
    nodes: Nodes,
    code: Path,
    config: Path,
    run: Path,
    mems: list[Path],
    target: Path,
    logs: Path,
    *,
    kills: int,
    every: int,
    pace: float,
    seed: int = 52,
    budget_s: float = float("inf"),
    launch_timeout: float = 300,
) -> Campaign:
    """Launch, kill at a random moment, relaunch ... `kills` times (fewer when `budget_s` runs out or the run reaches
    its end first), then one unpaced launch to the end. `mems[n]`: node n's memory, which it sees at `target`."""
    rng = random.Random(seed)
    out = Campaign()
    started = time.perf_counter()
    port = 30100
    sets = {"memory_every": every, "memory_keep": 2, "params.min_update_s": pace}
    pending: dict[str, Any] | None = None  # the last kill, its resume not seen yet

    def launch(final: bool) -> list[subprocess.Popen[bytes]]:
        nonlocal port
        port += 1
        out.launches += 1
        return torchrun_2node(
            nodes, NAMES, code, run, port=port, config=config if out.launches == 1 else None,
            sets={**sets, "params.min_update_s": 0} if final else sets,
            env={"TORCHRELAY_MEMORY_ROOT": str(target)}, logs=logs / f"launch-{out.launches}",
            binds={0: [(mems[0], target)], 1: [(mems[1], target)]},
        )  # fmt: skip

    def judge(before: int) -> dict[str, Any] | None:
        """This launch's segment once it opened: the resume of the pending kill judged."""
        nonlocal pending
        segs = segments(run) if (run / "history.jsonl").exists() else []
        if len(segs) <= before:
            return None
        seg = segs[-1]
        if pending is not None:
            pending["resumed_from"] = seg.get("resumed_from") or 0
            pending["resumed_tier"] = seg.get("resumed_tier")
            pending["lost"] = pending["last_logged"] - pending["resumed_from"]
            refused = [n for n in seg.get("notes", []) if "refused" in n]
            if refused:
                pending["refused"] = refused
            pending = None
        return seg

    while True:
        final = len(out.kills) >= kills or time.perf_counter() - started > budget_s
        before = len(segments(run)) if (run / "history.jsonl").exists() else 0
        procs = launch(final)
        trees = [Tree(p.pid) for p in procs]
        deadline = time.monotonic() + launch_timeout
        seg = None
        while seg is None and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            seg = judge(before)
            time.sleep(0.05)
        if seg is None:
            seg = judge(before)
        if seg is None:
            out.unusable.append(f"launch {out.launches} opened no segment (exit {[p.poll() for p in procs]})")
            for p, t in zip(procs, trees, strict=True):
                if p.poll() is None:
                    kill_job(t, p)  # type: ignore[arg-type]
            break
        if final:
            out.returncodes = [p.wait(timeout=launch_timeout) for p in procs]
            break
        start = seg.get("resumed_from") or 0
        target_update = start + 1 + rng.randint(0, 2)
        while (
            last_logged(run) < target_update
            and all(p.poll() is None for p in procs)
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        time.sleep(rng.uniform(0, pace))
        if any(p.poll() is not None for p in procs) or time.monotonic() >= deadline:
            out.returncodes = [p.wait(timeout=launch_timeout) for p in procs]  # the run ended before the kill
            break
        scope = rng.choice(SCOPES)
        landed = _kill(procs, trees, scope, run, mems)
        pending = {"launch": out.launches, "scope": scope, "landed": landed, "last_logged": last_logged(run)}
        out.kills.append(pending)
    out.seconds = time.perf_counter() - started
    return out
