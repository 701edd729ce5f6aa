"""Per-sample randomness from (seed, index, epoch): the same draws for any worker count, world size or resume point."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchrelay as tr
from torchrelay.data.loader import RankBatches, RelayLoader
from torchrelay.data.order import GlobalOrder

N, SEED = 24, 7  # 24 samples, global batch 8: 3 updates per epoch


class Augmented(torch.utils.data.Dataset):
    """Sample i: its index and a draw from its own generator for the epoch it is consumed in."""

    wants_context = True

    def __len__(self) -> int:
        return N

    def __getitem__(self, ctx: tr.SampleContext) -> dict[str, Any]:
        noise = torch.rand(3, generator=ctx.generator())
        return {"i": torch.tensor(ctx.index), "epoch": torch.tensor(ctx.epoch), "noise": noise}


class Plain(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def draws(
    *, workers: int, world: int, start: int = 0, total: int = 8, dataset: Any = None
) -> dict[tuple, Any]:
    """{(update, index): (epoch, noise)} over every rank of a `world`-rank run from `start`."""
    order = GlobalOrder(num_samples=N, seed=SEED, global_batch=8)
    out: dict[tuple, Any] = {}
    for rank in range(world):
        batches = RankBatches(order, start, total, rank, world, micro_batch=8 // world // 2, grad_accum=2)
        loader = RelayLoader(dataset or Augmented(), None, workers).build(batches, SEED)
        for n, (ids, batch) in enumerate(loader):
            update = start + n // 2 + 1
            assert ids == batch["i"].tolist()  # the ledger records the manifest index, not the context
            for k, i in enumerate(ids):
                out[(update, i)] = (int(batch["epoch"][k]), batch["noise"][k].tolist())
    return out


def test_sample_seed_is_a_pure_function_of_seed_index_and_epoch() -> None:
    assert tr.sample_seed(1, 2, 3) == tr.sample_seed(1, 2, 3)
    seeds = {tr.sample_seed(s, i, e) for s in (0, 1) for i in (0, 1, 2) for e in (0, 1)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)
    a, b = tr.sample_generator(1, 2, 3), tr.sample_generator(1, 2, 3)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    with pytest.raises(TypeError, match="index must be an int"):
        tr.sample_seed(1, "2", 3)  # type: ignore[arg-type]


def test_context_carries_the_epoch_and_the_draws_do_not_depend_on_workers_world_or_resume() -> None:
    base = draws(workers=0, world=1)
    assert len(base) == 8 * 8  # every sample of 8 updates, once each
    # Updates 1-3 are epoch 0, 4-6 epoch 1, 7-8 epoch 2; a sample seen in two epochs draws differently.
    assert {e for (u, _), (e, _) in base.items() if u <= 3} == {0}
    assert {e for (u, _), (e, _) in base.items() if 4 <= u <= 6} == {1}
    assert {e for (u, _), (e, _) in base.items() if u >= 7} == {2}
    by_index: dict[int, list[Any]] = {}
    for (_, i), (_, noise) in base.items():
        by_index.setdefault(i, []).append(noise)
    assert all(len(v) >= 2 and v[0] != v[1] for v in by_index.values())

    assert draws(workers=2, world=1) == base  # worker count
    assert draws(workers=0, world=2) == base  # world size (ranks split the same global batch)
    resumed = draws(workers=2, world=2, start=5)
    assert resumed == {k: v for k, v in base.items() if k[0] > 5}  # resumed mid-epoch, mid-run


def test_a_plain_dataset_still_gets_the_bare_index() -> None:
    order = GlobalOrder(num_samples=N, seed=SEED, global_batch=8)
    batches = RankBatches(order, 0, 2, 0, 1, micro_batch=4, grad_accum=2)
    got = [ids for ids, _ in RelayLoader(Plain(), None, 0).build(batches, SEED)]
    assert got == list(batches) and all(isinstance(i, int) for ids in got for i in ids)
    ctx = tr.SampleContext(index=5, epoch=1, update=4, seed=SEED)
    assert list(range(10))[ctx] == 5  # a context indexes a list as its manifest index


def test_sample_dropout_gives_a_sample_the_same_mask_in_any_batch() -> None:
    seeds = [tr.sample_seed(SEED, i, 0) for i in range(6)]
    x = torch.ones(6, 5, 4)
    whole = tr.sample_dropout(x, 0.5, seeds, salt=3)
    # the same rows split over two "ranks" in another order, as another layout would hold them
    parts = torch.cat(
        [tr.sample_dropout(x[3:], 0.5, seeds[3:], salt=3), tr.sample_dropout(x[:3], 0.5, seeds[:3], salt=3)]
    )
    assert torch.equal(whole, torch.cat([parts[3:], parts[:3]]))
    assert set(whole.unique().tolist()) == {0.0, 2.0}  # dropped or scaled by 1 / (1 - p)
    torch.manual_seed(0)
    again = tr.sample_dropout(x, 0.5, seeds, salt=3)
    torch.manual_seed(1)
    assert torch.equal(again, tr.sample_dropout(x, 0.5, seeds, salt=3))  # the global RNG plays no part
    assert torch.equal(whole, again)
    assert not torch.equal(whole, tr.sample_dropout(x, 0.5, seeds, salt=4))  # another site, another mask
    assert not torch.equal(whole[0], whole[1])  # another sample, another mask
    assert torch.equal(tr.sample_dropout(x, 0.5, seeds, training=False), x)
