"""State that differs by rank (BatchNorm statistics, per-rank generators) is stored per rank and comes back per rank."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from safetensors.torch import load_file, save_file

from helpers import launch, make_code_repo, metrics, segments, write_config
from torchrelay.checkpoint.adapters import adapt
from torchrelay.checkpoint.inventory import read_inventory, validate_complete
from torchrelay.checkpoint.reader import load_statefuls, load_tensors
from torchrelay.checkpoint.state import from_tree, load_state, read_trainer_state, to_tree
from torchrelay.cli import main
from torchrelay.errors import CheckpointError, ConfigError
from torchrelay.policy.stop import write_request

FORMAT1 = Path(__file__).parent / "fixtures" / "legacy-v0.1.0-state"

# ------------------------------------------------------------------------------------------- adapters


def _stored(obj: Any) -> Any:
    """A tracked object's state as a checkpoint holds it (JSON text and a safetensors file) and read back."""
    tensors: dict[str, torch.Tensor] = {}
    tree = json.loads(json.dumps(to_tree(adapt("g", obj).state_dict(), "g", tensors)))
    return from_tree(tree, load_file_roundtrip(tensors))


def load_file_roundtrip(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import tempfile

    if not tensors:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        save_file(tensors, f"{tmp}/t.safetensors")
        return load_file(f"{tmp}/t.safetensors")


@pytest.mark.parametrize(
    "make, draw",
    [
        (lambda s: torch.Generator().manual_seed(s), lambda g: torch.rand(5, generator=g).tolist()),
        (lambda s: np.random.default_rng(s), lambda g: g.integers(0, 1 << 62, 5).tolist()),
        (lambda s: np.random.Generator(np.random.MT19937(s)), lambda g: g.random(5).tolist()),
        (lambda s: np.random.Generator(np.random.Philox(s)), lambda g: g.random(5).tolist()),
        (lambda s: np.random.RandomState(s), lambda g: [g.standard_normal(), *g.random_sample(3)]),
        (lambda s: random.Random(s), lambda g: [g.gauss(0, 1), g.random(), g.getrandbits(70)]),
    ],
    ids=["torch", "numpy-pcg64", "numpy-mt19937", "numpy-philox", "numpy-randomstate", "python"],
)
def test_generators_round_trip_through_track_adapters(make: Any, draw: Any) -> None:
    """Mid-stream (a cached Gaussian included), stored without pickle, restored in place into another object."""
    gen = make(1)
    draw(gen)
    if isinstance(gen, random.Random | np.random.RandomState):
        gen.gauss(0, 1) if isinstance(gen, random.Random) else gen.standard_normal()  # leaves a cached value
    state = _stored(gen)
    expected = draw(gen)
    other = make(99)
    adapt("g", other).load_state_dict(state)
    assert draw(other) == expected


def test_track_refuses_what_it_cannot_restore() -> None:
    with pytest.raises(ConfigError, match=r"run.track\(aug=...\): a random.SystemRandom draws from the OS"):
        adapt("aug", random.SystemRandom())
    with pytest.raises(
        ConfigError, match=r"run.track\(counter=...\): a object has no state_dict/load_state_dict"
    ):
        adapt("counter", object())
    state = _stored(torch.Generator().manual_seed(1))
    with pytest.raises(
        CheckpointError, match=r"'g': the checkpoint holds a 'torch.Generator'.*tracks a 'random.Random'"
    ):
        adapt("g", random.Random(1)).load_state_dict(state)


class _Held:
    """A stateful of the user's own whose state is one tensor of each dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = dict(state)


def test_a_stateful_tensor_of_every_dtype_the_save_writes_loads_back(tmp_path: Path) -> None:
    """Every dtype safetensors writes (complex64, the float8 variants) comes back from a stateful, bit for bit.
    Before the fix the save wrote a complex64 tensor (C64) and the FNUZ float8s, and the resume refused the
    checkpoint as damaged ("tensor 's.z' has no known dtype"): no checkpoint of such a run could be resumed. A
    dtype it cannot write (complex128) failed the save as "KeyError: torch.complex128", with a hint to free space."""
    from safetensors.torch import _TYPES  # the dtypes the save can write

    from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory
    from torchrelay.checkpoint.state import save_state

    source = torch.arange(-6, 6, dtype=torch.float64) / 3
    tensors = {name.lower(): source.to(dtype) for name, dtype in _TYPES.items()}
    save_state(
        tmp_path, rank=0, model=None, optimizer=None, statefuls={"s": _Held(tensors)}, loop={"update": 1}
    )
    write_inventory(tmp_path, inventory_entries(tmp_path, list_files(tmp_path)))
    back = _Held({})
    load_state(tmp_path, rank=0, model=None, optimizer=None, statefuls={"s": back})
    assert set(back.tensors) == set(tensors)
    for name, tensor in tensors.items():
        got = back.tensors[name]
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), (
            name
        )
    # one it cannot write is refused naming the state and the dtype, not "KeyError: torch.complex128"
    wide = _Held({"z": torch.ones(2, dtype=torch.complex128)})
    with pytest.raises(
        CheckpointError, match=r"state 's\.z' holds a complex128 tensor, which a checkpoint cannot"
    ):
        save_state(
            tmp_path / "c128", rank=0, model=None, optimizer=None, statefuls={"s": wide}, loop={"update": 1}
        )


def test_a_format1_checkpoint_written_by_main_still_loads() -> None:
    """tests/fixtures/legacy-v0.1.0-state (statefuls from rank 0; make_legacy_state.py) loads with today's code."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    class Ema:
        v = torch.zeros(3)

        def state_dict(self) -> dict[str, Any]:
            return {"v": self.v, "n": 0}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.v = state["v"]

    ema = Ema()
    loop = load_state(FORMAT1, rank=0, model=model, optimizer=opt, statefuls={"scheduler": sched, "ema": ema})
    assert loop == {"update": 2, "world_size": 2} and read_trainer_state(FORMAT1)["format"] == 1
    stored = load_tensors(FORMAT1)
    for name, value in model.state_dict().items():
        assert torch.equal(value, stored[f"model.{name}"]), name
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], stored["optim.0.weight.exp_avg"])
    assert sched.last_epoch == 2 and torch.equal(ema.v, torch.arange(3.0) + 0.5)
    assert set(load_statefuls(FORMAT1)) == {"ema", "scheduler"}


