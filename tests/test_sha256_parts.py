"""A file's SHA-256 verified in parts (util/sha256_parts.py): the persist records the hash's state every part, the
inventory lists the states, and the verified load checks each part on any thread and uses each item once the parts
holding its bytes matched. The proof stays the whole file's SHA-256: every hostile state or byte fails it."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchrelay.checkpoint import dcp_io, verified_read
from torchrelay.checkpoint.commit import commit_checkpoint
from torchrelay.checkpoint.hashing_writer import HashingWriter
from torchrelay.checkpoint.inventory import (
    inventory_entry,
    read_inventory,
    validate_complete,
    write_inventory,
)
from torchrelay.checkpoint.retention import LatestN
from torchrelay.checkpoint.state import load_state, save_state
from torchrelay.config.tuning import LoadTuning
from torchrelay.errors import IntegrityError
from torchrelay.util import sha256_parts

# The LoadTuning fields a test sets (monkeypatch.setitem: undone after it), passed to every load below.
TUNING: dict[str, Any] = {}

MIB = 1 << 20
pytestmark = pytest.mark.skipif(
    not sha256_parts.available(), reason="libcrypto's SHA256 functions are missing"
)


@pytest.mark.parametrize("size", [0, 1, 63, 64, MIB, 3 * MIB, 3 * MIB + 5])
def test_states_recorded_while_hashing_check_each_part_and_end_in_the_files_sha256(size: int) -> None:
    data = bytearray(os.urandom(size))
    hasher = sha256_parts.PartHasher(MIB)
    done = 0
    for piece in (7, 777_777, 64, MIB, 1):  # pieces that straddle the boundaries, then the rest in one
        hasher.update(memoryview(data)[done : done + piece])
        done = min(size, done + piece)
    hasher.update(bytes(data[done:]))  # a read-only piece too
    digest = hasher.hexdigest()
    assert digest == hashlib.sha256(data).hexdigest()
    parts = sha256_parts.part_count(size, MIB)
    assert hasher.states is not None and len(hasher.states) == parts - 1
    for k in range(parts):
        view = memoryview(data)[k * MIB : (k + 1) * MIB]
        assert sha256_parts.check_part(view, k, MIB, hasher.states, digest)
    if size:
        data[size // 2] ^= 1  # one bit: the part holding it fails, the others still match
        bad = (size // 2) // MIB
        for k in range(parts):
            view = memoryview(data)[k * MIB : (k + 1) * MIB]
            assert sha256_parts.check_part(view, k, MIB, hasher.states, digest) == (k != bad)
        data[size // 2] ^= 1
    if parts > 1:  # a state that lies fails the part it ends and the one it begins, never passes
        forged = list(hasher.states)
        forged[0] = hashlib.sha256(b"forged").hexdigest()
        assert not sha256_parts.check_part(memoryview(data)[:MIB], 0, MIB, forged, digest)
        assert not sha256_parts.check_part(memoryview(data)[MIB : 2 * MIB], 1, MIB, forged, digest)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {f"w{i}": torch.randn(256, 1024 + 16 * i) for i in range(6)}  # ~6.5 MB: several 1 MiB parts


def _written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """One DCP file written by the persist's writer with 1 MiB parts, and what its inventory entry holds."""
    monkeypatch.setattr(sha256_parts, "PART_BYTES", MIB)
    state = _state()
    model = tmp_path / "model"
    digests: dict[str, tuple[Any, ...]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        writer = HashingWriter(model, digests)
        writer.files = 1  # one file: its items lie in many parts
        dcp.save(state, storage_writer=writer, no_dist=True)
    expected = {Path(p).name: d for p, d in digests.items() if p.endswith(".distcp")}
    entries = [inventory_entry(f"model/{n}", *d) for n, d in sorted(expected.items())]
    write_inventory(tmp_path, entries, update=1)  # the .metadata's reader checks the inventory beside it
    return model, state, expected


def _load(model: Path, state: dict[str, torch.Tensor], expected: dict) -> tuple[dict, set[str]]:
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        verified = dcp_io.load(target, model, no_dist=True, expected=expected, tuning=LoadTuning(**TUNING))
    return target, verified


def _checked_parts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The index of every part checked from now on, in the order checked."""
    checked: list[int] = []
    real = sha256_parts.check_part

    def counting(data: Any, index: int, *args: Any) -> bool:
        checked.append(index)
        return real(data, index, *args)

    monkeypatch.setattr(sha256_parts, "check_part", counting)
    return checked


def test_a_file_written_by_the_persist_loads_part_by_part_and_every_value_is_right(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(TUNING, "chunk_bytes", 256 << 10)  # four chunks a part, arriving out of order
    model, state, expected = _written(tmp_path, monkeypatch)
    (name, (sha, size, (part, states))), *_ = expected.items()
    assert part == MIB and len(states) == sha256_parts.part_count(size, MIB) - 1 >= 5
    assert sha == hashlib.sha256((model / name).read_bytes()).hexdigest()
    checked = _checked_parts(monkeypatch)
    target, verified = _load(model, state, expected)
    assert verified == set(expected)
    assert sorted(checked) == list(range(len(states) + 1))  # every part, once
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_items_are_copied_while_the_files_last_part_is_still_unchecked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The point of the parts: an item whose bytes matched is used before the rest of its file is hashed."""
    model, state, expected = _written(tmp_path, monkeypatch)
    ((name, (_sha, _size, (_part, states))),) = expected.items()
    last = len(states)
    events: list[str] = []
    lock = threading.Lock()
    real_check, real_item = sha256_parts.check_part, verified_read._Load._item

    def slow_last(data: Any, index: int, *args: Any) -> bool:
        if index == last:
            time.sleep(0.5)  # the last part held back: the items before it must not wait for it
            with lock:
                events.append("last part checked")
        return real_check(data, index, *args)

    def item(self: Any, f: Any, req: Any) -> None:
        real_item(self, f, req)
        with lock:
            events.append(req.storage_index.fqn)

    monkeypatch.setattr(sha256_parts, "check_part", slow_last)
    monkeypatch.setattr(verified_read._Load, "_item", item)
    target, verified = _load(model, state, expected)
    assert verified == {name} and all(torch.equal(target[k], v) for k, v in state.items())
    before = events[: events.index("last part checked")]
    assert {"w0", "w1"} <= set(before), events  # the first items were in their tensors before the end


@pytest.mark.parametrize("per_file", [True, False], ids=["thread-per-file", "shared-chunks"])
@pytest.mark.parametrize("damaged", [False, True])
def test_the_parts_of_the_last_reads_are_hashed_by_the_reading_threads_themselves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: bool, per_file: bool
) -> None:
    """Once every read is handed out (a thread reading whole files: its file's last chunk, with no file left to
    take), a reading thread hashes the parts its chunk completed itself (the hash threads would take the last
    reads' parts, which arrive together, in turns); the parts before go to the hash threads. A changed byte in
    such a part still fails the load, naming the part, and its item is never parsed."""
    monkeypatch.setitem(TUNING, "chunk_bytes", 256 << 10)
    monkeypatch.setitem(TUNING, "read_streams", 4)
    monkeypatch.setitem(TUNING, "per_file_reader", per_file)
    model, state, expected = _written(tmp_path, monkeypatch)
    ((name, (_sha, size, (_part, states))),) = expected.items()
    last = len(states)
    if damaged:
        path = model / name
        data = bytearray(path.read_bytes())
        data[size - 3] ^= 0x01  # in the last part: the last item's bytes
        path.write_bytes(data)
    by: dict[int, str] = {}
    real_check, real_parse = sha256_parts.check_part, verified_read._parse_item
    parsed: list[str] = []

    def check(data: Any, index: int, *args: Any) -> bool:
        by[index] = threading.current_thread().name
        return real_check(data, index, *args)

    def parse(view: memoryview, offset: int, length: int, path: Path, fqn: str) -> torch.Tensor:
        parsed.append(fqn)
        return real_parse(view, offset, length, path, fqn)

    monkeypatch.setattr(sha256_parts, "check_part", check)
    monkeypatch.setattr(verified_read, "_parse_item", parse)
    if damaged:
        with pytest.raises(
            IntegrityError, match=rf"does not match its SHA-256 in COMPLETE.json \(part {last}:"
        ):
            _load(model, state, expected)
        assert by[last].startswith("torchrelay-read-") and "w5" not in parsed, (by, parsed)
        return
    target, verified = _load(model, state, expected)
    assert verified == {name} and all(torch.equal(target[k], v) for k, v in state.items())
    assert sorted(by) == list(range(last + 1))
    # the last read's part: no queue behind the hash threads; while reads were still to be handed out, those
    assert by[last].startswith("torchrelay-read-") and by[0].startswith("torchrelay-hash_"), by
    # as before: every part on the hash threads
    monkeypatch.setitem(TUNING, "readers_hash_last", False)
    by.clear()
    target, _ = _load(model, state, expected)
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert all(n.startswith("torchrelay-hash_") for n in by.values()), by


