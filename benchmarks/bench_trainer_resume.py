"""Time to the first update of a resumed Hugging Face Trainer run: torchrelay's RelayTrainer against Trainer's own
`resume_from_checkpoint`, at several resume positions of one large synthetic dataset.

    python benchmarks/bench_trainer_resume.py --samples 2000000 --at 1000,20000,100000 --repeats 2
    python benchmarks/bench_trainer_resume.py --workers 2,8 --repeats 5 [--sides relay,hf,relay-forkserver] [--src S]
    python benchmarks/bench_trainer_resume.py --workers 2,8 --repeats 3 --nproc 2

--workers: loader workers instead, with benchmarks/trainer_resume_script.py (a script that imports transformers at
its top, as users' do): time from the script's start to the end of its first update after a resume from
checkpoint-1, RelayTrainer against Trainer's resume_from_checkpoint, the same worker count, each with its default
start method (both fork here: one process, one thread); `relay-forkserver` is RelayTrainer with the forkserver a
rank with other threads (gloo's, CUDA's) gets. Each repetition runs the sides back to back, in alternating order;
the summary gives the medians of the paired ratios and differences (ratios are taken pair by pair). --src runs another torchrelay source tree
(e.g. a checkout before a change). --nproc 2: every launch (the checkpoint's and each side's resume) is `torchrun
--standalone --nproc_per_node=2` on gloo, as a distributed run's ranks are (gloo's native threads alive when the
workers start); the times are the slowest rank's, each from its own process's start.

Each measurement is a fresh process (as a relaunch is): from building the trainer to the start of the first update
after the checkpoint (its batches fetched), imports excluded. Both sides resume from a checkpoint made after one real
update whose update counter is then advanced to the position (torchrelay: checkpoint-N/ re-inventoried through the
library's own inventory functions; Trainer: trainer_state.json's global_step), because the cost of resuming depends on
the position, not on the weights. torchrelay's order jumps to the position; Trainer skips the batches before it in
its sampler. One process (world size 1), a 1-layer GPT-2 of width 32, micro-batch 8, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MAX_STEPS = 400_000  # the schedule both sides are told: far past every position measured


def _env(src: Path | None = None) -> dict[str, str]:
    # a fresh process of world size 1 (or torchrun's own): none of the launcher's variables of the caller, whose
    # LOCAL_RANK would make the Trainer start a process group on the caller's MASTER_PORT
    drop = ("TORCHRELAY_", "SLURM_", "RANK", "WORLD_", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "GROUP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    src = src or HERE.parents[1] / "src"
    env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


# ------------------------------------------------------------------------------------------ the child processes
def _child(phase: str, out: Path, samples: int, at: int) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    marks: dict[str, float] = {}

    class FirstUpdate(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks.setdefault("first_update", time.perf_counter())
            marks.setdefault("global_step", state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            control.should_training_stop = True  # one update is all this measures

    relay = phase.startswith("relay")
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        per_device_train_batch_size=8,
        max_steps=MAX_STEPS,
        learning_rate=1e-3,
        save_strategy="steps" if phase == "hf-make" else "no",
        save_steps=1,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=1234,
    )
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    data = Tokens(samples)
    t0 = time.perf_counter()
    if relay:
        from torchrelay.integrations.transformers import RelayOptions, RelayTrainer

        options = RelayOptions(dataset_fingerprint=f"synthetic-tokens-v1:{samples}")
        trainer: Any = RelayTrainer(model=model, args=args, train_dataset=data, relay=options)
        if phase == "relay-resume":
            trainer.add_callback(FirstUpdate())
        marks["built"] = time.perf_counter()
        trainer.train()
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(FirstUpdate())
        marks["built"] = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(out / f"checkpoint-{at}") if phase == "hf-resume" else None)
    report = {k: round(v - t0, 4) if isinstance(v, float) else v for k, v in marks.items()}
    print("RESULT " + json.dumps(report), flush=True)


def _run(phase: str, out: Path, samples: int, at: int = 0) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(HERE),
        "--child",
        phase,
        "--out",
        str(out),
        "--samples",
        str(samples),
        "--at",
        str(at),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise SystemExit(
            f"{phase} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


# ------------------------------------------------------------------------------------------ advancing a checkpoint
def _advance_relay(run: Path, at: int) -> None:
    """checkpoint-1 -> checkpoint-<at>: the loop's update counter moved, the inventory rewritten by the library."""
    from torchrelay.checkpoint.inventory import (
        INVENTORY,
        inventory_entries,
        list_files,
        read_inventory,
        write_inventory,
    )
    from torchrelay.checkpoint.state import RELAY_STATE

    src, dst = run / "checkpoint-1", run / f"checkpoint-{at}"
    state = json.loads((src / RELAY_STATE).read_text())
    state["loop"].update(update=at, samples_consumed=at * state["loop"]["global_batch"])
    (src / RELAY_STATE).write_text(json.dumps(state, indent=1, sort_keys=True))
    info = {k: v for k, v in read_inventory(src).items() if k not in ("format", "files")}
    info["update"] = at
    entries = inventory_entries(src, [f for f in list_files(src) if f != INVENTORY])
    write_inventory(src, entries, **info)
    src.rename(dst)


