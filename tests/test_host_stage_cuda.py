"""The host buffers of CUDA tensors (checkpoint/host_stage.py), where a GPU is: a save that comes before the
reservation obtained every buffer leaves the rest to the persist (clones on the device, spill_to_device), and what
the persist then writes is the state at the save, not the state after it. Skipped without CUDA (the CPU VM); run
on the GPU machine (`PYTHONPATH=src python -m pytest tests/test_host_stage_cuda.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from torchrelay.checkpoint import host_buffers, host_stage
from torchrelay.config.tuning import SaveTuning

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _live(n: int = 24, numel: int = 1 << 20) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(7)
    live = {f"w{i}": torch.randn(numel, device="cuda", generator=gen) for i in range(n)}
    live["bias"] = torch.randn(300, device="cuda", generator=gen)  # under pin_min_bytes: never deferred
    live["t"] = torch.randn(64, 4096, device="cuda", generator=gen).t()  # not contiguous
    return live


def _saved_at_once(
    live: dict[str, torch.Tensor], shared: bool, tuning: SaveTuning | None = None
) -> tuple[host_stage.HostStage, Any]:
    """A stage whose reservation has just begun, and a save's copies of `live` into it, landed."""
    stage = host_stage.HostStage(shared=shared, tuning=tuning)
    stage.reserve(host_stage.specs_of(live))
    copies = stage.copy_tree("s", live)
    stage.synchronize()
    return stage, copies


@pytest.mark.parametrize("fillers", [1, 3], ids=["one-filler", "three-fillers"])
@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_save_before_the_buffers_copies_the_state_at_the_save(shared: bool, fillers: int) -> None:
    """The reservation is paced (pin_pace), so a copy right after it starts finds most buffers missing: those are
    cloned on the device, the live tensors then change (the loop goes on), and `finish_deferred` still puts the
    values of the save's moment into page-locked buffers (filled by one thread or by `defer_threads`)."""
    live = _live()
    want = {k: v.cpu() for k, v in live.items()}
    stage, copies = _saved_at_once(live, shared, SaveTuning(defer_threads=fillers))
    deferred = stage.deferred
    assert deferred > 0, "the reservation obtained every buffer before the save: nothing was deferred"
    for v in live.values():
        v.add_(1.0)  # the next update
    torch.cuda.synchronize()
    stage.finish_deferred()
    assert stage.deferred == 0
    for k in want:
        assert torch.equal(copies[k], want[k]), k
    # the next save copies into the same buffers, with nothing deferred, once they are page-locked
    again = stage.copy_tree("s", live)
    stage.synchronize()
    assert stage.deferred == 0 and stage.ready
    locked = [stage._locked[f"s/{k}"] for k in live if f"s/{k}" in stage._locked]
    assert len(locked) >= deferred and all(lk.registered for lk in locked)
    for k in want:
        assert again[k].data_ptr() == copies[k].data_ptr() and torch.equal(again[k], want[k] + 1.0), k
    stage.release()


def test_without_room_on_the_device_the_stall_obtains_the_buffers() -> None:
    """`spill_headroom` of the whole device: no clone fits, and the copies are exact, nothing left to the persist."""
    live = _live(8)
    stage, copies = _saved_at_once(live, shared=True, tuning=SaveTuning(spill_headroom=1.0))
    assert stage.deferred == 0
    assert all(torch.equal(copies[k], live[k].cpu()) for k in live)
    stage.release()


def test_a_loop_saving_before_its_buffers_resumes_exactly(tmp_path: Path) -> None:
    """A real Run on the GPU: the first save at update 3, before the reservation that started at update 2's due()
    can have page-locked the state (2.4 GB: about a second at the 2 GB/s page-locking measured on an H100; a 144 MB
    state was locked by update 3 there, and nothing was deferred), the model trained on; a resume from that
    checkpoint holds the state of update 3, bit for bit."""
    import os

    import torch.distributed as dist

    import torchrelay as tr

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        manifest = tmp_path / "manifest.jsonl"
        manifest.write_text("".join(f'{{"id": "{i}"}}\n' for i in range(64)))
        cfg = tr.RelayConfig(
            seed=0, micro_batch=1, total_updates=50, save_every=3, manifest=str(manifest), keep=2
        )

        def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(12)]).cuda()
            return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

        model, opt = build()
        run = tr.Run.open(tmp_path / "run", cfg, code_dir=tmp_path)
        run.track(model=model, optimizer=opt)
        saver = run._saver
        at_save: dict[str, torch.Tensor] = {}
        deferred = 0
        for done in range(1, 6):
            opt.zero_grad()
            model(torch.randn(8, 4096, device="cuda")).square().mean().backward()
            opt.step()
            if saver.due(done):
                saver.save(done)
                deferred = saver._stage.deferred
                at_save = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        saver.wait()
        assert deferred > 0, "the buffers were all obtained by update 3: nothing deferred"
        run._end_segment(5)
        saver.close()
        model2, opt2 = build()
        run2 = tr.Run.open(tmp_path / "run", cfg, code_dir=tmp_path)
        run2.track(model=model2, optimizer=opt2)
        assert run2.start_update == 3
        got = {k: v.detach().cpu() for k, v in model2.state_dict().items()}
        assert got.keys() == at_save.keys() and all(torch.equal(got[k], at_save[k]) for k in got)
        run2._end_segment(3)
        run2._saver.close()
    finally:
        dist.destroy_process_group()


