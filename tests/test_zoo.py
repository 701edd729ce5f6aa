"""The zoo's findings in the library: state shapes that ordinary training scripts hold."""

from __future__ import annotations

from pathlib import Path

import torch

from torchrelay.checkpoint.state import load_state, save_state


def test_a_stateful_with_tied_tensors_round_trips(tmp_path: Path) -> None:
    """An EMA (AveragedModel) of a model whose embedding is its output layer: one tensor under two names."""
    from torch.optim.swa_utils import AveragedModel

    def tied(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
        net[1].weight = net[0].weight
        return net

    saved = AveragedModel(tied(0))
    save_state(tmp_path, rank=0, model=None, optimizer=None, statefuls={"ema": saved}, loop={"update": 1})
    loaded = AveragedModel(tied(1))
    load_state(tmp_path, rank=0, model=None, optimizer=None, statefuls={"ema": loaded})
    assert torch.equal(loaded.module[0].weight, saved.module[0].weight)
    assert loaded.module[1].weight is loaded.module[0].weight  # still tied