def _advance_hf(out: Path, at: int) -> None:
    src, dst = out / "checkpoint-1", out / f"checkpoint-{at}"
    shutil.copytree(src, dst)
    state = json.loads((dst / "trainer_state.json").read_text())
    state["global_step"] = at
    (dst / "trainer_state.json").write_text(json.dumps(state))


# ------------------------------------------------------------------------------------------ positioning alone
def position_costs(samples: int, positions: list[int]) -> list[dict[str, float]]:
    """Seconds to the first batch index list at each position, nothing else: Trainer's sampler with accelerate's
    skip_first_batches (what resume_from_checkpoint uses) against torchrelay's order (what RelayTrainer uses)."""
    import torch
    from accelerate.data_loader import skip_first_batches
    from transformers import Trainer, TrainingArguments

    from torchrelay.data.loader import RankBatches
    from torchrelay.data.order import GlobalOrder

    class Index(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return samples

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": torch.tensor([i])}

    tmp = tempfile.mkdtemp(prefix="bench-position-")
    args = TrainingArguments(output_dir=tmp, use_cpu=True, per_device_train_batch_size=8, report_to="none")
    model = torch.nn.Linear(1, 1)
    loader = Trainer(model=model, args=args, train_dataset=Index()).get_train_dataloader()
    out = []
    for at in positions:
        t0 = time.perf_counter()
        next(iter(skip_first_batches(loader, at).batch_sampler))
        hf = time.perf_counter() - t0
        t0 = time.perf_counter()
        order = GlobalOrder(num_samples=samples, seed=1234, global_batch=8)
        next(iter(RankBatches(order, at, at + 1, 0, 1, 8, 1)))
        relay = time.perf_counter() - t0
        out.append({"at": at, "hf_s": round(hf, 4), "relay_s": round(relay, 4)})
        print(
            f"positioning at update {at:>7}: Trainer's sampler skip {hf:7.3f}s   torchrelay's order {relay:7.3f}s"
        )
    shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ loader workers
SCRIPT = HERE.with_name("trainer_resume_script.py")


def _script(
    code: Path,
    out: Path,
    workers: int,
    relay: bool,
    resume: bool,
    src: Path | None,
    context: str | None = None,
    nproc: int = 1,
) -> dict[str, Any]:
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [*(torchrun if nproc > 1 else [sys.executable]), str(code / SCRIPT.name)]
    cmd += ["--out", str(out), "--workers", str(workers)]
    cmd += ["--relay"] * relay + ["--resume"] * resume + ["--context", context] * (context is not None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(src), timeout=3600)
    # the ranks share one pipe: a line of one may run into another's
    lines = re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)
    if len(lines) < nproc or proc.returncode != 0:
        raise SystemExit(
            f"{cmd} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    ranks = [dict(json.loads(ln)) for ln in lines]
    row = max(ranks, key=lambda r: r["first_update_done"])  # the slowest rank: the others wait for it
    starts = sorted({ln.split("] ", 1)[1] for ln in proc.stdout.splitlines() if "] LOADER_WORKERS " in ln})
    if starts:
        row["workers_started"] = starts
    return row


SIDES = {  # name: (RelayTrainer?, multiprocessing context asked for)
    "relay": (True, None),  # the default: forked workers here (one process, one thread)
    "hf": (False, None),  # Trainer's own resume_from_checkpoint, DataLoader's default (fork)
    "relay-forkserver": (True, "forkserver"),  # what a rank with other threads (gloo, CUDA) gets
}


def worker_costs(
    counts: list[int],
    repeats: int,
    src: Path | None,
    sides: list[str],
    keep: Path | None = None,
    nproc: int = 1,
) -> list[dict[str, Any]]:
    """Seconds from the script's start to its first update done after a resume, per worker count and side: the
    sides of one repetition back to back, in an order that alternates (whoever goes first meets another load).
    keep: the rows so far are written there after each pair (a long run on a loaded machine)."""
    from torchrelay.policy.stop import write_request

    base = Path(tempfile.mkdtemp(prefix="bench-trainer-workers-"))
    rows = []
    # The script in a repository of its own: its commit is the runs' code identity, whatever this checkout does.
    code = base / "code"
    code.mkdir()
    shutil.copyfile(SCRIPT, code / SCRIPT.name)
    git = ["git", "-C", str(code), "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "bench"]):
        subprocess.run([*git, *step], check=True, capture_output=True)
    try:
        made = {True: base / "relay", False: base / "hf"}
        made[True].mkdir()
        write_request(made[True], at_update=1, reason="benchmark")
        _script(code, made[True], 0, True, False, src, nproc=nproc)
        _script(code, made[False], 0, False, False, src, nproc=nproc)
        for rep in range(repeats):
            for workers in counts:
                row: dict[str, Any] = {
                    "workers": workers,
                    "nproc": nproc,
                    "rep": rep,
                    "load": os.getloadavg()[0],
                }
                for side in sides if rep % 2 == 0 else sides[::-1]:
                    relay, context = SIDES[side]
                    run = base / f"{side}-{workers}-{rep}"
                    shutil.copytree(made[relay], run)
                    if relay:
                        write_request(run, at_update=2, reason="benchmark")
                    row[side] = _script(code, run, workers, relay, True, src, context, nproc)
                    assert row[side]["global_step"] == 2, row
                    shutil.rmtree(run, ignore_errors=True)
                row["load_after"] = os.getloadavg()[0]
                rows.append(row)
                if keep is not None:
                    keep.write_text(json.dumps({"workers": rows}, indent=1))
                print(
                    f"{workers} workers, load {row['load']:.1f}: "
                    + "   ".join(
                        f"{side} {row[side]['first_update_done']:6.2f}s "
                        f"(train() {row[side]['first_update_done'] - row[side]['train']:5.2f}s"
                        f"{', ' + ' '.join(row[side]['workers_started']) if 'workers_started' in row[side] else ''})"
                        for side in sides
                    ),
                    flush=True,
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def summary(rows: list[dict[str, Any]], sides: list[str]) -> list[str]:
    """Per worker count and side against Trainer: medians of each side's times, of the paired ratios and of the
    paired differences (what torchrelay adds, whatever the load did to both), from three starts: the script's
    (end to end), the end of its imports and model (the same code on both sides: what differs), `train()`."""
    lines = []
    spans = {"end to end": None, "after the imports": "imported", "inside train()": "train"}
    for workers in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == workers]
        load = statistics.median(r["load"] for r in mine)
        for side in [s for s in sides if s != "hf"]:
            parts = []
            for span, mark in spans.items():
                pairs = [
                    [r[x]["first_update_done"] - (r[x][mark] if mark else 0.0) for x in (side, "hf")]
                    for r in mine
                ]
                parts.append(
                    f"{span} {statistics.median(a for a, _ in pairs):.2f}s vs "
                    f"{statistics.median(b for _, b in pairs):.2f}s, ratio "
                    f"{statistics.median(a / b for a, b in pairs):.2f}, difference "
                    f"{statistics.median(a - b for a, b in pairs):+.2f}s"
                )
            lines.append(
                f"{workers} workers, {mine[0].get('nproc', 1)} rank(s), {len(mine)} pairs, load {load:.1f}, "
                f"{side} vs Trainer: " + "; ".join(parts)
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--at", default="1000,20000,100000")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--workers", default=None, help="loader worker counts, e.g. 2,8 (see above)")
    parser.add_argument("--src", type=Path, default=None, help="--workers: the torchrelay source tree to run")
    parser.add_argument(
        "--sides", default="relay,hf", help=f"--workers: which of {', '.join(SIDES)} (hf is the peer)"
    )
    parser.add_argument(
        "--nproc", type=int, default=1, help="--workers: ranks a launch has (>1: torchrun, gloo)"
    )
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.out, args.samples, int(args.at))
        return
    if args.workers:
        sides = args.sides.split(",")
        rows = worker_costs(
            [int(x) for x in args.workers.split(",")], args.repeats, args.src, sides, args.json, args.nproc
        )
        for line in summary(rows, sides):
            print(line)
        if args.json:
            args.json.write_text(json.dumps({"workers": rows}, indent=1))
        return
    positions = [int(x) for x in args.at.split(",")]
    positioning = position_costs(args.samples, positions)
    base = Path(tempfile.mkdtemp(prefix="bench-trainer-resume-"))
    try:
        made = base / "relay-made"
        from torchrelay.policy.stop import write_request

        made.mkdir()
        write_request(made, at_update=1, reason="benchmark")
        _run("relay-make", made, args.samples)
        hf_made = base / "hf"
        _run("hf-make", hf_made, args.samples)
        rows = []
        for at in positions:
            _advance_hf(hf_made, at)
            for rep in range(args.repeats):
                run = base / f"relay-{at}-{rep}"
                shutil.copytree(made, run)
                _advance_relay(run, at)
                write_request(run, at_update=at + 1, reason="benchmark")
                relay = _run("relay-resume", run, args.samples, at)
                hf = _run("hf-resume", hf_made, args.samples, at)
                assert relay["global_step"] == hf["global_step"] == at, (relay, hf)
                rows.append({"at": at, "rep": rep, "relay": relay, "hf": hf})
                print(
                    f"update {at:>7}: torchrelay {relay['first_update']:7.3f}s (built {relay['built']:.3f}s)   "
                    f"Trainer resume_from_checkpoint {hf['first_update']:7.3f}s",
                    flush=True,
                )
        if args.json:
            doc = {"samples": args.samples, "positioning": positioning, "rows": rows}
            args.json.write_text(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
