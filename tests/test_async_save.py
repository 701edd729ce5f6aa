"""Saves in the background (async_save, the default): the loop goes on while a checkpoint is written, a stop
commits the checkpoint in flight first, and the bytes are those a synchronous save writes."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import segments
from torchrelay import RelayConfig, Run
from torchrelay.checkpoint import hashing_writer, host_buffers, host_stage
from torchrelay.checkpoint.dcp_io import read_metadata
from torchrelay.checkpoint.hashing_writer import canonical_safetensors
from torchrelay.checkpoint.inventory import read_inventory, validate_complete
from torchrelay.config.tuning import SaveTuning
from torchrelay.errors import IntegrityError
from torchrelay.policy.stop import write_request


def _config(example: dict[str, Path], **changes: Any) -> RelayConfig:
    cfg = RelayConfig(
        seed=3,
        micro_batch=2,
        total_updates=6,
        manifest=str(example["manifest"]),
        data_root=str(example["root"]),
        save_every=3,
    )
    return cfg.replace(**changes) if changes else cfg


def _loop(run: Run, hook: Any = None) -> list[int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    run.track(model=model, optimizer=opt)
    done = []
    for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
        for _, batch in step.micro_batches():
            model(torch.randn(2, 8) + float(sum(batch))).square().mean().backward()
        opt.step()
        opt.zero_grad()
        done.append(step.update)
        if hook:
            hook(step.update)
    return done


def test_the_loop_goes_on_while_a_checkpoint_persists_and_a_stop_commits_it_first(
    example: dict[str, Path], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    release = tmp_path / "release"
    run_dir.mkdir()
    write_request(run_dir, at_update=5)
    seen: dict[Any, Any] = {}

    def during(update: int) -> None:  # updates 4 and 5 run while checkpoint-3 is held in flight
        if update in (4, 5):
            seen[update] = (run._saver.persisting, (run_dir / "checkpoint-3").exists())
            seen[f"interval-{update}"] = sys.getswitchinterval()  # a persist leaves the process's GIL alone

    def at_stop() -> None:  # released once the loop has agreed to stop, not before
        for _ in range(6000):
            if run._agreement.why:
                break
            threading.Event().wait(0.01)
        seen["stop"] = (run._agreement.why, (run_dir / "checkpoint-3").exists())
        release.touch()

    interval = sys.getswitchinterval()
    with Run.open(run_dir, _config(example), code_dir=example["code"]) as run:
        run._saver._persister.hold = release  # checkpoint-3's persist waits for this file
        watcher = threading.Thread(target=at_stop, daemon=True)
        watcher.start()
        done = _loop(run, during)
        watcher.join()
    assert done == [1, 2, 3, 4, 5]
    assert seen[4] == (True, False) and seen[5] == (True, False), seen
    assert seen["interval-4"] == seen["interval-5"] == interval == sys.getswitchinterval()
    assert seen["stop"][0] and seen["stop"][1] is False, seen  # the stop came while checkpoint-3 persisted
    for update in (3, 5):  # and both were committed before the segment ended
        assert validate_complete(run_dir / f"checkpoint-{update}")["update"] == update
    seg = segments(run_dir)[-1]
    assert (seg["ended"], seg["last_update"], seg["exit_code"]) == ("request", 5, 4)


def test_background_and_inline_saves_write_the_same_bytes(example: dict[str, Path], tmp_path: Path) -> None:
    runs = {}
    for name, background in (("async", True), ("sync", False)):
        run_dir = tmp_path / name
        with Run.open(run_dir, _config(example, async_save=background), code_dir=example["code"]) as run:
            assert _loop(run) == list(range(1, 7))
        runs[name] = run_dir
    for update in (3, 6):
        a, s = (runs[n] / f"checkpoint-{update}" for n in ("async", "sync"))
        files = {e["path"]: e for e in read_inventory(a)["files"]}
        assert files.keys() == {e["path"] for e in read_inventory(s)["files"]}
        assert any(p.endswith(".distcp") for p in files) and "rng/rank-0.safetensors" in files
        for rel in files:
            if rel == "model/.metadata":  # holds the temporary directory's name and a random save id
                ma, ms = read_metadata(a / "model"), read_metadata(s / "model")
                assert ma.state_dict_metadata == ms.state_dict_metadata and ma.storage_data == ms.storage_data
            elif rel == "relay_state.json":  # names the segment
                ja, js = (json.loads((c / rel).read_text()) for c in (a, s))
                assert ja["loop"].pop("segment") != js["loop"].pop("segment") and ja == js
            else:
                assert (a / rel).read_bytes() == (s / rel).read_bytes(), rel
        validate_complete(a)


def test_safetensors_bytes_do_not_depend_on_the_metadata_order() -> None:
    from safetensors.torch import load, save

    tensors = {"b": torch.arange(3), "a": torch.ones(2, 2)}
    one = canonical_safetensors(save(tensors, metadata={"x": "1", "y": "2", "z": "3"}))
    two = canonical_safetensors(save(tensors, metadata={"z": "3", "y": "2", "x": "1"}))
    assert one == two and len(one) % 8 == 0
    back = load(one)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_host_buffers_are_reserved_below_the_loop_copied_exactly_and_given_back() -> None:
    """The reserve thread runs at the writers' lower priority (it page-locks on a GPU: benchmarks/bench_pin.py);
    a copy waits for it and is exact; a tensor whose shape changed gets a buffer of its own; release() gives
    everything back. A page-locked buffer's own mapping holds exactly the tensor's bytes: a larger storage would
    make DCP's writer clone it before writing."""
    nice: list[int] = []

    class Watched(host_stage.HostStage):
        def _make(self, *args: Any, **kwargs: Any) -> Any:
            nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return super()._make(*args, **kwargs)

    stage = Watched()
    live = {"w": torch.randn(300, 7), "b": torch.arange(5, dtype=torch.int64), "s": torch.tensor(2.5)}
    stage.reserve(host_stage.specs_of(live))
    copies = stage.copy_tree("t", live)
    assert all(torch.equal(copies[k], live[k]) and copies[k] is not live[k] for k in live)
    assert nice == [max(os.getpriority(os.PRIO_PROCESS, 0), host_buffers.BACKGROUND_NICE)] * 3, nice
    assert stage.allocated_bytes == 300 * 7 * 4 + 5 * 8 + 4
    grown = stage.copy("t/w", torch.ones(301, 7))
    assert grown.shape == (301, 7) and bool((grown == 1).all())
    stage.release()
    assert stage.allocated_bytes == 0 and not stage._bufs
    locked = host_buffers.Locked(3 * 4096 + 12)
    assert locked.tensor.untyped_storage().size() == 3 * 4096 + 12 and locked.size == 4 * 4096


