"""The storage seam (checkpoint/storage.py) and the memory tier's choice (checkpoint/tiers.py), on real files and no
process launch: what is staged is invisible until published, the marker is written last, retention deletes through
`delete`; a memory checkpoint is chosen only when every file hashes to its inventory and every binding holds. The
seam's contract runs against the local file system and the object store (storage/checkpoints.py) on the real S3
server (tests/s3_server.py)."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from torchrelay.checkpoint.inventory import (
    INVENTORY,
    inventory_entries,
    inventory_entry,
    list_files,
    write_inventory,
)
from torchrelay.checkpoint.storage import (
    CheckpointStorage,
    CheckpointStore,
    LocalStorage,
    as_storage,
    wait_deletions,
)
from torchrelay.checkpoint.tiers import Binding, choose_memory, forget, memory_root
from torchrelay.errors import IntegrityError
from torchrelay.paths.rundir import RunDir
from torchrelay.util.sha256_parts import MIN_PART_BYTES, PartHasher


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
    root = memory_root("lin", RunDir(run))
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
    forget("lin", RunDir(run))
    assert not root.exists() and not root.parent.exists()


def test_a_memory_checkpoint_of_another_host_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHRELAY_MEMORY_ROOT", str(tmp_path / "shm"))
    run = tmp_path / "run"
    root = memory_root("lin", RunDir(run))
    root.mkdir(parents=True)
    good = _binding(run)
    info = {**good.info(), "contract_sha256": good.contract_sha256, "segment": "s1", "host": "elsewhere"}
    _publish(LocalStorage(root, spare=False), 5, b"a" * 8, **info)
    choice = choose_memory(root, good, durable_update=0, segments={"s1"})
    assert choice.checkpoint is None
    assert choice.refused == [
        f"memory checkpoint-5 refused: its host is 'elsewhere', this launch's is {socket.gethostname()!r}"
    ]


# ------------------------------------------------------------------ the seam's contract, on each of its backends
PART = MIN_PART_BYTES  # 1 MiB parts: a 2.5 MiB file has three, each with its recorded SHA-256 state


def _contract_files(update: int) -> dict[str, bytes]:
    rng = random.Random(update)
    return {"model/part.bin": rng.randbytes(PART * 5 // 2), "meta.json": b'{"update": %d}' % update}


def _stage_files(staged: Path, update: int) -> Callable[[Path], None]:
    """Write update's files into `staged`; the marker that lists them with their part states."""
    files = _contract_files(update)
    entries = []
    for rel, data in files.items():
        (staged / rel).parent.mkdir(parents=True, exist_ok=True)
        (staged / rel).write_bytes(data)
        hasher = PartHasher(PART)
        hasher.update(data)
        parts = (PART, tuple(hasher.states)) if hasher.states and len(data) > PART else None
        entries.append(inventory_entry(rel, hasher.hexdigest(), len(data), parts))
    return lambda d: write_inventory(d, entries, update=update, world_size=1)


