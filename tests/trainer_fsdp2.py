"""Hugging Face Trainer with FSDP2 through accelerate, as a torchrelay run: bit-exact across stops, on GPUs with NCCL.

    PYTHONPATH=src python3 benchmarks/gpu_trainer_fsdp2.py --out /tmp/trainer-fsdp2   (runs this file)

A tiny Llama causal LM built from a config (random weights, nothing downloaded) is fine-tuned by `RelayTrainer` with
TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2, ...}): accelerate shards it with `fully_shard` (one
FSDP unit per decoder layer) and torchrelay saves and restores the model and optimizer through DCP's
get_state_dict/set_state_dict on the sharded module, each rank writing its own shards. For each precision (fp32, and
bf16 through FSDP2's MixedPrecisionPolicy) it runs

    uninterrupted  12 updates, 0 loader workers
    stopped        a request file after update 3 (early); SIGTERM once update 9 is logged (late), 2 workers;
                   finished with 1 worker

and compares every parameter and optimizer tensor of checkpoint-12 bit for bit (torch.equal), the per-rank metrics
and exposures, and proves the exposure ledger (every sample exactly once per epoch). It prints one PASS/FAIL line per
precision and a final `TRAINER_FSDP2 PASS` or `TRAINER_FSDP2 FAIL`, writes <out>/result.json, and exits 0 only on
PASS. Needs only PYTHONPATH=src (torch, transformers, accelerate, numpy, safetensors, pyyaml installed).

`--device cpu` runs the same on CPU with gloo: accelerate ignores an FSDP plugin without an accelerator, so the
worker turns it on itself (see _fsdp_on_cpu); the suite uses this path (tests/test_trainer_fsdp2.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
UPDATES = 12  # 8 updates an epoch (64 samples, global batch 8): the schedule crosses into a second epoch
EARLY, LATE = 3, 9  # the request stops after EARLY; SIGTERM lands once LATE is logged
TIMEOUT_S = 240  # one launch at most; the script's whole wall time is bounded by --deadline


# ------------------------------------------------------------------ the worker: one rank of one launch


class Tokens(torch.utils.data.Dataset):  # at module level: the loader's forkserver workers unpickle it
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _fsdp_on_cpu() -> None:
    """Let accelerate apply an FSDP plugin on CPU (gloo): its state keeps MULTI_CPU and drops the plugin otherwise.

    FSDP2's fully_shard runs on CPU tensors with a gloo mesh; only accelerate's choice of distributed type stands in
    the way, so the type is set to FSDP once the state has made its own choice."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def worker(opt: argparse.Namespace) -> int:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from torchrelay.integrations.transformers import RelayTrainer

    cpu = opt.device == "cpu"
    if cpu:
        _fsdp_on_cpu()
    else:
        # deterministic CUDA kernels where they exist (cuBLAS's workspace is set by the driver); warn_only: an op
        # without one must not end the run, the comparison says whether the bits agree
        torch.use_deterministic_algorithms(True, warn_only=True)

    class Pace(TrainerCallback):  # updates paced so that the late signal lands before the schedule ends
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            time.sleep(opt.pace)

    args = TrainingArguments(
        output_dir=opt.run_dir,
        use_cpu=cpu,
        fsdp=True,
        fsdp_config={
            "version": 2,
            "reshard_after_forward": True,
            "transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        },
        bf16=opt.precision == "bf16",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=UPDATES,
        learning_rate=1e-3,
        warmup_steps=2,
        weight_decay=0.01,
        max_grad_norm=1.0,
        save_steps=4,
        logging_steps=1,
        dataloader_num_workers=opt.workers,
        report_to="none",
        disable_tqdm=True,
        seed=1234,
    )
    try:
        torch.manual_seed(args.seed)
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
            attn_implementation="eager",  # the same kernels every launch
        )
        model = LlamaForCausalLM(config)
        trainer = RelayTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Pace()])
        if not trainer.is_fsdp_enabled:
            raise SystemExit("FSDP_NOT_ENABLED: accelerate did not take the FSDP plugin")
        trainer.train()
        if trainer.relay.rank == 0:
            from torch.distributed.fsdp import FSDPModule

            units = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
            print(f"FSDP2_UNITS {units} {type(trainer.model_wrapped).__name__}", flush=True)
        if dist.is_initialized():
            dist.barrier()  # no rank leaves while another still communicates
        return trainer.relay.exit_code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------ the driver


