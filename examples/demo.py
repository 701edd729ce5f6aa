"""The torchrelay demo: stop a real training run twice, continue it, prove it, show it.

1. make a data set from this machine's Python standard library source;
2. launch the example LM under torchrun (2 ranks, gloo) with a stop request for update 20 (`torchrelay stop
   --at-update 20 --before-start`): it saves a complete checkpoint there and stops (exit code 4);
3. launch it again with 2 loader workers and a time budget too short for the rest: it resumes, and stops while a
   checkpoint still fits (exit code 3). The budget counts from torchrun's start, so it is this machine's start-up
   (measured on the first launch) plus a few seconds of training; the updates are paced (`params.min_update_s`, a
   runtime param: slower, never different) so that the rest would take 1.5x the whole budget, and the budget lands
   mid-run on any machine, however fast its start-up;
4. launch it a third time: it resumes and finishes;
5. train the same run uninterrupted and compare every model and optimizer tensor bit for bit;
6. show `torchrelay status`, `torchrelay ledger` and `torchrelay report`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from rich.console import Console

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
con = Console()


def launch(
    run_dir: Path,
    log: Path,
    config: Path | None = None,
    env: dict[str, str] | None = None,
    sets: tuple[str, ...] = (),
) -> int:
    args = ["--run-dir", str(run_dir)]
    if config:
        args += ["--config", str(config)]
    for item in sets:
        args += ["--set", item]
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(HERE / "train_lm.py"), *args]
    shown = " ".join(["torchrun", "--nproc_per_node=2", "examples/train_lm.py", *args])
    extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    con.print(f"[bold]$ {extra + ' ' if extra else ''}{shown}[/]", soft_wrap=True)
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=REPO
        )
    for line in log.read_text().splitlines():
        if any(
            key in line for key in ("SCHEDULE_GATE_PASS", "TRAINING_CONTRACT", "[torchrelay]", "exitcode  :")
        ):
            con.print(f"  {line.strip()}", soft_wrap=True, highlight=False)
    con.print(f"  [dim]({time.time() - started:.1f} s, full log in {log})[/]")
    return rc


def cli(*args: str) -> int:
    con.print(f"[bold]$ torchrelay {' '.join(args)}[/]")
    return subprocess.call([sys.executable, "-m", "torchrelay", *args], cwd=REPO)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "demo-run")
    parser.add_argument("--updates", type=int, default=60)
    parser.add_argument("--stop-at", type=int, default=20, help="update the first launch is asked to stop at")
    parser.add_argument(
        "--budget", type=float, default=6.0, help="seconds the second launch may train, beyond its start-up"
    )
    args = parser.parse_args()
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)

    sys.path.insert(0, str(HERE))
    import prepare_data

    con.rule("1. data: the Python standard library's source, as bytes")
    root, manifest = prepare_data.build(out / "data", files=12, max_bytes=128)
    n = len(manifest.read_text().splitlines())
    con.print(f"data root {root}, manifest {manifest}: {n:,} samples")
    cfg = yaml.safe_load((HERE / "lm.yaml").read_text())
    cfg.update(manifest=str(manifest), data_root=str(root), total_updates=args.updates, save_every=20)
    config = out / "lm.yaml"
    config.write_text(yaml.safe_dump(cfg))

    run = out / "run"
    con.rule(f"2. first launch, asked to stop at update {args.stop_at}")
    cli("stop", str(run), "--at-update", str(args.stop_at), "--before-start")
    launched = time.time()
    launch(run, out / "logs" / "launch-1.log", config)
    from torchrelay.records.history import read_history

    # The budget covers everything from torchrun's start: start-up (twice the first launch's, for slack) + training.
    startup = max(0.0, float(read_history(run)[0]["started"]) - launched)
    budget = round(2 * startup + args.budget, 1)
    con.rule(
        f"3. second launch: 2 loader workers, a {budget:g} s budget (start-up {startup:.1f} s); "
        "stops while a checkpoint still fits"
    )
    # Paced by the budget, not by a fixed time: a launch that starts faster than the first one (loader workers
    # forked, a warm page cache) must still meet its deadline before the schedule's end.
    pace = max(0.25, round(1.5 * budget / (args.updates - args.stop_at), 2))
    paced = ("num_workers=2", f"params.min_update_s={pace}")
    launch(run, out / "logs" / "launch-2.log", env={"TORCHRELAY_BUDGET_S": str(budget)}, sets=paced)
    con.rule("4. third launch: resumes from the newest complete checkpoint and finishes")
    rc = launch(run, out / "logs" / "launch-3.log", sets=("params.min_update_s=0",))
    if rc != 0:
        con.print(f"[red]the third launch failed (exit {rc})[/]")
        return rc

    ended = [seg["ended"] for seg in read_history(run)]
    if ended != ["request", "budget", "finished"]:
        con.print(f"[red]the segments ended {ended}, not request, budget, finished[/]")
        return 1

    con.rule("5. the same run, uninterrupted, for comparison")
    ref = out / "reference"
    launch(ref, out / "logs" / "reference.log", config)
    from torchrelay.checkpoint.reader import load_tensors

    a = load_tensors(run / f"checkpoint-{args.updates}")
    b = load_tensors(ref / f"checkpoint-{args.updates}")
    equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    nbytes = sum(t.numel() * t.element_size() for t in a.values())
    verdict = "[green]bit-for-bit EQUAL[/]" if equal else "[red]NOT equal[/]"
    con.print(f"stopped + continued vs uninterrupted: {len(a)} tensors ({nbytes / 1e6:.1f} MB) {verdict}")

    con.rule("6. the run")
    cli("status", str(run))
    cli("ledger", str(run))
    cli("report", str(run), "--out", str(out / "report"))
    if not (out / "report" / "report.html").exists():
        con.print("[red]the report was not written[/]")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