def _local(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[CheckpointStore, Callable[[int], Path]]:
    storage = LocalStorage(tmp_path / "run")
    storage.root.mkdir()

    return storage, storage.stage


def _object(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[CheckpointStore, Callable[[int], Path]]:
    from torchrelay.storage.base import open_store
    from torchrelay.storage.checkpoints import ObjectStorage
    from torchrelay.storage.url import parse_url

    url = parse_url(f"s3://{request.getfixturevalue('s3_bucket')}/tier")
    (tmp_path / "stage").mkdir()

    def stage(update: int) -> Path:  # a store publishes a folder complete on a local disk
        (tmp_path / "stage" / f"staged-{update}").mkdir()
        return tmp_path / "stage" / f"staged-{update}"

    return ObjectStorage(open_store(url), url), stage


@pytest.mark.parametrize(
    "backend", [_local, pytest.param(_object, marks=pytest.mark.s3)], ids=["local", "s3"]
)
def test_every_backend_keeps_the_seam_s_contract(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    backend: Callable[..., tuple[CheckpointStore, Callable[[int], Path]]],
) -> None:
    """Publish with the marker last, list only what has one as complete, read a range across part boundaries,
    delete: the same checks on the run directory's backend and the object store's."""
    storage, stage = backend(tmp_path, request)
    assert isinstance(storage, CheckpointStore)
    assert isinstance(storage, CheckpointStorage) == (backend is _local)  # staging is a file system's only
    for update in (1, 2, 3):
        staged = stage(update)
        marker = _stage_files(staged, update)
        assert update not in [
            c.update for c in storage.list_complete() if c.complete
        ]  # nothing staged is visible
        storage.publish(staged, update, marker)
    assert [c.update for c in storage.list_complete() if c.complete] == [1, 2, 3]
    assert [c.update for c in storage.list_complete()] == [1, 2, 3]

    # a publish cut before its marker: never listed as complete, never read
    staged = stage(4)
    _stage_files(staged, 4)

    def killed(d: Path) -> None:
        raise OSError("killed before the inventory")

    with pytest.raises(OSError, match="killed"):
        storage.publish(staged, 4, killed)
    assert [c.update for c in storage.list_complete() if c.complete] == [1, 2, 3]

    # ranges: inside one part, across two part boundaries, at the end (fewer bytes), in a small file
    data = _contract_files(2)["model/part.bin"]
    for offset, length in ((10, 100), (PART - 7, PART + 14), (len(data) - 5, 100), (0, len(data))):
        assert storage.read_range(2, "model/part.bin", offset, length) == data[offset : offset + length]
    assert storage.read_range(3, "meta.json", 2, 6) == b"update"

    storage.delete([1, 2])
    wait_deletions()
    assert [c.update for c in storage.list_complete() if c.complete] == [3]
    assert storage.read_range(3, "model/part.bin", 0, 4) == _contract_files(3)["model/part.bin"][:4]


@pytest.mark.s3
def test_the_object_store_lists_an_upload_without_its_marker_as_incomplete_and_reads_only_verified_bytes(
    tmp_path: Path, s3_bucket: str
) -> None:
    """A store has no rename: a publish killed after some objects went up leaves a prefix without COMPLETE.json,
    which is listed incomplete and never read; bytes changed in the store after the commit are refused."""
    import boto3

    from torchrelay.storage.base import open_store
    from torchrelay.storage.checkpoints import ObjectStorage
    from torchrelay.storage.url import parse_url

    url = parse_url(f"s3://{s3_bucket}/tier")
    storage = ObjectStorage(open_store(url), url)
    staged = tmp_path / "checkpoint-5"
    staged.mkdir()
    marker = _stage_files(staged, 5)
    marker(staged)
    storage.publish(staged, 5, lambda _: None)  # a committed local checkpoint: its marker is there

    staged = tmp_path / "checkpoint-6"
    staged.mkdir()
    marker = _stage_files(staged, 6)

    def lose_a_file(d: Path) -> None:  # the upload dies at the second file, the first already in the store
        marker(d)
        (d / "model" / "part.bin").unlink()

    with pytest.raises(OSError):
        storage.publish(staged, 6, lose_a_file)
    listed = storage.list_complete()
    assert [(c.update, c.complete) for c in listed] == [(5, True), (6, False)]
    assert INVENTORY in listed[1].reason and listed[1].size > 0
    with pytest.raises(IntegrityError, match="not committed"):
        storage.read_range(6, "meta.json", 0, 4)

    # one byte of the committed checkpoint changed in the store, its size the same: the part holding it is refused
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    data = bytearray(_contract_files(5)["model/part.bin"])
    data[PART + 3] ^= 1
    s3.put_object(Bucket=s3_bucket, Key="tier/checkpoint-5/model/part.bin", Body=bytes(data))
    fresh = ObjectStorage(open_store(url), url)
    assert fresh.read_range(5, "model/part.bin", 0, 16) == bytes(data[:16])  # part 0 still matches
    with pytest.raises(IntegrityError, match="do not match the SHA-256 states"):
        fresh.read_range(5, "model/part.bin", PART, 16)
    fresh.delete([5, 6])
    assert fresh.list_complete() == []
    assert [k["Key"] for k in s3.list_objects_v2(Bucket=s3_bucket).get("Contents", [])] == []
