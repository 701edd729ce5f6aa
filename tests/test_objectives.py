"""Per-objective losses and CUDA out-of-memory errors: logged by a script, shown by `status`, packed into
training_progress.json and its README, drawn by `report` — a world-size-1 run in this process (the library's own
code path), with a caught OOM and one that ends a segment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import segments
from torchrelay import RelayConfig, Run
from torchrelay.cli import main
from torchrelay.records.summary import summarize
from torchrelay.report import render

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


def _train(run_dir: Path, example: dict[str, Path], fatal_at: int | None) -> None:
    cfg = RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=6,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=2,
    )
    with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, _batch in step.micro_batches():
                try:
                    if step.update == 2:
                        raise torch.OutOfMemoryError(OOM)  # what a too-long episode raises on the GPU
                    model(torch.ones(2, 4)).sum().backward()
                except torch.OutOfMemoryError as exc:
                    run.note_oom(exc)  # skipped that micro-batch and went on
            if step.update == fatal_at:
                raise torch.OutOfMemoryError(OOM)  # not caught: the process ends
            opt.step()
            opt.zero_grad()
            u = step.update
            step.log(loss=0.5 - 0.01 * u, loss_g3=0.01 + 0.001 * u, loss_a1=0.3 + 0.01 * u)


def test_objectives_and_ooms_in_status_progress_and_report(
    example: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "240")  # status's tables unwrapped
    run = tmp_path / "run"
    with pytest.raises(torch.OutOfMemoryError):
        _train(run, example, fatal_at=3)
    _train(run, example, fatal_at=None)  # resumes from checkpoint-2 and finishes
    first, second = segments(run)
    assert (first["ended"], second["ended"], second["resumed_from"]) == ("error", "finished", 2)

    s: dict[str, Any] = summarize(run)
    # the last 6 updates of rank 0: updates 1-2 of the first segment, 3-6 of the second (update 3 re-run)
    assert s["objective_means"] == pytest.approx({"loss_a1": 0.3 + 0.01 * 3.5, "loss_g3": 0.01 + 0.001 * 3.5})
    assert s["cuda_ooms"]["total"] == 2 and (s["cuda_ooms"]["caught"], s["cuda_ooms"]["fatal"]) == (1, 1)
    assert [seg["ooms"] for seg in s["segments"]] == [{"caught": 1, "fatal": 1}, {"caught": 0, "fatal": 0}]
    records = [json.loads(x) for x in (run / "train" / "ooms-rank0.jsonl").read_text().splitlines()]
    assert [(r["update"], r["fatal"], r["segment"]) for r in records] == [
        (2, False, first["segment"]),
        (3, True, first["segment"]),
    ]
    assert records[0]["message"] == OOM

    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "loss_a1 / loss_g3" in shown and "0.335 / 0.0135" in shown, shown
    assert "2 (1 caught, 1 fatal)" in shown and "OOMs: 1 caught, 1 fatal" in shown, shown

    bundle = tmp_path / "bundle"
    assert main(["pack", str(run), str(bundle), "--code-dir", str(example["code"])]) == 0
    progress = json.loads((bundle / "data" / "training_progress.json").read_text())
    assert progress["objective_loss_mean_100"] == pytest.approx(
        {"loss_a1": 0.3 + 0.01 * 3.5, "loss_g3": 0.01 + 0.001 * 3.5}
    )
    assert progress["cuda_ooms"]["total"] == 2
    readme = (bundle / "README.md").read_text()
    assert "| loss_a1 / loss_g3 (mean of the last 100 updates) |" in readme
    assert "| CUDA OOMs | 2 (1 caught, 1 fatal) |" in readme

    result = render(run, tmp_path / "report")
    assert [p.name for p in result.pngs()][:3] == ["overview.png", "loss.png", "objectives.png"]
