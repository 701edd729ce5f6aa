"""How fast a save and a load go: the tunables of the checkpoint core, as typed objects (not module switches).

None of these changes a byte of what is saved or restored; they change how many threads, buffers and requests
carry it. The defaults are the measured best on the GPU hosts (benchmarks/RESULTS.md); a benchmark compares
variants by passing objects, never by patching the library. `RelayConfig.save_tuning` / `load_tuning` carry them
into a run (runtime fields: they may change between segments).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchrelay.util import schema


@dataclass(kw_only=True, slots=True, frozen=True)
class SaveTuning:
    """The tunables of a save: host staging (checkpoint/host_stage.py), the persist (checkpoint/persist.py) and
    the saver (run/saver.py)."""

    # DCP files per rank: about one per this many bytes of tensors (at most 16, one per tensor)
    file_bytes: int = field(
        default=256 << 20, metadata={"min": 1, "doc": "bytes of tensors per file of a rank"}
    )
    persist_streams: int = field(
        default=8,
        metadata={
            "min": 1,
            "doc": "files a rank writes at once in the background (TORCHRELAY_PERSIST_STREAMS wins)",
        },
    )
    kick_bytes: int = field(
        default=64 << 20,
        metadata={"min": 0, "doc": "start a file's writeback every this many bytes (0: at its fsync)"},
    )
    # staging: a background thread obtains and page-locks the host buffers, asleep (pin_pace - 1) x each step
    pin_pace: int = field(
        default=10, metadata={"min": 1, "doc": "the reservation sleeps (pace - 1) x its work"}
    )
    pin_piece_bytes: int = field(
        default=4 << 20, metadata={"min": 0, "doc": "bytes page-locked per registration (0: a buffer whole)"}
    )
    pin_min_bytes: int = field(
        default=1 << 20, metadata={"min": 0, "doc": "smaller buffers come from torch's pinned allocator"}
    )
    pin_by_register: bool = field(
        default=True, metadata={"doc": "page-lock by cudaHostRegister of own mappings (false: cudaHostAlloc)"}
    )
    spill_to_device: bool = field(
        default=True,
        metadata={"doc": "a save before the buffers are ready clones the rest on the device for the persist"},
    )
    spill_headroom: float = field(
        default=0.05, metadata={"min": 0.0, "max": 1.0, "doc": "device memory share the clones leave free"}
    )
    defer_threads: int = field(default=1, metadata={"min": 1, "doc": "threads that fill the spilled buffers"})
    touch_threads: int = field(default=4, metadata={"min": 1, "doc": "threads faulting in a shared buffer"})
    freeze_gc: bool = field(
        default=True, metadata={"doc": "gc.freeze the heap after a segment's first update (until the close)"}
    )

    def __post_init__(self) -> None:
        schema.check(self, "save_tuning")


@dataclass(kw_only=True, slots=True, frozen=True)
class LoadTuning:
    """The tunables of the verified load (checkpoint/verified_read.py)."""

    read_streams: int = field(default=16, metadata={"min": 1, "doc": "reading threads per rank"})
    chunk_bytes: int = field(default=16 << 20, metadata={"min": 1, "doc": "bytes one read asks for"})
    load_buffer: int = field(
        default=4 << 30,
        metadata={
            "min": 0,
            "doc": "host bytes held per rank (0: memory_share of MemAvailable per local rank)",
        },
    )
    memory_share: float = field(
        default=0.5, metadata={"min": 0.0, "max": 1.0, "doc": "share of MemAvailable with load_buffer 0"}
    )
    per_file_reader: bool | None = field(
        default=None,
        metadata={"doc": "a thread per whole file (null: where the buffer holds a file per thread)"},
    )
    files_at_once: int = field(
        default=4, metadata={"min": 1, "doc": "files sharing the reads (shared chunks)"}
    )
    parse_threads: int = field(default=16, metadata={"min": 1, "doc": "threads parsing and copying items"})
    hash_threads: int = field(
        default=4, metadata={"min": 0, "doc": "threads hashing arrived chunks (0: the reading thread)"}
    )
    readers_hash_last: bool = field(
        default=True, metadata={"doc": "idle reading threads hash the last parts themselves"}
    )
    use_parts: bool = field(
        default=True, metadata={"doc": "verify files in parts where the inventory lists them"}
    )
    partial_reads: bool = field(
        default=True, metadata={"doc": "read only the parts holding a rank's items (<= a third of a file)"}
    )
    reuse_slabs: bool = field(
        default=True, metadata={"doc": "files reuse slabs of host memory held per load"}
    )
    rooms_ahead: int = field(
        default=1,
        metadata={"doc": "slab rooms beyond the files read at once (negative: all the budget allows)"},
    )
    free_later: bool = field(default=True, metadata={"doc": "give the slabs back on a thread after the load"})

    def __post_init__(self) -> None:
        schema.check(self, "load_tuning")


__all__ = ["LoadTuning", "SaveTuning"]