def test_buffers_are_reserved_by_kind_and_taken_under_any_name() -> None:
    """The reservation knows only the tensors' kinds (shape, dtype, device): a save's copies under whatever names
    DCP gives them (a rank's own tensors under per_rank/<r>) take a reserved buffer of their kind, none is obtained
    in the stall; a kind that was not reserved is obtained at its copy, and exact."""
    made: list[str] = []

    class Watched(host_stage.HostStage):
        def _make(self, *args: Any, **kwargs: Any) -> Any:
            made.append(threading.current_thread().name)
            return super()._make(*args, **kwargs)

    stage = Watched()
    live = [torch.randn(64, 32), torch.randn(64, 32), torch.arange(7, dtype=torch.int64)]
    stage.reserve([(tuple(t.shape), t.dtype, False) for t in live])
    assert stage._threads
    stage.join()
    assert stage.ready and made == ["torchrelay-reserve"] * 3
    copies = {f"dcp/per_rank/1/x{i}": stage.copy(f"dcp/per_rank/1/x{i}", t) for i, t in enumerate(live)}
    assert made == ["torchrelay-reserve"] * 3, "a copy obtained a buffer the reservation had"
    assert all(torch.equal(c, t) for c, t in zip(copies.values(), live, strict=True))
    assert len({c.data_ptr() for c in copies.values()}) == 3
    other = stage.copy("dcp/new", torch.ones(5, dtype=torch.float64))
    assert made[-1] == threading.current_thread().name and bool((other == 1).all())
    again = stage.copy("dcp/per_rank/1/x0", live[0] * 2)
    assert again.data_ptr() == copies["dcp/per_rank/1/x0"].data_ptr() and torch.equal(again, live[0] * 2)
    assert stage.allocated_bytes == 2 * 64 * 32 * 4 + 7 * 8 + 5 * 8
    stage.release()
    assert stage.allocated_bytes == 0 and not stage._pool and not stage._bufs


