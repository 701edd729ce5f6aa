"""The memory tier under many kills on two nodes: a real job of the example on the two "nodes" of tests/nodes.py
(one rank each, each node's memory its own folder), saving to memory every K updates (replicated to the partner
node) and durably every --save-every, SIGKILLed --kills times at random moments (the ranks of one node or of both;
tests/memory_campaign.py), relaunched each time, then run to its end. Judged: every relaunch opened (0 unusable
states), the work lost at each kill (the last update logged, less the update resumed from) is at most --max-lost,
and the final state is bit for bit the uninterrupted run's (2 ranks on one host), its logs equal and its ledger
proved. Needs root (network namespaces; without them the nodes talk over the loopback).

    PYTHONPATH=src:tests .venv/bin/python benchmarks/bench_memory_kills.py --kills 100 --budget-s 1500
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchlib import print_stamped

from helpers import assert_same_final_state, assert_same_logs, launch, make_code_repo, make_data, write_config
from memory_campaign import run_campaign
from nodes import Nodes
from torchrelay.ledger.exposure import prove


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--every", type=int, default=1, help="K: memory_every")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--updates", type=int, default=0, help="total updates (0: 2 per kill + 10)")
    # the least seconds an update takes (a runtime parameter: the same bits); the kills land inside updates
    parser.add_argument("--pace", type=float, default=0.3)
    # a kill may land after update u is logged while the memory checkpoint of u is still written in the background
    # (the save overlaps the next update): that one update is counted beside K
    parser.add_argument("--max-lost", type=int, default=0, help="the bound on lost updates (0: K)")
    parser.add_argument(
        "--budget-s", type=float, default=float("inf"), help="no new kill after this many seconds"
    )
    parser.add_argument("--seed", type=int, default=52)
    args = parser.parse_args()
    updates = args.updates or 2 * args.kills + 10
    max_lost = args.max_lost or args.every
    nodes = Nodes(Path(tempfile.mkdtemp(prefix="bench-memory-nodes-")))
    why = nodes.available()
    if why:
        print(f"bench_memory_kills.py: two nodes cannot be made here: {why}", file=sys.stderr)
        return 2
    nodes.up()
    target = Path(tempfile.mkdtemp(prefix="bench-memory-target-"))  # where each node sees its own memory
    try:
        with tempfile.TemporaryDirectory(prefix="bench-memory-kills-") as tmp:
            base = Path(tmp)
            code = make_code_repo(base / "code")
            root, manifest = make_data(base / "data")
            config = write_config(base / "lm.yaml", manifest, root, total_updates=updates,
                                  save_every=args.save_every)  # fmt: skip
            baseline = base / "baseline"
            done = launch(code, baseline, config=config)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            mems = [base / "memory-node0", base / "memory-node1"]
            for m in mems:
                m.mkdir()
            run = base / "run"
            out = run_campaign(
                nodes, code, config, run, mems, target, base / "logs", kills=args.kills, every=args.every,
                pace=args.pace, seed=args.seed, budget_s=args.budget_s,
            )  # fmt: skip
            last_logs = sorted((base / "logs").glob(f"launch-{out.launches}/*.log"))
            tail = [p.read_text(errors="replace")[-2000:] for p in last_logs]
            assert out.returncodes == [0, 0] and not out.unusable, (out.returncodes, out.unusable, tail)
            tensors = assert_same_final_state(baseline, run, updates)
            assert_same_logs(baseline, run)
            assert prove(run).ok
            lost = [k["lost"] for k in out.kills]
            refused = [k for k in out.kills if k.get("refused")]
            result = {
                "kills": len(out.kills),
                "launches": out.launches,
                "updates": updates,
                "K": args.every,
                "landed": dict(Counter(k["landed"] for k in out.kills)),
                "scopes": dict(Counter(k["scope"] for k in out.kills)),
                "resumed_tiers": dict(Counter(str(k.get("resumed_tier")) for k in out.kills)),
                "lost_max": max(lost, default=0),
                "lost_histogram": dict(sorted(Counter(lost).items())),
                "unusable_states": len(out.unusable) + len(refused),
                "bit_exact_tensors": tensors,
                "logs_equal": True,
                "ledger_proved": True,
                "campaign_s": round(out.seconds, 1),
            }
            assert result["lost_max"] <= max_lost, out.kills
            assert not refused, refused
    finally:
        nodes.down()
        shutil.rmtree(target, ignore_errors=True)
        shutil.rmtree(nodes.base, ignore_errors=True)
    print_stamped(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
