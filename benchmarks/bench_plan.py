"""DCP's save planning, per save, on the thread that runs it: torchrelay's split plan against `dcp.save`'s own.

The question (issue 20, point 3): does a public extension point of DCP now do what checkpoint/dcp_save.py does by
hand? dcp_save.py calls the SavePlanner/StorageWriter protocol itself so that the plan is made on the training
thread during the save's stall and the persist thread runs only the writers. The public alternative is `dcp.save`
(or `async_save`) on the persist thread, where the plan runs beside the loop, holding the GIL; torch >= 2.6 can
cache it (`DefaultSavePlanner(enable_plan_caching=True)`). This measures, for `--layers` x Linear + AdamW (the
H200 state's 72 by default: 144 parameters, 432 moments, 144 step counters = 576 items; the planning cost depends
on the item count, not the tensors' size):

- `split plan` : `dcp_save.plan(doc)` — what the stall runs (then `write` runs only the writers);
- `split plan, cached planner`: the same with DefaultSavePlanner(enable_plan_caching=True) inside;
- `dcp.save, planning only`: `dcp.save` with a storage writer that writes nothing, i.e. all of dcp.save but the
  bytes: what the persist thread would hold the GIL for if dcp.save ran there (uncached and cached).

Then `--check-caching`'s finding: a save whose global plan fails (any rank's error there), then the same save
again, with the cached planner: on torch 2.8 the rank had cached its local plan before the global plan failed, so
the second save sends an empty plan for it (later torch caches it only once the global plan succeeded).

Each figure is the median of `--saves` saves of the same document after one warm-up save (the cache's first fill
is the warm-up). CPU seconds of the calling thread (`thread_time`), which is the GIL it held: one process, no
process group (a group adds the collectives' waits, not CPU).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_plan.py [--layers 72] [--saves 9] [--check-caching]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from torchrelay.checkpoint import dcp_save


class NullWriter(StorageWriter):
    """A StorageWriter that writes nothing: each item's result is made up, so `dcp.save` runs all but the bytes."""

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        done: Future[list[WriteResult]] = Future()
        done.set_result(
            [WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items]
        )
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None


def document(layers: int) -> dict[str, Any]:
    """A model + AdamW document as the loop saves it: weight and bias per layer, two moments and a step each."""
    model = {f"layers.{i}.{p}": torch.zeros(8, 8) for i in range(layers) for p in ("weight", "bias")}
    state = {
        name: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(8, 8), "exp_avg_sq": torch.zeros(8, 8)}
        for name in model
    }
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-3, "params": list(model)}]}}


def cpu_seconds(fn: Callable[[], Any], saves: int) -> list[float]:
    fn()  # warm-up: imports, and the cache's first fill where the planner caches
    out = []
    for _ in range(saves):
        t0 = time.thread_time()
        fn()
        out.append(time.thread_time() - t0)
    return out


def _clear_plan_cache() -> None:
    # the cache is class-level, keyed by the planner's class name: each variant starts from an empty one
    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                 "_cached_final_save_plan"):  # fmt: skip
        getattr(SavePlanner, name, {}).clear()


class _FailsOnce(DefaultSavePlanner):
    failed = False

    def create_global_plan(self, plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if not _FailsOnce.failed:
            _FailsOnce.failed = True
            raise RuntimeError("the global plan failed (as a peer's error would make it)")
        return super().create_global_plan(plans)


def caching_after_a_failure(root: Path) -> str:
    """What the save after a failed one holds, with plan caching on."""
    _clear_plan_cache()
    doc = {"a": torch.ones(4), "b": torch.zeros(3)}
    # DCP's CheckpointException is a BaseException; the failure is the point
    with contextlib.suppress(BaseException):
        dcp.save(
            doc, checkpoint_id=str(root / "1"), planner=_FailsOnce(enable_plan_caching=True), no_dist=True
        )
    try:
        md = dcp.save(
            doc, checkpoint_id=str(root / "2"), planner=_FailsOnce(enable_plan_caching=True), no_dist=True
        )
    except BaseException as exc:  # noqa: BLE001 - the finding: the next save fails too
        return f"the next save fails too ({type(exc).__name__}: {str(exc).splitlines()[-1][:120]})"
    finally:
        _clear_plan_cache()
    return f"the next save holds {sorted(md.state_dict_metadata)} of ['a', 'b']"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=72)
    ap.add_argument("--saves", type=int, default=9)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--check-caching", action="store_true", help="also: a cached save after a failed one")
    args = ap.parse_args()
    doc = document(args.layers)
    n = sum(1 for v in dcp_save_leaves(doc))

    def split(caching: bool) -> Callable[[], Any]:
        return lambda: dcp_save.plan(doc, planner=DefaultSavePlanner(enable_plan_caching=caching))

    def whole(caching: bool) -> Callable[[], Any]:
        return lambda: dcp.save(
            doc,
            storage_writer=NullWriter(),
            planner=DefaultSavePlanner(enable_plan_caching=caching),
            no_dist=True,
        )

    rows = {}
    for name, fn in [
        ("split plan (the stall; torchrelay)", split(False)),
        ("split plan, cached planner", split(True)),
        ("dcp.save, planning only (the persist thread)", whole(False)),
        ("dcp.save, planning only, cached planner", whole(True)),
    ]:
        _clear_plan_cache()
        rows[name] = cpu_seconds(fn, args.saves)
    base = statistics.median(rows["split plan (the stall; torchrelay)"])
    print(f"torch {torch.__version__}, {n} items, median of {args.saves} saves (CPU s of the calling thread)")
    print("| what | median s | min s | vs the split plan |")
    print("|---|---|---|---|")
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.4f} | {min(times):.4f} | {med / base:.2f}x |")
    if args.check_caching:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            print(
                f"plan caching, a save after one whose global plan failed: {caching_after_a_failure(Path(tmp))}"
            )
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "items": n, "rows": rows}, indent=1))


def dcp_save_leaves(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from dcp_save_leaves(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from dcp_save_leaves(v)


if __name__ == "__main__":
    main()
