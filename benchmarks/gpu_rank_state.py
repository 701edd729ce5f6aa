"""State that differs by rank on GPUs: examples/exactness/rank_state.py under torchrun with NCCL, for each wrapper
(SyncBatchNorm runs on GPUs only), uninterrupted versus stopped late (update U-2) and resumed.

    PYTHONPATH=$PWD/src:$PWD/tests python3 benchmarks/gpu_rank_state.py --out /tmp/gpu-rank-state [--parallel syncbn ddp fsdp2]

Prints one JSON object per wrapper: what the checkpoints stored per rank, and whether every tensor (buffers and
generator states included) of the first checkpoint after the resume and of the last is torch.equal.
GPU only (NCCL; SyncBatchNorm); the suite runs `--setup-only` on the CPU, and the CPU wrappers' resume is
tests/test_rank_state.py's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import EXAMPLES, launch, make_data, segments, write_config  # noqa: E402
from torchrelay.audit.compare import load_checkpoint_tensors  # noqa: E402
from torchrelay.checkpoint.state import read_trainer_state  # noqa: E402
from torchrelay.policy.stop import write_request  # noqa: E402

SCRIPT = "exactness/rank_state.py"


def one(base: Path, code: Path, config: Path, parallel: str, updates: int) -> dict[str, object]:
    sets = {"params.parallel": parallel, "params.device": "cuda"}
    straight, stopped = base / f"{parallel}-straight", base / f"{parallel}-stopped"
    t0 = time.time()
    out = launch(code, straight, config=config, sets=sets, script=SCRIPT, timeout=900)
    if out.returncode:
        return {"parallel": parallel, "error": out.stderr[-3000:]}
    stopped.mkdir()
    write_request(stopped, at_update=updates - 2)
    launch(code, stopped, config=config, sets=sets, script=SCRIPT, timeout=900)
    out = launch(code, stopped, sets={"params.device": "cuda"}, script=SCRIPT, timeout=900)
    if out.returncode:
        return {"parallel": parallel, "error": out.stderr[-3000:]}
    result: dict[str, object] = {
        "parallel": parallel,
        "segments": [(s["first_update"], s["last_update"], s["ended"]) for s in segments(stopped)],
        "seconds": round(time.time() - t0, 1),
    }
    for update in (updates - 1, updates):
        a = load_checkpoint_tensors(straight / f"checkpoint-{update}")
        b = load_checkpoint_tensors(stopped / f"checkpoint-{update}")
        differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not a[k].equal(b[k]))
        result[f"checkpoint-{update}"] = {"tensors": len(a), "differ": differ}
        result["per_rank"] = read_trainer_state(stopped / f"checkpoint-{update}").get("per_rank")
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-rank-state"))
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--parallel", nargs="+", default=["syncbn", "ddp", "fsdp2"])
    parser.add_argument(
        "--setup-only", action="store_true", help="write the code, data and config, then stop (no GPU needed)"
    )
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    code = args.out / "code"
    (code / "exactness").mkdir(parents=True)
    shutil.copyfile(EXAMPLES / "train_lm.py", code / "train_lm.py")
    shutil.copyfile(EXAMPLES / SCRIPT, code / SCRIPT)
    root, manifest = make_data(args.out / "data", files=8)
    config = write_config(
        args.out / "c.yaml",
        manifest,
        root,
        total_updates=args.updates,
        save_every=1,
        **{"params.d_model": 64, "params.seq_len": 64},
    )
    if args.setup_only:
        print(json.dumps({"code": str(code), "manifest": str(manifest), "config": str(config)}))
        return 0
    ok = True
    for parallel in args.parallel:
        result = one(args.out, code, config, parallel, args.updates)
        ok &= "error" not in result and all(
            not result[f"checkpoint-{u}"]["differ"]  # type: ignore[index]
            for u in (args.updates - 1, args.updates)
        )
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
