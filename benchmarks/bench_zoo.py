"""Time `torchrelay audit` of the zoo: each member alone, then all of them composed in one script.

Every audit runs examples/zoo/zoo.py under torchrun (2 ranks), 12 updates, stops after 1, 6 and 11 (the default
placement: early, middle, late; `--updates`, `--stops`), state compared at the first checkpoint after each resume
and at the end.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_zoo.py                  # CPU members, gloo
    PYTHONPATH=src python benchmarks/bench_zoo.py --members syncbn,bn_ddp --device cuda  # on 2 GPUs, NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import machine

from torchrelay.audit import AuditSpec, run_audit

ZOO = Path(__file__).resolve().parents[1] / "examples" / "zoo" / "zoo.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def audit(member: str, work: Path, device: str, updates: int = 12, stops: int = 3) -> dict[str, object]:
    os.environ["ZOO_DEVICE"] = device
    launch = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5", str(ZOO)]
    spec = AuditSpec(
        launch=[*launch, "--member", member], updates=updates, stops=stops, work_dir=work, timeout_s=900
    )
    started = time.monotonic()
    verdict = run_audit(spec)
    return {
        "member": member,
        "equal": verdict.equal,
        "seconds": round(time.monotonic() - started, 1),
        "stops": verdict.stops,
        "checkpoints": [c["update"] for c in verdict.checkpoints],
        "tensors": verdict.tensors_compared,
        "cause": verdict.cause,
    }


def main() -> int:
    sys.path.insert(0, str(ZOO.parent))
    import zoo  # type: ignore[import-not-found]

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--members", default=",".join(zoo.CPU_MEMBERS), help="members to audit alone, comma-separated"
    )
    ap.add_argument("--combined", default="all", help="the composed run to audit last ('' to skip)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--updates", type=int, default=12, help="updates of each audited run")
    ap.add_argument("--stops", type=int, default=3, help="stops of each audit")
    args = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="torchrelay-bench-zoo-") as tmp:
        names = [m for m in args.members.split(",") if m] + ([args.combined] if args.combined else [])
        for i, member in enumerate(names):
            row = audit(member, Path(tmp) / f"w{i}", args.device, args.updates, args.stops)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nmachine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print("| member | verdict | audit seconds | tensors compared |\n|---|---|---|---|")
    for row in rows:
        verdict = "EQUAL" if row["equal"] else f"NOT EQUAL ({row['cause']})"
        print(f"| {row['member']} | {verdict} | {row['seconds']} | {row['tensors']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
