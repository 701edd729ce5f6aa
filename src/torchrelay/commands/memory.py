"""`torchrelay status --memory` and `torchrelay stop --forget-memory`: this user's memory tiers on this node
(checkpoint/node_tiers.py), seen and freed."""

from __future__ import annotations

import argparse
import json
import socket

from torchrelay.checkpoint.node_tiers import LIVE, REFUSED, STALE, NodeTier, forget, of_run, scan, tiers_root
from torchrelay.errors import ConfigError, RunBusy, UnsafeInput
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.shown import visible


def show(args: argparse.Namespace) -> int:
    """This node's memory tiers of this user (RUN_DIR given: that run's only), as a table or JSON."""
    tiers = scan()
    if args.run_dir is not None:
        tiers = of_run(args.run_dir.path, tiers)
    if args.json:
        doc = {"host": socket.gethostname(), "root": str(tiers_root()), "tiers": [t.as_dict() for t in tiers]}
        print(json.dumps(doc, indent=1, sort_keys=True))
        return 0
    # one line a tier (an SRE greps and counts them across nodes): state, size, age, run directory, what it holds
    print(f"memory tiers on {visible(socket.gethostname())} in {visible(tiers_root())}: {len(tiers)}")
    for tier in tiers:
        print(
            f"{tier.verdict:7} {tier.bytes / 1e6:10.1f} MB {_age(tier.age_s):>7}  {visible(tier.run_dir or '-')}"
            f"  lineage {visible(tier.lineage)}: {_held(tier)} ({visible(tier.why)})"
        )
    stale = [x for x in tiers if x.verdict == STALE]
    if stale:
        print(
            f"{len(stale)} stale ({sum(x.bytes for x in stale) / 1e6:.1f} MB): torchrelay stop --forget-memory --stale"
        )
    return 0


def free(args: argparse.Namespace) -> int:
    """Free a named run's tiers on this node (whatever they hold, unless live), or every stale one (`--stale`)."""
    if args.job or args.at_update is not None or args.before_start:
        raise ConfigError("stop --forget-memory takes no --job, --at-update or --before-start",
                          hint="free the memory tier and request a stop in two commands")  # fmt: skip
    if (args.run_dir is None) == (not args.stale):
        raise ConfigError("stop --forget-memory needs RUN_DIR or --stale, not both nor neither",
                          hint="name the run whose memory tier to free, or pass --stale for every stale one")  # fmt: skip
    tiers = scan()
    host = socket.gethostname()
    if args.run_dir is not None:
        run: RunDir = args.run_dir
        mine = of_run(run.path, tiers)
        if not mine:
            print(f"nothing of {visible(run.path)} in memory on {visible(host)}")
            return 0
        for tier in mine:  # a live or unsafe one refuses the whole request, before anything is freed
            _refuse(tier)
        for tier in mine:
            _freed(tier, forget(tier))
        return 0
    freed = left = 0
    for tier in tiers:
        if tier.verdict != STALE:
            left += 1
            continue
        try:
            freed += _freed(tier, forget(tier))
        except (RunBusy, UnsafeInput) as exc:  # became live since the scan: left, said
            left += 1
            print(f"left {visible(tier.root)}: {visible(exc.message)}")
    print(f"freed {freed / 1e6:.1f} MB on {visible(host)}; {left} tier(s) left (live or newer than durable)")
    return 0


def _refuse(tier: NodeTier) -> None:
    if tier.verdict == LIVE:
        raise RunBusy(tier.run_dir or tier.root, "train", {}, f"{tier.why} ({tier.root})")
    if tier.verdict == REFUSED:
        raise UnsafeInput(tier.why, hint="free it by hand once you know whose it is")


def _freed(tier: NodeTier, size: int) -> int:
    print(
        f"freed {visible(tier.root)} ({visible(tier.run_dir or 'no run named')}, {size / 1e6:.1f} MB; {tier.why})"
    )
    return size


def _held(tier: NodeTier) -> str:
    own = ", ".join(checkpoint_name(u) for u in tier.updates) or "none"
    reps = "; ".join(
        f"replica of node {source}: {', '.join(checkpoint_name(u) for u in ups) or 'none'}"
        for source, ups in tier.replicas.items()
    )
    return own + (f"; {reps}" if reps else "")


def _age(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def check_memory_flags(args: argparse.Namespace, verb: str) -> None:
    """`status`/`stop` without RUN_DIR is only their memory form."""
    if args.run_dir is None:
        flag = "--memory" if verb == "status" else "--forget-memory"
        raise ConfigError(
            f"{verb} needs RUN_DIR", hint=f"pass the run directory, or {flag} for this node's memory tiers"
        )
