"""Run under torchrun (2 ranks, gloo) by test_refusals.py: every way Run.open can fail, in one launch.

`dist_open.py BASE CONFIG`: creates BASE/run, then opens copies of it broken in turn (each case below), catching
what every rank raised into BASE/seen-rank<r>.json; at last it opens a mismatching copy without catching, so the
excepthook of torchrelay ends both ranks (one message, exit 2). A rank that waited for an answer that never came
would hit the gloo timeout (60 s) instead.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

import torchrelay as tr
from torchrelay.manifest import Manifest
from torchrelay.paths.lock import RunLock
from torchrelay.run.opening import SegmentOpener


def copy_of(base: Path, name: str, rank: int, damage: Callable[[Path], None] | None = None) -> Path:
    """Rank 0 copies the run (and damages the copy); every rank waits for it."""
    dst = base / name
    if rank == 0:
        shutil.copytree(base / "run", dst)
        if damage is not None:
            damage(dst)
    dist.barrier()
    return dst


def history_as_dir(run: Path) -> None:
    (run / "history.jsonl").unlink()
    (run / "history.jsonl").mkdir()


def manifest_not_utf8(run: Path) -> None:
    data = (run / "data" / "manifest.jsonl").read_bytes()
    (run / "data" / "manifest.jsonl").write_bytes(data[:40] + b"\xff\xfe\x80" + data[40:])


def main() -> None:
    base, config_path = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    cfg = tr.RelayConfig.from_dict(yaml.safe_load(config_path.read_text()))
    with tr.Run.open(base / "run", cfg):  # created; no update is run
        pass
    seen: dict[str, Any] = {}
    real_prepare, real_load = SegmentOpener.open_directory, Manifest.load

    def bug(self: Any, *args: Any) -> Any:
        raise TypeError("injected bug")

    def unreadable(cls: Any, path: Any, data_root: str = "", **_: Any) -> Any:
        raise PermissionError(13, "Permission denied", str(path))

    cases: list[tuple[str, Path, Any]] = [
        ("mismatch", copy_of(base, "mismatch", rank), cfg.replace(seed=cfg.seed + 1)),
        ("manifest", copy_of(base, "manifest", rank, manifest_not_utf8), None),
        ("history", copy_of(base, "history", rank, history_as_dir), None),
        ("busy", copy_of(base, "busy", rank), None),
        ("bug", copy_of(base, "bug", rank), None),
        ("local", copy_of(base, "local", rank), None),
        ("again-refused", copy_of(base, "again", rank), cfg.replace(seed=cfg.seed + 1)),
        ("again", base / "again", cfg),  # the launch after a refusal continues the run
    ]
    for name, path, config in cases:
        lock = RunLock(path, "train").acquire() if name == "busy" and rank == 0 else None
        if name == "bug" and rank == 0:
            SegmentOpener.open_directory = bug  # type: ignore[method-assign]
        if name == "local" and rank == 1:
            Manifest.load = classmethod(unreadable)  # type: ignore[method-assign,assignment]
        started = time.monotonic()
        try:
            with tr.Run.open(path, config):
                seen[name] = {"opened": True}
        except BaseException as exc:  # noqa: BLE001 - what each rank raised is the point
            seen[name] = {
                "type": type(exc).__name__,
                "code": getattr(exc, "exit_code", None),
                "reported": bool(getattr(exc, "reported", False)),
                "message": str(exc),
            }
        seen[name]["seconds"] = time.monotonic() - started
        SegmentOpener.open_directory, Manifest.load = real_prepare, real_load  # type: ignore[method-assign]
        if lock is not None:
            lock.release()
        dist.barrier()
    (base / f"seen-rank{rank}.json").write_text(json.dumps(seen, indent=1))
    dist.barrier()
    final = copy_of(base, "final", rank)
    with tr.Run.open(final, cfg.replace(seed=cfg.seed + 1)):  # not caught: the excepthook ends the process
        pass
    raise AssertionError("unreachable: the open above refuses")


if __name__ == "__main__":
    main()