# ------------------------------------------------------------------------------ every wrapper, 2 ranks

WRAPPERS = ("ddp", "fsdp2", "none", "none-independent")
BN_STATS = ["1.running_mean", "1.running_var"]


class Counter:
    """A stateful equal on every rank (stored once)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


def _build(wrapper: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, wrapper: str, steps: int
) -> None:
    for _ in range(steps):
        model(torch.randn(8, 4, generator=gen)).square().mean().backward()
        if wrapper == "none":  # a hand-made data parallel: the gradients all-reduced, the buffers left alone
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, opt)
    flat = {f"model.{k}": v for k, v in msd.items()}
    flat |= {f"optim.{p}.{n}": v for p, s in osd["state"].items() for n, v in s.items()}
    return {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in flat.items()}


def _ranks_child(rank: int, base: str) -> None:
    from torchrelay.checkpoint.commit import commit_checkpoint
    from torchrelay.checkpoint.retention import LatestN
    from torchrelay.checkpoint.state import save_state

    dist.init_process_group("gloo", init_method=f"file://{base}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for wrapper in WRAPPERS:
        run_dir = Path(base) / wrapper
        run_dir.mkdir(exist_ok=True)
        model, opt = _build(wrapper)
        gen = torch.Generator().manual_seed(100 + rank)  # per-rank data: BatchNorm statistics differ by rank
        counter = Counter()
        statefuls = {"gen": adapt("gen", gen), "counter": counter}
        _train(model, opt, gen, wrapper, 2)
        counter.n = 2
        before, gen_before = _snapshot(model, opt), gen.get_state()

        def write(
            tmp: Path, hook: Any, model: nn.Module = model, opt: Any = opt, statefuls: Any = statefuls
        ) -> None:
            save_state(tmp, rank=rank, model=model, optimizer=opt, statefuls=statefuls, loop={"update": 2})

        ckpt, _ = commit_checkpoint(run_dir, 2, write, rank=rank, world_size=2, info={}, retention=LatestN(2))
        _train(model, opt, gen, wrapper, 2)  # move everything on, then come back
        counter.n = 7
        load_state(ckpt, rank=rank, model=model, optimizer=opt, statefuls=statefuls)
        after = _snapshot(model, opt)
        differ = [k for k in before if not torch.equal(before[k], after[k])]
        assert not differ, f"{wrapper}, rank {rank}: {differ} not restored to this rank's own values"
        assert torch.equal(gen.get_state(), gen_before) and counter.n == 2
    dist.barrier()  # neither rank tears gloo down while the other still talks (SIGABRT, 1 launch in 8 without)
    dist.destroy_process_group()


def test_relay_state_wins_over_hugging_face_trainer_state_beside_it(tmp_path: Path) -> None:
    """A 0.1.0 checkpoint's trainer_state.json is read; once relay_state.json exists, a trainer_state.json beside
    it is Hugging Face's (its Trainer writes one into its checkpoints) and never read as ours."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(FORMAT1, ckpt)
    assert read_trainer_state(ckpt)["loop"]["update"] == 2  # the old name, from an old checkpoint
    ours = json.loads((ckpt / "trainer_state.json").read_text())
    (ckpt / "relay_state.json").write_text(json.dumps({**ours, "loop": {**ours["loop"], "update": 7}}))
    (ckpt / "trainer_state.json").write_text(
        json.dumps({"global_step": 2, "log_history": [], "best_metric": None})
    )
    assert read_trainer_state(ckpt)["loop"]["update"] == 7


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One pair of real gloo processes saves and restores a checkpoint under every wrapper."""
    base = tmp_path_factory.mktemp("ranks")
    mp.spawn(_ranks_child, args=(str(base),), nprocs=2)
    return base


@pytest.mark.launch
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_what_differs_by_rank_is_stored_per_rank(saved_by_two_ranks: Path, wrapper: str) -> None:
    """The rule, wrapper by wrapper: equal on every rank, stored once; different, stored per rank and restored."""
    ckpt = saved_by_two_ranks / wrapper / "checkpoint-2"
    doc = read_trainer_state(ckpt)
    per_rank = doc["per_rank"]
    # BatchNorm statistics differ by rank under every wrapper (DDP broadcasts them only at some forwards, FSDP2
    # and a bare module never); parameters differ only when nothing synchronizes the gradients.
    if wrapper == "none-independent":
        assert set(BN_STATS) < set(per_rank["model"]) and "0.weight" in per_rank["model"]
        assert "0.weight\x1fexp_avg" in per_rank["optim"]
    else:
        assert per_rank["model"] == BN_STATS and per_rank["optim"] == []
    assert per_rank["statefuls"] == ["gen"] and set(doc["statefuls"]) == {"counter"}
    # Every rank's files are in the inventory, which verifies.
    listed = {f["path"] for f in read_inventory(ckpt)["files"]}
    assert {f"statefuls/rank-{r}.{ext}" for r in (0, 1) for ext in ("json", "safetensors")} <= listed
    assert {"rng/rank-0.safetensors", "rng/rank-1.safetensors", "relay_state.json"} <= listed
    assert "trainer_state.json" not in listed  # Hugging Face's name, with its schema: never ours
    validate_complete(ckpt)
    # The offline reader names each rank's copy.
    tensors = load_tensors(ckpt)
    assert {"model.1.running_mean@rank0", "model.1.running_mean@rank1"} <= set(tensors)
    assert not torch.equal(tensors["model.1.running_mean@rank0"], tensors["model.1.running_mean@rank1"])
    assert "model.1.running_mean" not in tensors and "model.1.num_batches_tracked" in tensors
    states = load_statefuls(ckpt)
    assert set(states) == {"counter", "gen@rank0", "gen@rank1"}
    assert not torch.equal(states["gen@rank0"]["state"], states["gen@rank1"]["state"])


# ---------------------------------------------------------------------- a real run, stopped late, 2 ranks

SCRIPT = "exactness/rank_state.py"
U, STOP = 8, 6


@pytest.mark.launch
def test_bn_ddp_and_per_rank_generators_resume_late_bit_for_bit(
    example: dict[str, Path], tmp_path: Path
) -> None:
    """BatchNorm under DDP with no_sync accumulation, and three per-rank generators tracked as they are: stopped
    at update U-2, the first checkpoint after the resume and the last are equal to the uninterrupted run's in
    every tensor (buffers and generator states included) and every stored value."""
    code = make_code_repo(tmp_path / "code", ("train_lm.py", SCRIPT))
    config = write_config(
        tmp_path / "c.yaml",
        example["manifest"],
        example["root"],
        total_updates=U,
        save_every=1,
        **{"params.d_model": 16, "params.seq_len": 32},
    )
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    out = launch(code, straight, config=config, script=SCRIPT)
    assert out.returncode == 0, out.stdout + out.stderr
    stopped.mkdir()
    write_request(stopped, at_update=STOP)
    launch(code, stopped, config=config, script=SCRIPT)
    assert segments(stopped)[-1]["ended"] == "request" and segments(stopped)[-1]["last_update"] == STOP
    out = launch(code, stopped, script=SCRIPT)
    assert out.returncode == 0, out.stdout + out.stderr

    from torchrelay.audit.compare import load_checkpoint_tensors

    for update in (STOP + 1, U):  # the state right after the resume, and at the end
        a, b = straight / f"checkpoint-{update}", stopped / f"checkpoint-{update}"
        doc = read_trainer_state(b)
        # The case this test is about really happened: BatchNorm statistics and generators differed by rank.
        assert doc["per_rank"]["model"] == [
            "bn1.running_mean",
            "bn1.running_var",
            "bn2.running_mean",
            "bn2.running_var",
        ]
        assert doc["per_rank"]["statefuls"] == ["mask", "noise", "picks"]
        ta, tb = load_checkpoint_tensors(a), load_checkpoint_tensors(b)
        assert (
            ta.keys() == tb.keys() and "model.bn1.running_var@rank1" in ta and "state/noise@rank1.state" in ta
        )
        differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert not differ, f"checkpoint-{update}: {differ}"
        assert _json_view(load_statefuls(a)) == _json_view(load_statefuls(b))  # numpy's PCG64 words are JSON
    for rank in (0, 1):
        assert metrics(straight, rank) == metrics(stopped, rank)

    # The offline tools handle a checkpoint with per-rank files: export (rank 0's statistics), pack, verify, diff.
    exported = tmp_path / "export"
    assert main(["export", str(stopped), str(exported)]) == 0
    weights = load_file(str(exported / "model.safetensors"))
    final = load_tensors(stopped / f"checkpoint-{U}")
    assert torch.equal(weights["bn1.running_var"], final["model.bn1.running_var@rank0"])
    assert {k.removeprefix("model.").split("@")[0] for k in final if k.startswith("model.")} == set(weights)
    bundle = tmp_path / "bundle"
    assert main(["pack", str(stopped), str(bundle), "--code-dir", str(code)]) == 0
    assert (bundle / f"checkpoint-{U}" / "statefuls" / "rank-1.json").is_file()
    assert main(["verify", str(bundle)]) == 0
    assert main(["diff", str(straight), str(bundle)]) == 0
    shutil.rmtree(bundle)


def _json_view(states: dict[str, Any]) -> Any:
    def view(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", str(x.dtype), x.tolist())
        if isinstance(x, dict):
            return {k: view(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [view(v) for v in x]
        return x

    return view(states)
