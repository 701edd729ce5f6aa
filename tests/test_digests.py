"""Per-update digests of the parameters (torchrelay/records/digests.py): bitwise, cheap, the same in two runs that are
the same, and the first update where two runs part named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from digest_cost import measure
from torchrelay import RelayConfig, Run
from torchrelay.checkpoint import host_stage
from torchrelay.errors import IntegrityError
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import write_request
from torchrelay.records.digests import digest, first_parting, read_digests


def test_the_digest_sees_every_bit_and_rounding_that_cancels_in_a_sum():
    torch.manual_seed(0)
    a = [torch.randn(64, 33), torch.randn(7).to(torch.bfloat16), torch.arange(5)]
    same = [t.clone() for t in a]
    assert digest(a) == digest(same) and digest(a)[1] == 3
    flipped = [t.clone() for t in a]
    flipped[0].view(torch.int32)[3, 4] ^= 1  # one bit of one element
    assert digest(flipped) != digest(a)
    # One element an ulp up, another an ulp down: the integers' sum is alike, the sum of squares is not.
    moved = [t.clone() for t in a]
    bits = moved[0].view(torch.int32)
    bits[0, 0] += 1
    bits[1, 1] -= 1
    assert moved[0].view(torch.int32).sum() == a[0].view(torch.int32).sum()
    assert digest(moved) != digest(a)
    signed = [torch.zeros(3)]
    assert digest(signed) != digest([-torch.zeros(3)])  # -0.0 is not 0.0


def _train(example: dict[str, Path], run_dir: Path, *, lr_from_3: float = 0.1) -> None:
    cfg = RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=5,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
    )
    with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        run.track(model=model, optimizer=opt)
        for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
            for _, batch in step.micro_batches():
                model(torch.ones(2, 4) * float(sum(batch))).square().mean().backward()
            if step.update >= 3:
                opt.param_groups[0]["lr"] = lr_from_3
            opt.step()
            opt.zero_grad()


def test_two_runs_are_compared_update_by_update_and_part_where_they_differ(example, tmp_path):
    _train(example, tmp_path / "a")
    _train(example, tmp_path / "b")
    (tmp_path / "relayed").mkdir()
    write_request(tmp_path / "relayed", at_update=2)
    _train(example, tmp_path / "relayed")
    _train(example, tmp_path / "relayed")
    _train(example, tmp_path / "lr", lr_from_3=0.1001)
    a = read_digests(RunDir(tmp_path / "a"))
    assert (
        sorted(a[0]) == [1, 2, 3, 4, 5] and len(set(a[0].values())) == 5
    )  # each update moves the parameters
    assert first_parting(a, read_digests(RunDir(tmp_path / "b"))) == (None, [])
    assert (
        read_digests(RunDir(tmp_path / "relayed")) == a
    )  # a resumed run writes what the uninterrupted one did
    assert first_parting(a, read_digests(RunDir(tmp_path / "lr"))) == (3, [0])


def test_the_digest_costs_a_small_share_of_a_toy_update():
    # The benchmark (benchmarks/bench_digest.py) at toy size: it runs, and the digest is cheaper than the update.
    found = measure(width=64, depth=2, batch=16, updates=5)
    assert found["tensors"] == 6 and found["parameters"] == 2 * (64 * 64 + 64) + 65
    assert 0 < found["digest_s"] < found["update_s"], found


def test_a_checkpoint_whose_files_agree_but_hold_other_values_is_refused_at_the_resume(
    example: dict[str, Path], tmp_path: Path, monkeypatch: Any
) -> None:
    """A staging that writes zeros for one tensor (torchrec PR #4322's bug; a copy racing the next step is
    alike): the checkpoint's files match their inventory, so only the state itself can tell. The resume compares
    the parameters right after the load with the digest their update logged, and refuses in one line naming the
    checkpoint and the log; the same resume of a true checkpoint goes on."""
    true_copy = host_stage.HostStage.copy

    def zeros_for_one(self: Any, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = true_copy(self, key, src)
        if key.endswith("0.weight") and "state" not in key:
            buf.zero_()
        return buf

    (tmp_path / "bad").mkdir()
    write_request(tmp_path / "bad", at_update=2)
    monkeypatch.setattr(host_stage.HostStage, "copy", zeros_for_one)
    _train(example, tmp_path / "bad")
    monkeypatch.undo()
    with pytest.raises(IntegrityError) as refused:
        _train(example, tmp_path / "bad")
    message = refused.value.message
    assert "checkpoint-2" in message and "train/digests-rank0.jsonl" in message and "\n" not in message, (
        message
    )
    (tmp_path / "good").mkdir()
    write_request(tmp_path / "good", at_update=2)
    _train(example, tmp_path / "good")
    _train(example, tmp_path / "good")
    assert sorted(read_digests(RunDir(tmp_path / "good"))[0]) == [1, 2, 3, 4, 5]