def test_one_changed_byte_in_a_middle_part_fails_the_load_naming_the_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, state, expected = _written(tmp_path, monkeypatch)
    ((name, _),) = expected.items()
    path = model / name
    data = bytearray(path.read_bytes())
    data[2 * MIB + 100] ^= 0x40
    path.write_bytes(data)
    with pytest.raises(IntegrityError, match=r"does not match its SHA-256 in COMPLETE.json \(part 2: bytes"):
        _load(model, state, expected)


def test_forged_states_over_good_bytes_fail_and_a_plain_sha256_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, state, expected = _written(tmp_path, monkeypatch)
    ((name, (sha, size, (part, states))),) = expected.items()
    forged = list(states)
    forged[3] = hashlib.sha256(b"x").hexdigest()
    with pytest.raises(
        IntegrityError, match="part [34]"
    ):  # the part it ends and the one it begins: either first
        _load(model, state, {name: (sha, size, (part, tuple(forged)))})
    # the same file listed without states, as an inventory before parts lists it: hashed whole, in order
    target, verified = _load(model, state, {name: (sha, size)})
    assert verified == {name} and all(torch.equal(target[k], v) for k, v in state.items())
    # and the reader told to ignore them (USE_PARTS off): the whole-file SHA-256 is what it checks
    monkeypatch.setitem(TUNING, "use_parts", False)
    target, verified = _load(model, state, {name: (sha, size, (part, tuple(forged)))})
    assert verified == {name} and all(torch.equal(target[k], v) for k, v in state.items())