def test_the_reservation_takes_every_optimizer_of_a_list() -> None:
    """`track(optimizer=[...])` (the zoo's Muon + AdamW, found by its composed run): the reservation covers each
    optimizer's state, nested containers too, and a save's copies then need no buffer of their own."""
    from torchrelay.checkpoint import state as ckpt_state

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    first = torch.optim.AdamW(model[0].parameters())
    second = torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 8)).sum().backward()
    first.step()
    second.step()
    second.state[model[1].weight]["nested"] = [torch.zeros(6), {"deep": torch.ones(2, 2)}]
    stage = host_stage.HostStage()
    ckpt_state.reserve(stage, model, [first, second], rank=0)
    assert stage._threads
    stage.join()
    kinds = {spec: len(entries) for spec, entries in stage._pool.items()}
    # the model's 4 tensors; AdamW: exp_avg, exp_avg_sq (and step) for 2 params; SGD: momentum for 2 params + 2 nested
    assert sum(kinds.values()) == 4 + 2 * 3 + 2 + 2, kinds
    assert kinds[((6,), torch.float32, False)] == 1 and kinds[((2, 2), torch.float32, False)] == 1
    stage.release()


def test_a_resume_verifies_each_file_as_it_reads_it(example: dict[str, Path], tmp_path: Path) -> None:
    """Run.open checks names and sizes; run.track hashes every file while loading it and refuses a flipped byte,
    naming the file, before the loop starts (a damaged small file too)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_request(run_dir, at_update=3)
    with Run.open(run_dir, _config(example, total_updates=4), code_dir=example["code"]) as run:
        assert _loop(run) == [1, 2, 3]
    for victim in (
        max((run_dir / "checkpoint-3" / "model").glob("*.distcp"), key=lambda p: p.stat().st_size),
        run_dir / "checkpoint-3" / "rng" / "rank-0.safetensors",
    ):
        good = victim.read_bytes()
        data = bytearray(good)
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
        with (
            pytest.raises(IntegrityError, match=f"{victim} does not match its SHA-256"),
            Run.open(run_dir, None, code_dir=example["code"]) as run,
        ):
            _loop(run)
        victim.write_bytes(good)
    with Run.open(run_dir, None, code_dir=example["code"]) as run:
        assert _loop(run) == [4]
    assert [s["ended"] for s in segments(run_dir)] == ["request", "refused", "refused", "finished"]


def test_several_files_per_rank_load_one_at_a_time_within_the_buffer(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank's tensors split over several files; a resume with room for one file at a time still reads them all,
    in DCP's order, without waiting on itself, and restores every value."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_request(run_dir, at_update=2)
    saved: dict[str, torch.Tensor] = {}
    # files of 128 bytes, and a load buffer of 1 byte: room for one file at a time
    tuned = _config(example, total_updates=3, save_tuning={"file_bytes": 128}, load_tuning={"load_buffer": 1})
    with Run.open(run_dir, tuned, code_dir=example["code"]) as run:
        _loop(
            run,
            lambda u: (
                u == 2 and saved.update({k: v.clone() for k, v in run._tracked.model.state_dict().items()})
            ),
        )
    files = sorted(p.name for p in (run_dir / "checkpoint-2" / "model").glob("*.distcp"))
    assert len(files) >= 3, files
    with Run.open(run_dir, None, code_dir=example["code"]) as run:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        run.track(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_background_writers_run_below_the_loop_a_few_files_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background persist shares the interpreter and the cores with the loop: its writer threads run at a lower
    priority (the loop's own is untouched, also after an inline save), at most TORCHRELAY_PERSIST_STREAMS files
    are written at once (a file being fsynced no longer counts), and batching small writes changes no byte of what
    is written or hashed."""
    import hashlib
    import os

    import torch.distributed.checkpoint as dcp

    tuning = SaveTuning(file_bytes=4096, kick_bytes=1024)  # the writeback started every few writes
    monkeypatch.setenv(hashing_writer.STREAMS_ENV, "2")
    writing: set[int] = (
        set()
    )  # files being written: from open until their bytes are all in (the fsync is free)
    nice: list[int] = []
    peak = [0]
    lock = threading.Lock()
    real_init, real_fileno = hashing_writer._HashingStream.__init__, hashing_writer._HashingStream.fileno

    def init(self: Any, f: Any, on_close: Any, *args: Any, **kwargs: Any) -> None:
        with lock:
            writing.add(id(self))
            peak[0] = max(peak[0], len(writing))
            nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        real_init(self, f, on_close, *args, **kwargs)

    def fileno(self: Any) -> int:  # DCP asks for it to fsync the file, once it is written
        if id(self) in writing:
            threading.Event().wait(0.02)  # a file takes a while: the next ones queue for a slot
            with lock:
                writing.discard(id(self))
        return int(real_fileno(self))

    monkeypatch.setattr(hashing_writer._HashingStream, "__init__", init)
    monkeypatch.setattr(hashing_writer._HashingStream, "fileno", fileno)
    state = {f"t{i}": torch.arange(2048 + i, dtype=torch.float32) * (i + 1) for i in range(8)}
    loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    written: dict[Path, dict[str, tuple[str, int]]] = {}
    for background in (False, True):
        out = tmp_path / f"bg-{background}"
        digests: dict[str, tuple[str, int]] = {}

        def save(
            out: Path = out, digests: dict[str, tuple[str, int]] = digests, bg: bool = background
        ) -> None:
            writer = hashing_writer.HashingWriter(out, digests, background=bg, tuning=tuning)
            dcp.save(state, storage_writer=writer, no_dist=True)

        if background:  # on a thread of its own, as the persist runs it
            worker = threading.Thread(target=save)
            worker.start()
            worker.join()
        else:
            nice.clear()
            save()
            assert set(nice) == {loop_nice}, nice  # inline: nobody's priority changes
            nice.clear()
            peak[0] = 0  # inline, DCP writes every file at once
        written[out] = digests
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == loop_nice
    assert len(nice) >= 4 and min(nice) >= min(host_buffers.BACKGROUND_NICE, 19), nice
    assert peak[0] <= 2, peak
    a, b = (tmp_path / "bg-False", tmp_path / "bg-True")
    names = sorted(p.name for p in a.glob("*.distcp"))
    assert len(names) >= 4 and names == sorted(p.name for p in b.glob("*.distcp"))
    for name in names:
        data = (b / name).read_bytes()
        assert data == (a / name).read_bytes()
        assert written[b][str(b / name)][:2] == (hashlib.sha256(data).hexdigest(), len(data))


