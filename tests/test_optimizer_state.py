"""A trainable parameter the optimizer holds no state for at a save (no gradient yet: an auxiliary head used only
later, a layer frozen by `p.grad = None`, an expert given no tokens) resumes without state, as the saver holds it.

torch's get_state_dict makes up state for every trainable parameter of an optimizer that holds none (a step with
zero gradients and lr 0): before the fix a load asked DCP for that state (every resume failed: "Missing key in
checkpoint state_dict: optim.aux.weight<US>step"), and a save before any state kept it in the live optimizer
(AdamW's step count, SGD's momentum buffer: weight decay leaves it non-zero), so the saver parted from a run that
did not save.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory
from torchrelay.checkpoint.state import RELAY_STATE, load_state, save_state
from torchrelay.errors import EXIT_REFUSED, CheckpointError, RecordError

AUX_FROM = 4  # the first update that uses the auxiliary head
UPDATES = 6


class Net(nn.Module):
    """A body and a head from the start; an auxiliary head from update AUX_FROM on (no gradient before)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":  # weight decay: the made-up momentum buffer is weight_decay * p, not zero
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=1e-2)


def _build(opt: str, wrapper: str = "none") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = Net()
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    elif wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.aux)  # a group of its own that no forward gathers before AUX_FROM
        fully_shard(model)
    return model, _optimizer(opt, model.parameters())


def _train(model: nn.Module, opt: torch.optim.Optimizer, first: int, last: int, rank: int = 0) -> None:
    for update in range(first, last + 1):
        g = torch.Generator().manual_seed(100 * rank + update)
        model(torch.randn(4, 6, generator=g), update >= AUX_FROM).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every tensor of the optimizer's state (this rank's shards), by name; a parameter
    without optimizer state contributes none."""
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in model.named_parameters()}
    flat = dict(model.named_parameters())
    flat |= {f"{names[id(p)]}/{k}": v for p, s in opt.state.items() for k, v in s.items()}
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach() for k, v in flat.items()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def _save(
    ckpt: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    update: int,
    statefuls: dict[str, Any] | None = None,
) -> None:
    save_state(ckpt, rank=0, model=model, optimizer=opt, statefuls=statefuls or {}, loop={"update": update})
    write_inventory(ckpt, inventory_entries(ckpt, list_files(ckpt)))


def _loads_and_steps_alike(ckpt: Path, build: Callable[[], Any], saver_opt: Any, saver_sched: Any) -> None:
    """A fresh model, optimizer and scheduler loaded from `ckpt` step on as the saver's do."""
    fresh, fresh_opt, fresh_sched = build()
    load_state(
        ckpt, rank=0, model=fresh, optimizer=fresh_opt, statefuls={"scheduler": fresh_sched}, verify=True
    )
    for each_opt, each_sched in ((saver_opt, saver_sched), (fresh_opt, fresh_sched)):
        each_opt.step()
        each_sched.step()
    assert fresh_sched.state_dict() == saver_sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == saver_opt.param_groups[0]["lr"]


