"""Forged or damaged records in a run directory: refused in one line naming the file (exit 2), or, for a cache,
never trusted: a record that can be checked against what it describes is checked, never believed.

In-process, on the 0.1.0 fixture's run (tests/test_hostile_records.make_run) and small manifests written here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_hostile_records import CKPT, _cli, _Sink, make_run
from torchrelay.checkpoint import state
from torchrelay.checkpoint.select import latest_complete
from torchrelay.errors import EXIT_REFUSED, IntegrityError, RecordError
from torchrelay.manifest import Manifest, index_path
from torchrelay.manifest.core import scan
from torchrelay.paths.rundir import RunDir
from torchrelay.run.directory import check_lineage, read_lineage
from torchrelay.run.restore import Restore, Tracked
from torchrelay.util.hashing import sha256_file

ROOT = "/data/root"


def _manifest(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _records(n: int, lengths: bool = True) -> list[str]:
    lines = []
    for i in range(n):
        rec: dict[str, object] = {"id": f"s{i}", "path": f"{ROOT}/{i}.bin"}
        if lengths:
            rec["length"] = 10 + 7 * i
        lines.append(json.dumps(rec))
    return lines


def _indexed(path: Path) -> Manifest:
    scan(path, ROOT, workers=1).save_index(index_path(path))
    m = Manifest.load(path, ROOT, index=index_path(path))
    assert m.indexed
    return m


def _forge(path: Path, **arrays: np.ndarray) -> None:
    """What a forger does: new arrays in the index, its meta (the manifest's SHA-256, size, fingerprint) kept."""
    z = dict(np.load(index_path(path), allow_pickle=False))
    z.update(arrays)
    np.savez(index_path(path), **z)


def _same(m: Manifest, path: Path) -> None:
    truth = scan(path, ROOT, workers=1)
    assert [m.id_of(i) for i in range(len(m))] == [truth.id_of(i) for i in range(len(truth))]
    assert m.lengths().tolist() == truth.lengths().tolist() and m.fingerprint() == truth.fingerprint()


def test_a_forged_manifest_index_never_changes_which_sample_a_line_is(tmp_path: Path) -> None:
    """The index kept its meta and reversed its arrays: the resume trained on other samples, `ledger` said OK.
    Now every entry is checked to be the file's own line, in order, and a spread of `length`s against the lines:
    a forged index is not used (the lines are read)."""
    path = _manifest(tmp_path / "manifest.jsonl", _records(300))
    good = _indexed(path)
    starts, sizes, lengths = good.records._starts, good.records._sizes, good.lengths()
    shifted = starts.copy()
    shifted[5] += 1
    swapped = starts.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    forgeries = {
        "all reversed": {"starts": starts[::-1].copy(), "sizes": sizes[::-1].copy(), "lengths": lengths[::-1].copy()},
        "lengths reversed": {"lengths": lengths[::-1].copy()},
        "lengths dropped": {"lengths": np.ones(300, dtype=np.int64)},
        "an entry off its line": {"starts": shifted},
        "two entries swapped": {"starts": swapped, "sizes": sizes[[*range(3), 4, 3, *range(5, 300)]].copy()},
        "an entry cut short": {"sizes": sizes - np.eye(1, 300, 7, dtype=np.int64)[0]},
    }  # fmt: skip
    for label, arrays in forgeries.items():
        _indexed(path)
        _forge(path, **arrays)
        m = Manifest.load(path, ROOT, index=index_path(path))
        assert not m.indexed, label
        _same(m, path)


def test_an_honest_index_is_used_with_blank_and_padded_lines(tmp_path: Path) -> None:
    """The check follows `scan`: blank lines skipped, a line with spaces around its object kept whole."""
    lines = _records(50)
    lines[10] = "  " + lines[10] + " "
    lines[20:20] = ["", "   ", "\t"]
    path = _manifest(tmp_path / "manifest.jsonl", lines)
    m = _indexed(path)
    _same(m, path)
    # a line break str.splitlines() follows (scan splits there): the index is not used, the lines are read
    path.write_text(path.read_text().replace("}\n", "}\u2028\n", 1))
    scan(path, ROOT, workers=1).save_index(index_path(path))
    m = Manifest.load(path, ROOT, index=index_path(path))
    assert not m.indexed
    _same(m, path)


def _damaged(kind: str, valid: bytes) -> bytes:
    if kind == "not a zip":
        return b"PK\x03\x04garbage"
    if kind == "truncated":
        return valid[: len(valid) // 2]
    flipped = bytearray(valid)
    flipped[len(valid) // 3] ^= 0x40  # inside an array: zip's CRC no longer matches
    return bytes(flipped)


@pytest.mark.parametrize("kind", ["not a zip", "truncated", "bit-flipped"])
def test_a_damaged_manifest_index_is_read_again_never_a_traceback(tmp_path: Path, kind: str) -> None:
    """`zipfile.BadZipFile` was a traceback from `ledger`, `status --ledger` and the resume's check; a damaged
    cache is a cache missed: the lines are read (and the index written again by the next launch)."""
    path = _manifest(tmp_path / "manifest.jsonl", _records(200))
    _indexed(path)
    index_path(path).write_bytes(_damaged(kind, index_path(path).read_bytes()))
    m = Manifest.load(path, ROOT, index=index_path(path))
    assert not m.indexed
    _same(m, path)

    run = make_run(tmp_path / kind.replace(" ", "-"))
    cfg = json.loads((run / "config.json").read_text())
    copy = run / "data" / "manifest.jsonl"
    Manifest.load(copy, cfg["data_root"]).save_index(index_path(copy))
    index_path(copy).write_bytes(_damaged(kind, index_path(copy).read_bytes()))
    for argv in (["ledger", str(run)], ["status", str(run), "--ledger"]):
        code, out, err = _cli(argv)
        assert code == 0 and "Traceback" not in out + err, (argv, code, err[-800:])


def _index_bomb(path: Path, entries: int, samples: int | None = None) -> None:
    """An index whose arrays each hold `entries` zeros (8 bytes each, deflated about 1000 to 1), its meta the
    honest one but for `samples`: what a 6 MB file does to a reader that loads the arrays before it looks."""
    import zipfile

    from numpy.lib import format as npy

    meta = json.loads(str(np.load(index_path(path), allow_pickle=False)["meta"]))
    if samples is not None:
        meta["samples"] = samples
    with zipfile.ZipFile(index_path(path), "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("meta.npy", "w") as f:
            npy.write_array(f, np.array(json.dumps(meta)))
        for name in ("starts", "sizes"):
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                npy.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (entries,)})
                for _ in range(entries // (1 << 20)):
                    f.write(bytes(8 << 20))


@pytest.mark.parametrize("samples", [None, 16 << 20])
def test_a_manifest_index_bomb_is_not_loaded(tmp_path: Path, samples: int | None) -> None:
    """A forged index of 160 KB whose arrays inflate to 128 MiB each: every reader of the index (the resume on
    every rank, `ledger`, `status --ledger`) loaded both arrays before comparing a byte (a 6 MB one made `ledger`
    take 6.3 GB and 38 s; a 31 MB one is more memory than the host has). Now each array's header is read first: its
    shape must be the meta's sample count, which can be no more than the manifest's bytes, or the lines are read."""
    import tracemalloc

    path = _manifest(tmp_path / "manifest.jsonl", _records(200))
    _indexed(path)
    _index_bomb(path, 16 << 20, samples)
    tracemalloc.start()
    try:
        m = Manifest.load(path, ROOT, index=index_path(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not m.indexed
    _same(m, path)
    assert peak < 16 << 20, f"loading the index took {peak:,} bytes"


def _inventory_cases(valid: bytes) -> dict[str, bytes]:
    doc = json.loads(valid)
    first = doc["files"][0]

    def with_(**change: object) -> bytes:
        return json.dumps({**doc, **change}).encode()

    def first_with(**change: object) -> bytes:
        return with_(files=[{**first, **change}, *doc["files"][1:]])

    return {
        "truncated": valid[:100],
        "empty": b"",
        "a list": b"[]",
        "update as text": with_(update="8"),
        "another update": with_(update=20),
        "a negative size": first_with(size=-5),
        "a size as text": first_with(size=str(first["size"])),
    }


def test_a_damaged_inventory_is_refused_never_skipped_then_replaced(tmp_path: Path) -> None:
    """checkpoint-8/COMPLETE.json damaged (tensors intact): the resume chose checkpoint-4 in silence and its save
    at update 8 deleted checkpoint-8. Now the resume refuses in one line naming the file (exit 2): the user
    restores it or removes the checkpoint. An inventory that is absent (never written) is still passed over."""
    run = make_run(tmp_path)
    inventory = run / "checkpoint-8" / "COMPLETE.json"
    valid = inventory.read_bytes()
    for label, content in _inventory_cases(valid).items():
        inventory.write_bytes(content)
        with pytest.raises(IntegrityError) as caught:
            latest_complete(run)
        text = str(caught.value)
        assert caught.value.exit_code == EXIT_REFUSED and str(inventory) in text, (label, text)
        assert "checkpoint-8" in (caught.value.hint or "") and len(text.splitlines()) <= 2, (label, text)
        code, out, err = _cli(["status", str(run)])
        assert code == 0 and "inventory damaged" in out, (label, code, out[-800:], err[-800:])
    inventory.unlink()  # a save that never wrote its inventory: passed over, as before
    assert latest_complete(run) == run / "checkpoint-4"
    inventory.write_bytes(valid)
    assert latest_complete(run) == run / "checkpoint-8"


@pytest.mark.parametrize(
    ("doc", "field"),
    [({"lineage": 5, "parent_lineage": ["x"]}, "lineage"), ({"lineage": "ab12", "parent_lineage": ["x"]}, "parent_lineage"),
     ({"parent_lineage": None}, "lineage")],
)  # fmt: skip
def test_a_forged_lineage_is_refused_at_open_and_never_written_into_history(
    tmp_path: Path, doc: dict[str, object], field: str
) -> None:
    """`{"lineage": 5, "parent_lineage": ["x"]}` was accepted at open and written into history.jsonl, which then
    refused `status` and every later resume. Now the open refuses it naming the file and field, and a refused
    launch's record (written through the lenient reader) never carries a wrongly typed lineage."""
    run = make_run(tmp_path)
    (run / "lineage.json").write_text(json.dumps(doc))
    with pytest.raises(RecordError) as caught:
        check_lineage(RunDir(run))
    assert caught.value.exit_code == EXIT_REFUSED and caught.value.field == field
    assert "lineage.json" in str(caught.value) and len(str(caught.value).splitlines()) <= 2
    kept = read_lineage(RunDir(run))
    assert all(isinstance(v, str) for v in kept.values()), kept


def test_diff_compares_what_the_resume_compares_config_json_included(tmp_path: Path) -> None:
    """B's config.json with another seed and lr: `diff A B` said "contract: identical (one can continue the
    other)", exit 0, while resuming B is refused (the resume recomputes the contract from config.json)."""
    a = make_run(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    code, out, err = _cli(["diff", str(a), str(b)])
    assert code == 0 and "identical (one can continue" in out, (code, out, err)
    config = json.loads((b / "config.json").read_text())
    config["seed"], config["params"]["lr"] = 7, 0.9
    config["params"]["log_every"] = 5  # a runtime parameter: allowed to differ
    (b / "config.json").write_text(json.dumps(config, indent=1))
    for argv in (["diff", str(a), str(b)], ["diff", str(b), str(a)]):
        code, out, err = _cli(argv)
        assert code == 1 and "one can continue" not in out, (code, out, err)
        assert "seed: 1234 -> 7" in out or "seed: 7 -> 1234" in out, out
        assert "params.lr" in out and "config.json differs from its own contract (2)" in out, out


def test_a_state_of_another_update_is_refused_naming_its_file_and_field(tmp_path: Path) -> None:
    """relay_state.json's `loop.update` edited (the inventory re-hashed to match): "run.track failed on rank 0:
    .../checkpoint-8: trainer state says update 3", exit 1 naming the folder. Now exit 2 naming the file and field."""
    run = make_run(tmp_path)
    ckpt = run / CKPT
    path = state.state_path(ckpt)
    doc = json.loads(path.read_text())
    doc["loop"]["update"] = 3
    path.write_text(json.dumps(doc, indent=1))
    inventory = json.loads((ckpt / "COMPLETE.json").read_text())
    for entry in inventory["files"]:
        if entry["path"] == path.name:
            entry["sha256"], entry["size"] = sha256_file(path)[0], path.stat().st_size
            entry.pop("parts", None)
    (ckpt / "COMPLETE.json").write_text(json.dumps(inventory, indent=1))
    tracked = Tracked(statefuls={name: _Sink() for name in doc["statefuls"]})
    with pytest.raises(RecordError) as caught:
        Restore(ckpt, 8, rank=0).state(tracked)
    text = str(caught.value)
    assert caught.value.exit_code == EXIT_REFUSED and caught.value.field == "loop.update", text
    assert path.name in text and "update 8" in text and len(text.splitlines()) <= 2, text