def test_the_split_save_writes_the_files_dcp_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned during the stall, written later: the files are byte for byte those one `dcp.save` call writes with
    the same writer, and every digest recorded is the SHA-256 of the file on disk."""
    import hashlib

    import torch.distributed.checkpoint as dcp

    from torchrelay.checkpoint import dcp_save

    tuning = SaveTuning(file_bytes=16 << 10)  # several files per rank

    g = torch.Generator().manual_seed(1)
    doc = {
        "model": {f"layer{i}.weight": torch.randn(64, 16 + i, generator=g) for i in range(12)},
        "optim": {"layer0.weight\x1fexp_avg": torch.randn(64, 16, generator=g).to(torch.bfloat16)},
        "scalar": torch.tensor(3, dtype=torch.int64),
    }
    one, two = tmp_path / "dcp", tmp_path / "split"
    d1: dict[str, tuple[str, int]] = {}
    d2: dict[str, tuple[str, int]] = {}
    dcp.save(doc, storage_writer=hashing_writer.HashingWriter(one, d1, tuning=tuning), no_dist=True)
    planned = dcp_save.plan(doc)
    planned.write(two, d2, tuning=tuning)
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir()) and ".metadata" in names
    assert sum(n.endswith(".distcp") for n in names) > 1
    for name in names:
        if name == ".metadata":  # holds the directory's name and a random save id
            m1, m2 = (dcp.FileSystemReader(str(d)).read_metadata() for d in (one, two))
            assert m1.state_dict_metadata == m2.state_dict_metadata and m1.storage_data == m2.storage_data
        else:
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert {Path(p).name for p in d2} == set(names)
    for path, (sha, size, *_states) in d2.items():
        data = Path(path).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha, size), path
    back = {k: torch.empty_like(v) for k, v in doc["model"].items()}
    dcp.load({"model": back}, checkpoint_id=str(two), no_dist=True)
    assert all(torch.equal(back[k], doc["model"][k]) for k in back)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_training_thread_plans_and_the_persist_thread_only_writes(
    example: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """DCP's plan is pure Python over every tensor: run beside the loop it held the GIL the loop needed (the update
    overlapping it took up to 4.5 x as long on the H200 host). It is made during the save's stall instead, on the
    training thread, while the copies land; the persist thread only writes. With the writer process, the writer's
    job (every item resolved to its buffer's address) is made in the stall too: nothing of DCP's runs beside the
    loop in the training process (the update after each stall took 1.10-1.20x while the persist thread made it)."""
    monkeypatch.setenv("TORCHRELAY_PERSIST_WRITER", writer)
    if (
        writer == "process"
    ):  # every save waits for the writer to have started (a save before writes from a thread)
        from torchrelay.checkpoint.writer_process import WriterProcess

        started = WriterProcess.ready

        def ready(self: WriterProcess, *, wait: bool = False) -> bool:
            return started(self, wait=True)

        monkeypatch.setattr(WriterProcess, "ready", ready)
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planned_on: list[str] = []
    written_on: list[str] = []
    real_plan, real_resolve = DefaultSavePlanner.create_local_plan, DefaultSavePlanner.resolve_data

    def create_local_plan(self: Any) -> Any:
        planned_on.append(threading.current_thread().name)
        return real_plan(self)

    def resolve_data(self: Any, item: Any) -> Any:
        written_on.append(threading.current_thread().name)
        return real_resolve(self, item)

    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", create_local_plan)
    monkeypatch.setattr(DefaultSavePlanner, "resolve_data", resolve_data)
    with Run.open(tmp_path / "run", _config(example), code_dir=example["code"]) as run:
        assert _loop(run) == list(range(1, 7))
    assert planned_on == [threading.main_thread().name] * 2  # checkpoint-3 and checkpoint-6
    if writer == "thread":
        assert written_on and threading.main_thread().name not in written_on
    else:
        assert written_on and set(written_on) == {threading.main_thread().name}
    validate_complete(tmp_path / "run" / "checkpoint-3")


@pytest.mark.launch
def test_a_failure_of_any_rank_in_the_plan_or_the_write_is_raised_on_every_rank(tmp_path: Path) -> None:
    """Two ranks over gloo: the split save writes what dcp.save would (the tensors equal on both ranks once); a
    failure in one rank's local plan, in the coordinator's global plan or in one rank's write is raised on both,
    naming the rank and the half, and no rank waits in a collective; a failed write leaves no `.metadata`."""
    from helpers import TORCHRUN, clean_env, run_tree

    script = Path(__file__).with_name("dist_dcp_save.py")
    done = run_tree(
        [
            TORCHRUN,
            "--standalone",
            "--nproc_per_node=2",
            "--monitor_interval=0.5",
            str(script),
            str(tmp_path),
        ],
        timeout=240,
        env=clean_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen-rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["ok"] for s in seen] == ["ok", "ok"]
    assert "__0_0.distcp" in seen[0]["ok_files"] and ".metadata" in seen[0]["ok_files"]
    assert any(name.startswith("__1_") for name in seen[1]["ok_files"])  # rank 1 writes its own tensor
    # the failing rank keeps its own exception (a bug: its traceback), the other raises one line naming it
    assert seen[1]["local"] == "RuntimeError: boom in the local plan", seen[1]["local"]
    assert seen[0]["local"].startswith(
        "RelayError: the plan of the checkpoint's tensors failed on rank 1 with RuntimeError: boom in the local plan"
    ), seen[0]["local"]
    assert seen[0]["global"] == "RuntimeError: boom in the global plan", seen[0]["global"]
    assert seen[1]["global"].startswith(
        "RelayError: the plan of the checkpoint's tensors failed on rank 0 with RuntimeError: boom in the global"
    ), seen[1]["global"]
    for s in seen:  # a path the rank cannot write: the same refusal on both ranks
        assert s["write"].startswith("PathError: the write of the checkpoint's tensors failed on rank 1: ")
    assert (tmp_path / "write").is_dir() and not (tmp_path / "write" / ".metadata").exists()
    import torch.distributed.checkpoint as dcp

    back = {"model": {f"w{i}": torch.zeros(64) for i in range(6)}}
    dcp.load(back, checkpoint_id=str(tmp_path / "ok"), no_dist=True)
    assert all(torch.equal(back["model"][f"w{i}"], torch.arange(64.0) * (i + 1)) for i in range(6))