def _env(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRELAY_", "ACCELERATE_", "FSDP_"))}
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCHRELAY_CHECK_EVERY": "1"})
    if device == "cuda":
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


def _cmd(opt: argparse.Namespace, run_dir: Path, precision: str, workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={opt.nproc}",
        "--monitor_interval=0.5",
        str(Path(__file__).resolve()),
        "--worker",
        "--run-dir",
        str(run_dir),
        "--device",
        opt.device,
        "--precision",
        precision,
        "--workers",
        str(workers),
        "--pace",
        str(opt.pace),
    ]


def _seconds_left(opt: argparse.Namespace) -> float:
    """A launch's time limit: TIMEOUT_S, or less where the whole script's --deadline comes first."""
    end = getattr(opt, "end_at", None)
    return TIMEOUT_S if end is None else max(1.0, min(TIMEOUT_S, end - time.time()))


def _launch(
    opt: argparse.Namespace, run_dir: Path, precision: str, workers: int, log: Path, sigterm_at: int = 0
) -> int:
    """One torchrun launch to its end; with sigterm_at, the torchrun agent is sent SIGTERM once rank 0 has logged
    that update (the run saves at the next boundary). Past the time limit the whole process group is killed and
    124 returned, so no rank outlives the script."""
    limit = _seconds_left(opt)
    with log.open("w") as out:
        proc = subprocess.Popen(
            _cmd(opt, run_dir, precision, workers),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(opt.device),
            cwd=REPO,
            start_new_session=True,
        )
        try:
            deadline = time.time() + limit
            if sigterm_at:
                while proc.poll() is None and _logged_update(run_dir) < sigterm_at and time.time() < deadline:
                    time.sleep(0.05)
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGTERM)
            return proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            out.write(f"\n[gpu_trainer_fsdp2] launch killed after {limit:.0f} s\n")
            return 124
        finally:
            _end_group(proc)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of a launch's process group (ranks, loader workers), and wait until it is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if proc.poll() is None:
        proc.wait()
    for _ in range(200):  # the ranks are the agent's children: they go a moment after it
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def _logged_update(run_dir: Path) -> int:
    path = run_dir / "train" / "metrics-rank0.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return int(json.loads(lines[-1])["update"]) if lines else 0


def _tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def _segments(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "history.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _metrics(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (run_dir / "train" / f"metrics-rank{rank}.jsonl").read_text().splitlines()
    timing = ("update_time", "time", "samples_per_s")
    return [{k: v for k, v in json.loads(x).items() if k not in timing} for x in lines if x.strip()]


def _exposures(run_dir: Path, rank: int) -> list[str]:
    return (run_dir / "train" / f"exposures-rank{rank}.jsonl").read_text().splitlines()


def compare(straight: Path, stopped: Path, nproc: int) -> dict[str, Any]:
    """Every tensor of the two final checkpoints torch.equal, the logs equal, the stopped run's ledger proved."""
    from torchrelay.checkpoint.reader import load_tensors
    from torchrelay.ledger.exposure import prove

    a = load_tensors(straight / f"checkpoint-{UPDATES}")
    b = load_tensors(stopped / f"checkpoint-{UPDATES}")
    differ = sorted(k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k]))
    ledger = prove(stopped)
    optim = [k for k in a if k.startswith("optim")]
    # where the runs part (if they do): at or before EARLY, before any resume, says the kernels are not
    # deterministic; after it, that a resume restored something other than what was saved
    first_diff = next(
        (
            x.get("update")
            for x, y in zip(_metrics(straight, 0), _metrics(stopped, 0), strict=False)
            if x != y
        ),
        None,
    )
    return {
        "tensors": len(a),
        "optimizer_tensors": len(optim),
        "bytes": sum(t.numel() * t.element_size() for t in a.values()),
        "same_keys": a.keys() == b.keys(),
        "differ": differ[:10],
        "all_equal": a.keys() == b.keys() and not differ,
        "metrics_equal": all(_metrics(straight, r) == _metrics(stopped, r) for r in range(nproc)),
        "exposures_equal": all(_exposures(straight, r) == _exposures(stopped, r) for r in range(nproc)),
        "first_metric_diff_update": first_diff,
        "ledger_ok": bool(ledger.ok),
        "ledger": {"exposures": ledger.exposures, "distinct": ledger.distinct, "repeats": ledger.repeats},
    }