@pytest.mark.parametrize("saved_at", [0, AUX_FROM - 1], ids=["before-any-update", "aux-without-gradient"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_parameters_without_optimizer_state_resume_without_it(
    tmp_path: Path, opt: str, saved_at: int
) -> None:
    """Saved while the optimizer held no state for `aux` (or for anything: no update yet), loaded into a fresh
    model and optimizer, stepped on: every tensor equal to the uninterrupted run's, and to the saver's."""
    whole, whole_opt = _build(opt)
    _train(whole, whole_opt, 1, UPDATES)
    saver, saver_opt = _build(opt)
    _train(saver, saver_opt, 1, saved_at)
    without = {p for p in saver.parameters() if p not in saver_opt.state}
    assert saver.aux.weight in without
    _save(tmp_path, saver, saver_opt, saved_at)
    assert {p for p in saver.parameters() if p not in saver_opt.state} == without, "the save made up state"
    fresh, fresh_opt = _build(opt)
    load_state(tmp_path, rank=0, model=fresh, optimizer=fresh_opt, statefuls={})
    names = {p: n for n, p in saver.named_parameters()}
    assert {n for n, p in fresh.named_parameters() if p not in fresh_opt.state} == {names[p] for p in without}
    _train(saver, saver_opt, saved_at + 1, UPDATES)
    _train(fresh, fresh_opt, saved_at + 1, UPDATES)
    expected = _tensors(whole, whole_opt)
    assert not _differ(expected, _tensors(saver, saver_opt)), "the save changed the run that saved"
    assert not _differ(expected, _tensors(fresh, fresh_opt)), (
        "the resumed run parted from the uninterrupted one"
    )


def test_a_parameter_with_part_of_its_optimizer_state_is_refused(tmp_path: Path) -> None:
    """State for a parameter that lacks some of what the optimizer keeps was saved by another optimizer: refused,
    naming the parameter and what is missing (before the fix, DCP's raw 'Missing key')."""
    saver, saver_opt = _build("sgd")
    _train(saver, saver_opt, 1, 2)
    _save(tmp_path, saver, saver_opt, 2)
    fresh, fresh_opt = _build("adamw")
    with pytest.raises(
        CheckpointError, match=r"optimizer state of body\.weight lacks \['exp_avg', 'exp_avg_sq'"
    ):
        load_state(tmp_path, rank=0, model=fresh, optimizer=fresh_opt, statefuls={})


def _ranks_child(rank: int, base: str) -> None:
    from torchrelay.checkpoint.commit import commit_checkpoint
    from torchrelay.checkpoint.retention import LatestN

    dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    failures = []
    for wrapper in ("ddp", "fsdp2"):
        for opt in ("sgd", "adamw"):
            whole, whole_opt = _build(opt, wrapper)
            _train(whole, whole_opt, 1, UPDATES, rank)
            saver, saver_opt = _build(opt, wrapper)
            _train(saver, saver_opt, 1, AUX_FROM - 1, rank)
            run_dir = Path(base) / f"{wrapper}-{opt}"
            run_dir.mkdir(exist_ok=True)

            def write(tmp: Path, hook: Any, model: nn.Module = saver, o: Any = saver_opt) -> None:
                save_state(
                    tmp, rank=rank, model=model, optimizer=o, statefuls={}, loop={"update": AUX_FROM - 1}
                )

            ckpt, _ = commit_checkpoint(
                run_dir, AUX_FROM - 1, write, rank=rank, world_size=2, info={}, retention=LatestN(1)
            )
            fresh, fresh_opt = _build(opt, wrapper)
            load_state(ckpt, rank=rank, model=fresh, optimizer=fresh_opt, statefuls={})
            _train(fresh, fresh_opt, AUX_FROM, UPDATES, rank)
            if differ := _differ(_tensors(whole, whole_opt), _tensors(fresh, fresh_opt)):
                failures.append(f"{wrapper} {opt}, rank {rank}: {differ}")
    dist.barrier()  # neither rank tears gloo down while the other still talks
    dist.destroy_process_group()
    assert not failures, failures


@pytest.mark.launch
def test_ddp_and_fsdp2_resume_a_parameter_without_optimizer_state(tmp_path: Path) -> None:
    """Two gloo ranks: DDP (find_unused_parameters) and FSDP2 (the unused head sharded in a group of its own),
    saved through the commit protocol before the head had a gradient, resumed and stepped on: every tensor of
    each rank (its shards under FSDP2) equal to the uninterrupted run's."""
    mp.spawn(_ranks_child, args=(str(tmp_path),), nprocs=2)


def _forge_last_epoch(doc: dict[str, Any]) -> None:
    pairs = doc["statefuls"]["scheduler"]["__dict__"]
    next(p for p in pairs if p[0] == "last_epoch")[1] = "eight"


def _forge_last_lr(doc: dict[str, Any]) -> None:
    pairs = doc["statefuls"]["scheduler"]["__dict__"]
    next(p for p in pairs if p[0] == "_last_lr")[1] = [None]


def _forge_group(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["optimizer"]["param_groups"][0].__setitem__(key, value)


@pytest.mark.parametrize(
    ("forge", "field", "shown"),
    [
        (
            _forge_last_epoch,
            "statefuls.scheduler.last_epoch",
            "holds 'eight' (a str) where the live object holds a number",
        ),
        (
            _forge_last_lr,
            "statefuls.scheduler._last_lr.0",
            "holds None (None) where the live object holds a number",
        ),
        (_forge_group("lr", "fast"), "optimizer.param_groups.0.lr", "holds 'fast' (a str)"),
        (
            _forge_group("amsgrad", 1),
            "optimizer.param_groups.0.amsgrad",
            "holds 1 (a number) where the live object holds a bool",
        ),
        (
            _forge_group("betas", [0.9]),
            "optimizer.param_groups.0.betas",
            "holds [0.9] (a list) where the live object holds 2 values",
        ),
        (
            _forge_group("foreach", "yes"),
            "optimizer.param_groups.0.foreach",
            "where the live object holds None",
        ),
    ],
    ids=["last_epoch", "last_lr", "lr", "amsgrad", "betas", "foreach"],
)
def test_a_forged_scalar_of_the_scheduler_or_optimizer_is_refused_at_the_load(
    tmp_path: Path, forge: Callable[[dict[str, Any]], None], field: str, shown: str
) -> None:
    """relay_state.json forged (its inventory recomputed to match): a scheduler's last_epoch of "eight" or a param
    group's lr of "fast" was loaded as it was, and the next sched.step() or opt.step() died in a TypeError traceback.
    Now the load refuses a value of another kind than the live object holds, in one line naming the file and the
    field (exit 2); the checkpoint as saved loads and steps on as the saver does."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model, opt = _build("adamw")
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1 / (u + 1))

    saver, saver_opt, saver_sched = build()
    for update in range(1, 4):
        _train(saver, saver_opt, update, update)
        saver_sched.step()
    _save(tmp_path, saver, saver_opt, 3, {"scheduler": saver_sched})
    saved = (tmp_path / RELAY_STATE).read_bytes()

    _loads_and_steps_alike(tmp_path, build, saver_opt, saver_sched)

    doc = json.loads(saved)
    forge(doc)
    (tmp_path / RELAY_STATE).write_text(json.dumps(doc, indent=1))
    (tmp_path / "COMPLETE.json").unlink()  # and recomputed, as a forger would
    write_inventory(tmp_path, inventory_entries(tmp_path, list_files(tmp_path)))
    fresh, fresh_opt, fresh_sched = build()
    with pytest.raises(RecordError) as caught:
        load_state(
            tmp_path,
            rank=0,
            model=fresh,
            optimizer=fresh_opt,
            statefuls={"scheduler": fresh_sched},
            verify=True,
        )
    message = caught.value.message
    assert message.startswith(f"{tmp_path / RELAY_STATE}, field {field!r}: ") and shown in message, message
    assert "\n" not in message and caught.value.exit_code == EXIT_REFUSED
    assert fresh_sched.last_epoch == 0  # the scheduler was not loaded


@pytest.mark.parametrize(
    "groups", [(1, 2), (2, 1), ("swapped", "swapped")], ids=["added", "dropped", "moved"]
)
def test_other_param_groups_than_the_checkpoint_are_refused(tmp_path: Path, groups: tuple[Any, Any]) -> None:
    """An optimizer whose param groups hold other parameters than the saver's (a group added mid-run that the
    resuming script adds before run.track, or forgets to) is refused naming the groups. Before the fix DCP matched
    groups by parameter name and left a group it found no match for with its `params` alone: the load passed and
    the first step raised KeyError: 'betas' (or trained on with settings from another group)."""

    def build(how: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Net()
        rest = [*model.head.parameters(), *model.aux.parameters()]
        if how == 1:
            return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
        if how == 2:
            return model, torch.optim.AdamW(
                [{"params": model.body.parameters()}, {"params": rest, "lr": 5e-3}], lr=1e-2
            )
        return model, torch.optim.AdamW(
            [{"params": rest}, {"params": model.body.parameters(), "lr": 5e-3}], lr=1e-2
        )

    saver, saver_opt = build(groups[0] if groups[0] != "swapped" else 2)
    _train(saver, saver_opt, 1, 2)
    _save(tmp_path, saver, saver_opt, 2)
    fresh, fresh_opt = build(groups[1])
    with pytest.raises(CheckpointError, match=r"param groups differ from the checkpoint") as err:
        load_state(tmp_path, rank=0, model=fresh, optimizer=fresh_opt, statefuls={})
    assert str(tmp_path) in err.value.message and "\n" not in err.value.message


class _PeakWarmup:
    """A LambdaLR factor of the user's own (its __dict__ is the scheduler's state): None until the peak is reached."""

    def __init__(self, n: int) -> None:
        self.n, self.peak_at = n, None

    def __call__(self, step: int) -> float:
        if step >= self.n and self.peak_at is None:
            self.peak_at = step
        return min(1.0, (step + 1) / self.n)


class _HoldScheduler(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler of the user's own whose state holds None until something happens (a held lr)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.held: list[float] | None = None
        super().__init__(opt)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 2:
            self.held = [g["lr"] * 0.5 for g in self.optimizer.param_groups]
        return self.held or [g["lr"] for g in self.optimizer.param_groups]


@pytest.mark.parametrize("kind", ["lambda-object", "custom-scheduler"])
def test_a_scheduler_value_that_was_none_at_the_start_loads(tmp_path: Path, kind: str) -> None:
    """A scheduler's state may hold None at its start and a number or a list later (a LambdaLR factor object's
    attribute, a custom scheduler's held lr): the live object's None says nothing of what the saver held. Before
    the fix every resume past that point was refused as 'damaged or forged' ("field
    'statefuls.scheduler.lr_lambdas.0.peak_at': holds 2 (a number) where the live object holds None")."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model, opt = _build("sgd")
        if kind == "lambda-object":
            return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _PeakWarmup(2))
        return model, opt, _HoldScheduler(opt)

    saver, saver_opt, saver_sched = build()
    for update in range(1, 5):
        _train(saver, saver_opt, update, update)
        saver_sched.step()
    _save(tmp_path, saver, saver_opt, 4, {"scheduler": saver_sched})
    _loads_and_steps_alike(tmp_path, build, saver_opt, saver_sched)
