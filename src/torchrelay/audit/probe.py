"""A probe inside the audited processes: digests of the batches that the script's own DataLoaders deliver.

torchrelay's ledger records what its own loader delivers. A script that also (or instead) draws batches from
a DataLoader of its own is invisible to it, so the audit puts `_site/` on PYTHONPATH; its sitecustomize calls
`install()` in every process of the launch, which records, per rank, a digest of each batch such a loader
yields, with the update it was drawn in. Two runs whose digests part were fed different data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

ENV = "TORCHRELAY_AUDIT_PROBE"  # the folder the probe writes rank<r>.jsonl into; unset: the probe is off
SITE_DIR = Path(__file__).resolve().parent / "_site"

_state: dict[str, Any] = {"update": 0}


def _digest(obj: Any, h: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _digest(item, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def _record(it: Any, batch: Any) -> None:
    batches = getattr(it, "_index_sampler", None)
    if type(batches).__module__.startswith("torchrelay."):
        return  # torchrelay's own loader: the exposure ledger already records it
    sampler = getattr(batches, "sampler", batches)
    count = getattr(it, "_torchrelay_probe_n", 0)
    it._torchrelay_probe_n = count + 1
    h = hashlib.sha256()
    _digest(batch, h)
    rank = os.environ.get("RANK", "0")
    line = {
        "update": _state["update"],
        "n": count,
        "sampler": type(sampler).__name__,
        "sha": h.hexdigest()[:20],
    }
    folder = Path(os.environ[ENV])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def install() -> None:
    """Wrap DataLoader iteration and torchrelay's Step so each foreign batch is recorded with its update."""
    if not os.environ.get(ENV) or _state.get("installed"):
        return
    import importlib

    import torch.utils.data.dataloader as dl

    relay_run = importlib.import_module("torchrelay.run")  # already in sys.modules when the hook calls us

    original_next = dl._BaseDataLoaderIter.__next__
    original_step = relay_run.Step.__init__

    def __next__(self: Any) -> Any:
        batch = original_next(self)
        with contextlib.suppress(Exception):  # the probe must never break the audited run
            _record(self, batch)
        return batch

    def step_init(self: Any, update: int, *args: Any, **kwargs: Any) -> None:
        _state["update"] = update
        original_step(self, update, *args, **kwargs)

    dl._BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
    relay_run.Step.__init__ = step_init
    _state["installed"] = True


def read(folder: Path) -> dict[int, list[tuple[int, str]]]:
    """`{rank: [(update, digest), ...]}` in the order the batches were drawn."""
    out: dict[int, list[tuple[int, str]]] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        out[rank] = [(int(r["update"]), str(r["sha"])) for r in rows]
    return out


def samplers(folder: Path) -> list[str]:
    """The sampler classes of the script's own loaders that the probe saw."""
    names: set[str] = set()
    for path in sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                names.add(str(json.loads(line).get("sampler")))
    return sorted(names)
