"""The garbage collector during a run (run/saver.py, SaveTuning.freeze_gc): after a segment's first update the heap is out of
the collector's reach, so a full collection during a persist walks only what is new; the user's settings and
whatever became garbage meanwhile are given back when the Run closes."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import torch

from torchrelay import RelayConfig, Run


def _config(example: dict[str, Path]) -> RelayConfig:
    return RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=6,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=3,
    )


def _loop(run: Run, hook: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    run.track(model=model, optimizer=opt)
    for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
        for _, _batch in step.micro_batches():
            model(torch.randn(2, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        hook(step.update)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_full_collection_during_a_persist_walks_only_what_is_new_and_close_gives_all_back(
    example: dict[str, Path], tmp_path: Path
) -> None:
    run_dir, release = tmp_path / "run", tmp_path / "release"
    thresholds = gc.get_threshold()
    gc.set_threshold(650, 9, 11)  # the user's own settings, which the run must give back as they were
    keep = [_Cycle()]
    cycle = weakref.ref(keep[0])
    seen: dict[str, Any] = {}
    try:
        gc.collect()
        heap = len(gc.get_objects())  # what a full collection walks before the run: torch's modules and more

        def hook(update: int) -> None:
            if update == 2:
                keep.clear()  # a cycle made before the freeze becomes garbage after it
            if update == 4:  # checkpoint-3 is held in flight
                seen["persisting"] = run._saver.persisting
                seen["walked"] = len(gc.get_objects())  # generations 0-2: what any full collection walks now
                gc.collect()
                seen["cycle_during"] = cycle() is not None
                release.touch()

        with Run.open(run_dir, _config(example), code_dir=example["code"]) as run:
            run._saver._persister.hold = release
            _loop(run, hook)
        assert seen["persisting"], seen
        assert seen["walked"] < heap // 10, (seen, heap)
        assert seen["cycle_during"], "frozen objects stay out of reach until the Run closes"
        assert (gc.get_threshold(), gc.isenabled(), gc.get_freeze_count()) == ((650, 9, 11), True, 0)
        gc.collect()
        assert cycle() is None, "what became garbage while frozen is collected once the Run is closed"
    finally:
        gc.set_threshold(*thresholds)


def test_a_process_that_froze_objects_is_frozen_further_and_a_disabled_collector_stays_off(
    example: dict[str, Path], tmp_path: Path
) -> None:
    gc.freeze()  # the process's own freeze (on the H200 host's Python something froze 375 objects at start)
    mine = gc.get_freeze_count()
    made_after = [
        _Cycle() for _ in range(5000)
    ]  # what the process made after its freeze: in reach, until the run
    seen: dict[str, int] = {}

    def hook(update: int) -> None:
        if update == 2:
            seen["walked"] = len(gc.get_objects())

    try:
        with Run.open(tmp_path / "frozen", _config(example), code_dir=example["code"]) as run:
            _loop(run, hook)
        assert seen["walked"] < 5000, seen  # the run froze what came after the process's freeze too
        # and the close thaws nothing: it cannot tell its own frozen objects from the process's
        assert gc.get_freeze_count() >= mine + 5000 * 0.9, (gc.get_freeze_count(), mine)
    finally:
        gc.unfreeze()
        del made_after
    gc.disable()
    try:
        with Run.open(tmp_path / "disabled", _config(example), code_dir=example["code"]) as run:
            _loop(run, lambda update: None)
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_first_three_updates_each_do_one_part_of_the_set_up(
    example: dict[str, Path], tmp_path: Path, monkeypatch: Any
) -> None:
    """After update 1 the collector's freeze, after 2 the buffers' reservation, after 3 the writer's start: all three
    after update 1 made it 1.24-1.49x the median on the H200 host (RESULTS.md, issue 22 fourth round)."""
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", "process")
    seen: dict[int, tuple[Any, ...]] = {}
    config = _config(example)
    config.save_every = 5  # no save before update 5: a save starts what it needs itself

    def hook(update: int) -> None:  # before the update's own due(): what the ones before it did
        saver = run._saver
        seen[update] = (saver._froze, saver._reserved, saver._writer is not None)

    with Run.open(tmp_path / "run", config, code_dir=example["code"]) as run:
        _loop(run, hook)
    assert [seen[u] for u in (1, 2, 3, 4)] == [
        (None, False, False),
        (True, False, False),
        (True, True, False),
        (True, True, True),
    ], seen
