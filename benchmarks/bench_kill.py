"""Kills, measured: SIGKILL a whole 2-rank torchrun job (launcher, ranks, loader workers) at many random moments,
most of them inside a checkpoint save, resume every time, and prove each run ends bit for bit where the
uninterrupted run ends, with every sample seen exactly once.

    PYTHONPATH=src:tests python benchmarks/bench_kill.py --kills 200 --seed 1 --out /tmp/bench-kill

One launch is killed at most once; the next launch (the same command, `--config` included, as a batch script
would repeat it) continues the same run directory, so one run directory lives through many kills. When a run
finishes, its final checkpoint is compared tensor by tensor with an uninterrupted run of the same config, its
logs line by line, its ledger proved, and a new run directory takes the next kills.

Where a kill lands (each launch draws one plan):
  save     a random delay after the n-th `.tmp-checkpoint-*` of the launch appears (inotify), within about one
           save's duration: most of these land inside the save;
  update   a random delay after the n-th checkpoint of the launch is committed (inside the next update or save);
  startup  a random delay after the launch (torchrun start, imports, `Run.open`, restore);
  create   (first launch of a run directory only) a random delay after the run directory's `data/` appears,
           i.e. while `Run.open` creates the run.
A kill is "inside a save" when a `.tmp-checkpoint-*` directory of that launch exists once every process is dead.

Per kill the next launch that opens the run is judged: it must resume from the newest complete checkpoint on disk
(else a corrupt resume), must not refuse, and must have removed every temporary the kill left (stale
`.tmp-checkpoint-*`/`.deleting-*` directories, half-written files, a lock still held). Prints one table;
`--out DIR/kills.json` holds every kill.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the campaign, the helpers and kill_verbs are test support

from helpers import clean_env, make_code_repo, make_data, torchrun_cmd, write_config  # noqa: E402
from kill_campaign import Campaign  # noqa: E402


def table(s: dict[str, Any], wall_s: float) -> str:
    phases = ", ".join(f"{n} {p}" for p, n in sorted(s["inside_save_phase"].items()))
    rows = [
        ("kills (launcher + 2 ranks + loader workers, SIGKILL)", s["kills"]),
        ("  inside a save (`.tmp-checkpoint-*` present at death)", f"{s['inside_save']} ({phases})"),
        (
            "  plans: after a save began / an update / the launch",
            ", ".join(f"{v} {k}" for k, v in s["plans"].items()),
        ),
        ("  before the killed launch had opened the run", s["before_open"]),
        ("  while creating the run, before its contract", s["creation_interrupted"]),
        ("resumed from the newest complete checkpoint", s["resumed_from_newest_complete"]),
        ("corrupt resumes (wrong checkpoint, failed, or not bit-exact) — goal 0", s["corrupt_resumes"]),
        ("refusals — goal 0", s["refusals"]),
        ("leftovers after the next open / at the end — goal 0", s["leftovers"]),
        ("temporaries the next open cleaned", s["temporaries_cleaned"]),
        ("/dev/shm semaphores the killed jobs left (host, not the run)", s["shm_left"]),
        (
            "runs finished / bit-exact (tensors + logs) / ledger exactly once",
            f"{s['runs_finished']}/{s['runs']} / {s['runs_bit_exact']} / {s['runs_ledger_ok']}",
        ),
        ("torchrun launches / wall time", f"{s['launches']} / {wall_s / 60:.1f} min"),
    ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"| {a:<{width}} | {b} |" for a, b in [("measure", "value"), ("---", "---"), *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-kill"))
    parser.add_argument("--updates", type=int, default=30, help="total_updates of each run")
    parser.add_argument(
        "--verbs", type=int, default=0, metavar="N",
        help="instead: kill pack, prepare, validate and export N times each (tests/kill_verbs.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    code = make_code_repo(args.out / "code")
    root, manifest = make_data(args.out / "data")
    config = write_config(args.out / "lm.yaml", manifest, root, total_updates=args.updates)
    if args.verbs:
        return verb_kills(args.out, code, config, args.verbs, args.seed)
    sets = {"save_every": 1, "num_workers": 1}
    t0 = time.time()
    camp = Campaign(args.out, code, config, sets=sets, seed=args.seed, log=lambda s: print(s, flush=True))
    camp.run(args.kills)
    wall = time.time() - t0
    summary = camp.summary()
    doc = {
        "summary": summary,
        "wall_s": round(wall, 1),
        "updates": args.updates,
        "seed": args.seed,
        "ends": [asdict(e) for e in camp.ends],
        "kills": [asdict(k) for k in camp.kills],
    }
    (args.out / "kills.json").write_text(json.dumps(doc, indent=1))
    print(table(summary, wall))
    print(f"every kill: {args.out / 'kills.json'}")
    bad = summary["corrupt_resumes"] or summary["refusals"] or summary["leftovers"]
    return 1 if bad or summary["runs_bit_exact"] != summary["runs"] else 0


def verb_kills(out: Path, code: Path, config: Path, kills: int, seed: int) -> int:
    """Train one run to its end, then kill each writing verb `kills` times on copies of it (kill_verbs.py)."""
    from kill_verbs import VerbCampaign
    from kill_verbs import table as verb_table

    run = out / "run"
    done = subprocess.run(
        torchrun_cmd(code, run, config=config), capture_output=True, text=True, env=clean_env(), cwd=code
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    t0 = time.time()
    camp = VerbCampaign(out / "verbs", run, code, seed=seed, log=lambda s: print(s, flush=True))
    camp.run(kills)
    summary = camp.summary()
    doc = {"summary": summary, "wall_s": round(time.time() - t0, 1), "seed": seed}
    doc["kills"] = [asdict(k) for k in camp.kills]
    (out / "verb_kills.json").write_text(json.dumps(doc, indent=1))
    print(verb_table(summary))
    print(f"wall {doc['wall_s']} s; every kill: {out / 'verb_kills.json'}")
    return 1 if any(s["problems"] for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