def _checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def write(tmp: Path, hook: Any) -> Any:
        return save_state(tmp, rank=0, model=model, optimizer=opt, statefuls={}, loop={"update": 1})

    ckpt, _ = commit_checkpoint(run_dir, 1, write, rank=0, world_size=1, info={}, retention=LatestN(2))
    return ckpt, model, opt


def test_a_checkpoints_inventory_lists_the_states_and_its_verified_resume_uses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sha256_parts, "PART_BYTES", MIB)
    ckpt, model, opt = _checkpoint(tmp_path)
    doc = read_inventory(ckpt)
    listed = [e for e in doc["files"] if "parts" in e]
    assert listed and all(e["path"].endswith(".distcp") and e["parts"]["bytes"] == MIB for e in listed)
    assert sum(len(e["parts"]["states"]) for e in listed) >= 10  # 12.6 MB of weights and moments
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    seen: list[int] = []
    real = sha256_parts.check_part
    monkeypatch.setattr(sha256_parts, "check_part", lambda d, i, *a: seen.append(i) or real(d, i, *a))
    load_state(ckpt, rank=0, model=model, optimizer=opt, statefuls={}, verify=True)
    assert len(seen) == sum(len(e["parts"]["states"]) + 1 for e in listed)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


@pytest.mark.parametrize(
    "parts",
    [
        {"bytes": MIB + 1, "states": None},  # not a multiple of SHA-256's block
        {"bytes": 4096, "states": []},  # parts too small to be worth a state
        {"bytes": True, "states": []},
        {"bytes": MIB, "states": []},  # one state short
        {"bytes": MIB, "states": ["zz" * 32] * 64},  # not hex, and too many
        {"bytes": MIB, "states": "0" * 64},
        "64MiB",
    ],
)
def test_a_hostile_parts_entry_is_one_line_naming_the_file_and_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parts: Any
) -> None:
    monkeypatch.setattr(sha256_parts, "PART_BYTES", MIB)
    ckpt, _model, _opt = _checkpoint(tmp_path)
    doc = json.loads((ckpt / "COMPLETE.json").read_text())
    i = next(i for i, e in enumerate(doc["files"]) if "parts" in e)
    doc["files"][i]["parts"] = parts
    (ckpt / "COMPLETE.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match=rf"COMPLETE.json: files\[{i}\].parts needs a part size") as info:
        read_inventory(ckpt)
    assert "\n" not in str(info.value.message)


def test_without_libcrypto_the_persist_lists_no_states_and_the_resume_hashes_whole_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sha256_parts, "PART_BYTES", MIB)
    monkeypatch.setattr(sha256_parts, "_lib", None)  # as where the SHA256_* functions are not exported
    monkeypatch.setattr(sha256_parts, "_probed", True)
    assert not sha256_parts.available()
    ckpt, model, opt = _checkpoint(tmp_path)
    assert not any("parts" in e for e in read_inventory(ckpt)["files"])
    load_state(ckpt, rank=0, model=model, optimizer=opt, statefuls={}, verify=True)