def one_precision(opt: argparse.Namespace, precision: str) -> dict[str, Any]:
    """Uninterrupted versus stopped twice (request early, SIGTERM late) and resumed with other worker counts."""
    from torchrelay.policy.stop import write_request

    base = opt.out / precision  # the logs
    straight, stopped = opt.work / precision / "straight", opt.work / precision / "stopped"
    base.mkdir(parents=True)
    result: dict[str, Any] = {"precision": precision, "pass": False}
    t0 = time.time()
    rc = _launch(opt, straight, precision, 0, base / "straight.log")
    result["straight_rc"] = rc
    if rc != 0 or not (straight / f"checkpoint-{UPDATES}").is_dir():
        result["error"] = f"uninterrupted run failed (exit {rc})"
        result["log_tail"] = _tail(base / "straight.log")
        return result
    units = [
        line for line in (base / "straight.log").read_text().splitlines() if line.startswith("FSDP2_UNITS")
    ]
    result["fsdp2"] = units[0] if units else None
    # 1. a request file, honoured after update EARLY
    stopped.mkdir(parents=True)
    write_request(stopped, at_update=EARLY)
    rc1 = _launch(opt, stopped, precision, 0, base / "stop1.log")
    # 2. SIGTERM late in the schedule, 2 loader workers
    rc2 = _launch(opt, stopped, precision, 2, base / "stop2.log", sigterm_at=LATE)
    # 3. finished with 1 loader worker
    rc3 = _launch(opt, stopped, precision, 1, base / "stop3.log")
    segs = _segments(stopped)
    result["exits"] = [rc1, rc2, rc3]
    result["segments"] = [
        {k: s.get(k) for k in ("first_update", "last_update", "resumed_from", "ended", "runtime_changes")}
        for s in segs
    ]
    ended = [s.get("ended") for s in segs]
    result["wall_s"] = round(time.time() - t0, 1)
    if ended != ["request", "signal", "finished"] or rc3 != 0:
        result["error"] = f"the stopped run's segments ended {ended} (exits {[rc1, rc2, rc3]})"
        result["log_tail"] = "\n".join(_tail(base / f"stop{i}.log", 2500) for i in (1, 2, 3))
        return result
    if not EARLY < segs[1]["last_update"] < UPDATES:
        result["error"] = (
            f"the signal stopped at update {segs[1]['last_update']}, not inside ({EARLY}, {UPDATES})"
        )
        return result
    result.update(compare(straight, stopped, opt.nproc))
    # ops torch warned about under use_deterministic_algorithms(warn_only=True): the suspects if the bits differ
    warned = {
        line.strip()[:200]
        for log in base.glob("*.log")
        for line in log.read_text(errors="replace").splitlines()
        if "does not have a deterministic implementation" in line
    }
    result["nondeterministic_ops"] = sorted(warned)
    ledger = result["ledger"]
    result["pass"] = bool(
        result["all_equal"]
        and result["optimizer_tensors"] > 0
        and result["metrics_equal"]
        and result["exposures_equal"]
        and result["ledger_ok"]
        and ledger["exposures"] == UPDATES * 8
        and ledger["repeats"] == 0
    )
    return result


