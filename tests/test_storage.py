"""The storage seam (checkpoint/storage.py) and the memory tier's choice (checkpoint/tiers.py), on real files and no
process launch: what is staged is invisible until published, the marker is written last, retention deletes through
`delete`; a memory checkpoint is chosen only when every file hashes to its inventory and every binding holds."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory
from torchrelay.checkpoint.storage import CheckpointStorage, LocalStorage, as_storage, wait_deletions
from torchrelay.checkpoint.tiers import Binding, choose_memory, forget, memory_root


def _publish(storage: LocalStorage, update: int, data: bytes, **info: object) -> Path:
    staged = storage.stage(update)
    storage.write_part(staged, "model/part.bin", data)
    assert update not in [c.update for c in storage.list_complete()]  # nothing staged is visible
    entries = inventory_entries(staged, list_files(staged))
    return storage.publish(
        staged, update, lambda d: write_inventory(d, entries, update=update, world_size=2, **info)
    )


def test_local_storage_publishes_lists_reads_and_deletes(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    assert isinstance(storage, CheckpointStorage) and as_storage(tmp_path).root == tmp_path
    for update in (1, 2, 3):
        final = _publish(storage, update, bytes([update]) * 100)
        assert final == tmp_path / f"checkpoint-{update}" and (final / "COMPLETE.json").is_file()
    assert [c.update for c in storage.list_complete() if c.complete] == [1, 2, 3]
    assert storage.read_range(2, "model/part.bin", 10, 5) == b"\x02" * 5
    storage.delete([1, 2])
    wait_deletions()
    assert [c.update for c in storage.list_complete()] == [3]
    # the newest one retired is the run directory's spare (recycle.py); the other is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare-checkpoint", "checkpoint-3"]


def test_a_publish_cut_before_its_marker_leaves_nothing_a_reader_sees(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)

    def marker(d: Path) -> None:
        raise OSError("killed before the inventory")

    staged = storage.stage(4)
    storage.write_part(staged, "model/part.bin", b"x" * 10)
    with pytest.raises(OSError):
        storage.publish(staged, 4, marker)
    assert storage.list_complete() == [] and not (tmp_path / "checkpoint-4").exists()


def _binding(run: Path, contract: str = "c" * 64) -> Binding:
    return Binding("lin", str(run), contract, world_size=2, micro_batch=4, grad_accum=2)


def test_the_newest_verified_memory_checkpoint_is_chosen_and_a_refused_one_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(tmp_path / "shm"))
    run = tmp_path / "run"
    root = memory_root("lin", run)
    root.mkdir(parents=True)
    storage = LocalStorage(root, spare=False)
    good = _binding(run)
    info = {**good.info(), "contract_sha256": good.contract_sha256, "segment": "s1"}
    _publish(storage, 9, b"a" * 64, **info)
    _publish(storage, 10, b"b" * 64, **info)
    _publish(storage, 11, b"c" * 64, **{**info, "contract_sha256": "d" * 64})  # another contract's
    bad = root / "checkpoint-10" / "model" / "part.bin"
    bad.write_bytes(b"b" * 63 + b"X")  # one byte changed, its size the same

    choice = choose_memory(root, good, durable_update=8, segments={"s1"})
    assert choice.checkpoint == root / "checkpoint-9" and choice.update == 9
    assert choice.refused == [
        f"memory checkpoint-11 refused: its contract_sha256 is {'d' * 64!r}, this launch's is {'c' * 64!r}",
        f"memory checkpoint-10 refused: {bad} does not match its SHA-256 in COMPLETE.json",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-9"]  # the refused futures are gone

    # older than the durable tier's newest, or of a segment the history does not know: the durable tier
    assert choose_memory(root, good, durable_update=9, segments={"s1"}).checkpoint is None
    other = choose_memory(root, good, durable_update=8, segments={"s2"})
    assert other.checkpoint is None and other.refused == [
        "memory checkpoint-9 refused: its segment 's1' is not in this run's history"
    ]
    forget("lin", run)
    assert not root.exists() and not root.parent.exists()


def test_a_memory_checkpoint_of_another_host_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(tmp_path / "shm"))
    run = tmp_path / "run"
    root = memory_root("lin", run)
    root.mkdir(parents=True)
    good = _binding(run)
    info = {**good.info(), "contract_sha256": good.contract_sha256, "segment": "s1", "host": "elsewhere"}
    _publish(LocalStorage(root, spare=False), 5, b"a" * 8, **info)
    choice = choose_memory(root, good, durable_update=0, segments={"s1"})
    assert choice.checkpoint is None
    assert choice.refused == [
        f"memory checkpoint-5 refused: its host is 'elsewhere', this launch's is {socket.gethostname()!r}"
    ]