def test_the_inventory_check_verifies_files_in_parts_and_catches_a_forged_state_over_good_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate_complete (the deep status, export, the resume's check) checks a file listing states part by part,
    many parts at once: a state that lies fails there too, not only in the resume."""
    monkeypatch.setattr(sha256_parts, "PART_BYTES", MIB)
    ckpt, _model, _opt = _checkpoint(tmp_path)
    seen: list[int] = []
    real = sha256_parts.check_part
    monkeypatch.setattr(sha256_parts, "check_part", lambda d, i, *a: seen.append(i) or real(d, i, *a))
    validate_complete(ckpt)
    listed = [e for e in read_inventory(ckpt)["files"] if "parts" in e]
    assert len(seen) == sum(len(e["parts"]["states"]) + 1 for e in listed)
    doc = json.loads((ckpt / "COMPLETE.json").read_text())
    i = next(i for i, e in enumerate(doc["files"]) if "parts" in e)
    doc["files"][i]["parts"]["states"][0] = hashlib.sha256(b"lie").hexdigest()
    (ckpt / "COMPLETE.json").write_text(json.dumps(doc))
    with pytest.raises(IntegrityError, match=rf"{doc['files'][i]['path']} does not match its SHA-256"):
        validate_complete(ckpt)


def _span(model: Path, fqn: str) -> tuple[int, int]:
    """Where the item `fqn` lies in its file: (offset, length)."""
    md = dcp_io.read_metadata(model)
    ((offset, length),) = [(int(i.offset), int(i.length)) for k, i in md.storage_data.items() if k.fqn == fqn]
    return offset, length


@pytest.mark.parametrize("chunk", [256 << 10, 16 << 20], ids=["reads-within-a-part", "reads-of-many-parts"])
@pytest.mark.parametrize("per_file", [True, False], ids=["thread-per-file", "shared-chunks"])
def test_a_rank_needing_a_few_items_of_a_file_reads_and_checks_only_their_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_file: bool, chunk: int
) -> None:
    """Every rank of an FSDP run takes the optimizer's `step` items from other ranks' files: it reads the parts
    holding them (each checked from the states around it), not the whole file, and does not count the file as
    verified (the load checks a file no rank read whole after it: state/load.py). A changed byte elsewhere in
    the file is not its concern; one in a part it uses fails it before the item is parsed. Reads larger than a
    part ask for one part each: no byte of a part it does not use is read."""
    monkeypatch.setitem(TUNING, "chunk_bytes", chunk)
    monkeypatch.setitem(TUNING, "per_file_reader", per_file)
    model, state, expected = _written(tmp_path, monkeypatch)
    ((name, (_sha, size, (part, _states))),) = expected.items()
    offset, length = _span(model, "w5")
    wanted = list(range(offset // part, (offset + length - 1) // part + 1))
    assert 3 * len(wanted) * part <= size  # at most a third of the file: read in part
    checked = _checked_parts(monkeypatch)
    only = {"w5": state["w5"]}
    target, verified, stats = _load_stats(model, only, expected)
    assert torch.equal(target["w5"], state["w5"])
    assert sorted(checked) == wanted and verified == set()
    assert stats["bytes_read"] == sum(min((p + 1) * part, size) - p * part for p in wanted)

    # a changed byte in a part it does not use: its load stands (the whole file's check is another's)
    path = model / name
    data = bytearray(path.read_bytes())
    data[100] ^= 0x40
    path.write_bytes(data)
    target, verified, _ = _load_stats(model, only, expected)
    assert torch.equal(target["w5"], state["w5"]) and verified == set()
    with pytest.raises(IntegrityError, match=r"part 0"):  # read whole, the same file fails
        _load_stats(model, state, expected)
    # one in a part holding its item: refused, and the item never reaches its tensor
    data[100] ^= 0x40
    data[offset + length // 2] ^= 0x40
    path.write_bytes(data)
    with pytest.raises(IntegrityError, match=rf"part {(offset + length // 2) // part}\b"):
        _load_stats(model, only, expected)

    # without PARTIAL_READS the file is read and checked whole, as before
    data[offset + length // 2] ^= 0x40
    path.write_bytes(data)
    monkeypatch.setitem(TUNING, "partial_reads", False)
    checked.clear()
    target, verified, stats = _load_stats(model, only, expected)
    assert torch.equal(target["w5"], state["w5"]) and verified == {name}
    assert sorted(checked) == list(range(sha256_parts.part_count(size, part))) and stats["bytes_read"] == size


def _load_stats(
    model: Path, state: dict[str, torch.Tensor], expected: dict
) -> tuple[dict[str, torch.Tensor], set[str], dict[str, float]]:
    """`state`'s tensors loaded into zeroed targets, the files verified whole, the load's timings."""
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    stats: dict[str, float] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        verified = dcp_io.load(
            target, model, no_dist=True, expected=expected, stats=stats, tuning=LoadTuning(**TUNING)
        )
    return target, verified, stats
