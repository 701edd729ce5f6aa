"""A host buffer page-locked in pieces (checkpoint/host_stage.py, SaveTuning.pin_piece_bytes): the cuts cover the mapping
exactly, each inside one piece of the address space, and a copy cut at them puts every byte where one copy would,
for every dtype, shape and layout a state holds. The registrations themselves need CUDA
(tests/test_host_stage_cuda.py); the cutting and the copying run here."""

from __future__ import annotations

import mmap

import pytest
import torch

from torchrelay.checkpoint import host_buffers

PAGE = mmap.PAGESIZE


@pytest.mark.parametrize(
    ("base", "size", "piece"),
    [
        (0, 10 * PAGE, 4 * PAGE),  # aligned start, short last piece
        (3 * PAGE, 10 * PAGE, 4 * PAGE),  # starts inside a piece
        (5 * PAGE, 3 * PAGE, 4 * PAGE),  # crosses one boundary
        (4 * PAGE, 4 * PAGE, 4 * PAGE),  # exactly one piece
        (7 * PAGE, 9 * PAGE, 0),  # 0: whole
        ((1 << 30) + 12 * PAGE, (64 << 20) + 5 * PAGE, 16 << 20),  # a real buffer's shape
    ],
)
def test_pieces_cover_the_mapping_once_each_inside_one_piece(base: int, size: int, piece: int) -> None:
    cuts = host_buffers.pieces(base, size, piece)
    assert cuts[0][0] == 0 and sum(n for _, n in cuts) == size
    assert all(off + n == nxt for (off, n), (nxt, _) in zip(cuts, cuts[1:], strict=False))
    assert all(n > 0 for _, n in cuts)
    if piece:
        for off, n in cuts:  # each inside one piece of the address space, and as long as it can be
            first, last = (base + off) // piece, (base + off + n - 1) // piece
            assert first == last
        assert len(cuts) == (base + size - 1) // piece - base // piece + 1
    else:
        assert cuts == [(0, size)]


def _mapped(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, torch.frombuffer(m, dtype=torch.uint8)


@pytest.mark.parametrize(
    ("dtype", "shape", "layout"),
    [
        (torch.float32, (1000, 77), "contiguous"),
        (torch.bfloat16, (3, 5001, 7), "contiguous"),
        (torch.float64, (257, 129), "transposed"),
        (torch.int64, (40_000,), "strided"),
        (torch.bool, (123_457,), "contiguous"),
        (torch.complex64, (999, 33), "transposed"),
        (torch.float8_e4m3fn, (50_001,), "contiguous"),
        (torch.complex64, (4001, 5), "conjugated"),  # a conj view: its bit set, not applied
        (torch.float32, (70_001,), "negated"),  # a neg view, as `x.conj().imag` gives
    ],
)
def test_a_copy_cut_at_the_pieces_is_the_whole_copy(
    dtype: torch.dtype, shape: tuple[int, ...], layout: str
) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 1
    for d in shape:
        n *= d
    high = 2 if dtype == torch.bool else 256  # a bool's byte is 0 or 1
    raw = torch.randint(
        0, high, (2 * n * torch.empty((), dtype=dtype).element_size(),), generator=gen, dtype=torch.uint8
    )
    full = raw.view(dtype)[: 2 * n]
    if layout == "contiguous":
        src = full[:n].view(shape)
    elif layout == "transposed":
        src = full[:n].view(shape[::-1]).t()
    elif layout == "conjugated":
        src = full[:n].view(shape).conj()
        assert src.is_conj()
    elif layout == "negated":
        src = torch._neg_view(full[:n].view(shape))
        assert src.is_neg()
    else:  # every other element
        src = full[::2][:n].view(shape)
    assert src.is_contiguous() == (layout in ("contiguous", "conjugated", "negated"))
    nbytes = n * src.element_size()
    m, flat = _mapped(nbytes)
    dst = flat.view(dtype).view(src.shape)
    cuts = host_buffers.pieces(flat.data_ptr(), -(-nbytes // PAGE) * PAGE, 3 * PAGE)
    assert len(cuts) > 3
    host_buffers.copy_in_pieces(dst, src, cuts, non_blocking=False)
    whole = torch.empty(src.shape, dtype=dtype)
    whole.copy_(src)  # what one copy puts there (a conjugate or a negation applied)
    assert torch.equal(flat, whole.reshape(-1).view(torch.uint8)), "a byte differs from one whole copy"
    del dst, flat
    m.close()


def test_a_mapping_page_locked_nowhere_is_copied_whole_and_given_back() -> None:
    """Without CUDA no piece registers: `lock` reports the buffer pageable, its copies are one synchronous copy, and
    release has nothing to unregister."""
    if torch.cuda.is_available():
        pytest.skip("CUDA registers here: tests/test_host_stage_cuda.py covers it")
    locked = host_buffers.Locked(5 << 20)
    assert locked.lock(1 << 20) is False
    assert locked.cuts == [(0, locked.size)] and not locked.registered
    src = torch.arange((5 << 20) // 4, dtype=torch.float32)
    dst = locked.tensor.view(torch.float32)
    locked.copy_from(dst, src)
    assert torch.equal(dst, src)
    locked.release()