def _summary(res: dict[str, Any]) -> str:
    """One line for one precision: PASS/FAIL and what was compared (what differs, where it fails)."""
    verdict = "PASS" if res.get("pass") else "FAIL"
    try:
        if "tensors" not in res:
            return f"{verdict}: {res.get('error', '')}"
        segs = [(s["first_update"], s["last_update"], s["ended"]) for s in res["segments"]]
        line = (
            f"{verdict}: {res['tensors']} tensors ({res['optimizer_tensors']} optimizer) "
            f"torch.equal={res['all_equal']}, metrics {res['metrics_equal']}, ledger {res['ledger_ok']} "
            f"{res['ledger']}, segments {segs}, {res.get('fsdp2')}, {res.get('wall_s')} s"
        )
        if res["differ"] or not res["metrics_equal"]:
            line += (
                f"; differ e.g. {res['differ']}; metrics first differ at update {res['first_metric_diff_update']}; "
                f"non-deterministic ops warned: {res.get('nondeterministic_ops')}"
            )
        return line
    except Exception:  # the JSON holds it all; the line must not end the script
        return f"{verdict}: {json.dumps(res, default=str)[:3000]}"


def driver(opt: argparse.Namespace) -> int:
    if opt.device == "cuda" and torch.cuda.device_count() < opt.nproc:
        print(f"TRAINER_FSDP2 FAIL: {opt.nproc} GPUs needed, {torch.cuda.device_count()} visible")
        return 1
    opt.out.mkdir(parents=True, exist_ok=True)
    for old in [opt.out / "result.json", *(opt.out / p for p in opt.precisions.split(","))]:
        if old.is_dir():  # an earlier run's logs (only what this script writes is removed)
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    opt.end_at = time.time() + opt.deadline
    opt.work = Path(tempfile.mkdtemp(prefix="trainer-fsdp2-", dir=opt.work))  # the run directories
    t0 = time.time()
    report: dict[str, Any] = {
        "device": opt.device,
        "gpu": torch.cuda.get_device_name(0) if opt.device == "cuda" else None,
        "nproc": opt.nproc,
        "torch": torch.__version__,
        "updates": UPDATES,
        "results": [],
    }
    try:
        import accelerate
        import transformers

        report["transformers"], report["accelerate"] = transformers.__version__, accelerate.__version__
        for precision in opt.precisions.split(","):
            try:
                res = one_precision(opt, precision)
            except Exception as exc:  # one precision's failure must not hide the other's result
                res = {"precision": precision, "pass": False, "error": f"{type(exc).__name__}: {exc}"}
            report["results"].append(res)
            print(f"[{precision}] {_summary(res)}", flush=True)
            if not res["pass"] and "log_tail" in res:
                print(res["log_tail"], flush=True)
    finally:
        report["wall_s"] = round(time.time() - t0, 1)
        report["pass"] = bool(report["results"]) and all(r["pass"] for r in report["results"])
        (opt.out / "result.json").write_text(json.dumps(report, indent=1))
        if not opt.keep:
            shutil.rmtree(opt.work, ignore_errors=True)
    verdict = "PASS" if report["pass"] else "FAIL"
    print(f"TRAINER_FSDP2 {verdict} ({report['wall_s']} s; {opt.out / 'result.json'})", flush=True)
    return 0 if report["pass"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("/tmp/trainer-fsdp2"), help="result.json and the logs"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="where the run directories go (default: /tmp)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument(
        "--deadline", type=float, default=540, help="seconds for everything: later launches are cut short"
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument(
        "--pace", type=float, default=0.3, help="seconds each update is held (the late signal)"
    )
    # the worker's own arguments (the driver passes them to itself under torchrun)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    opt = parser.parse_args()
    for p in opt.precisions.split(","):
        if p not in ("fp32", "bf16"):
            parser.error(f"--precisions: {p!r} is not fp32 or bf16")
    return worker(opt) if opt.worker else driver(opt)


if __name__ == "__main__":
    sys.exit(main())