def test_buffers_registered_in_pieces_take_asynchronous_copies_exactly() -> None:
    """`pin_piece_bytes` of 4 MiB: each large buffer is several registrations, every one held; the copies into it
    (one per piece, asynchronous) land every byte, and the next save's copies reuse the same buffers."""
    live = {f"w{i}": torch.randn(3 * (1 << 20) + 7 * i, device="cuda") for i in range(6)}  # 12 MiB + a few
    live["t"] = torch.randn(1024, 4096, device="cuda").t()  # 16 MiB, not contiguous
    stage = host_stage.HostStage(tuning=SaveTuning(pin_piece_bytes=4 << 20, pin_pace=1))
    stage.reserve(host_stage.specs_of(live))
    stage.join()
    copies = stage.copy_tree("s", live)
    stage.synchronize()
    for k, v in live.items():
        locked = stage._locked[f"s/{k}"]
        assert locked.registered and len(locked.cuts) >= 3 and len(locked._held) == len(locked.cuts), k
        assert torch.equal(copies[k], v.cpu()), k
    for v in live.values():
        v.mul_(-2.0)
    again = stage.copy_tree("s", live)
    stage.synchronize()
    assert all(torch.equal(again[k], live[k].cpu()) for k in live)
    held = list(stage._locked.values())
    stage.release()
    assert held and all(not lk._held and not lk.registered for lk in held)


def test_a_save_before_the_reservation_began_joins_both_threads() -> None:
    """A first save before `reserve` (save_every 1): its persist's `finish_deferred` starts the registering thread
    while the loop starts the reservation's; the next save waits for both, every buffer it copies into is
    page-locked, the bytes are exact, and release gives every registration back."""
    import threading

    live = _live(8)
    want = {k: v.cpu() for k, v in live.items()}
    stage = host_stage.HostStage()
    copies = stage.copy_tree("s", live)
    stage.synchronize()
    assert stage.deferred > 0
    persist = threading.Thread(target=stage.finish_deferred)
    persist.start()
    stage.reserve(host_stage.specs_of(live))  # the loop's next due(), meanwhile
    persist.join()
    assert all(torch.equal(copies[k], want[k]) for k in want)
    for v in live.values():
        v.add_(1.0)
    again = stage.copy_tree("s", live)
    stage.synchronize()
    assert stage.ready and not stage._threads
    assert all(torch.equal(again[k], want[k] + 1.0) for k in want)
    assert all(lk.registered for lk in stage._locked.values())
    held = list(stage._locked.values()) + [e.locked for es in stage._pool.values() for e in es if e.locked]
    stage.release()
    assert all(not lk._held for lk in held)


def test_a_piece_cuda_refuses_leaves_the_buffer_registered_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second piece's registration refused: the first is given back, the buffer registered in one piece, and
    its copies are exact."""
    real = host_buffers.Locked.register_range
    refused: list[int] = []

    def refuse_second(self: host_buffers.Locked, offset: int, length: int) -> bool:
        if offset > 0 and length < self.size and not refused:
            refused.append(offset)
            return False
        return real(self, offset, length)

    monkeypatch.setattr(host_buffers.Locked, "register_range", refuse_second)
    locked = host_buffers.Locked(20 << 20)
    host_buffers.touch(locked.tensor)
    assert locked.lock(4 << 20)
    assert refused and locked.cuts == [(0, locked.size)] and locked._held == [0]
    src = torch.randn(5 << 20, device="cuda")
    dst = locked.tensor.view(torch.float32)
    locked.copy_from(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu())
    locked.release()
