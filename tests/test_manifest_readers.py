"""The manifest's pass over every line, split across reader processes (issue 11: a 10 M-sample manifest in <= 15 s).

Parts are forced tiny here so that a few hundred lines make dozens of parts: whatever the readers find (the
fingerprint, the offsets, the lengths, the first bad length, a refusal and its line) must be exactly what reading
the file in one process finds, and the fingerprint exactly what fingerprint v1 always was (values pinned from
main before the readers existed).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from scale_run import write_manifest
from torchrelay import manifest as M
from torchrelay.errors import ConfigError
from torchrelay.manifest import core as C
from torchrelay.manifest import readers as R
from torchrelay.manifest.scan import Scanned

ROOT = "/data/set"
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark


def tricky_lines() -> list[bytes]:
    """Records that take every branch of the pass: the data root in values, keys and lists, escapes, non-ASCII,
    blank lines, CRLF, lengths present, absent and bad, lines far longer than a part, no final newline."""
    out: list[bytes] = []
    for i in range(120):
        k = i % 8
        rec: dict[str, object]
        if k == 0:
            rec = {"id": f"s{i}", "path": f"{ROOT}/a/{i}.bin", "length": i + 1}
        elif k == 1:
            rec = {
                "task": "grasp \u00e9t\u00e9 \U0001f916",
                "id": f"s{i}",
                "frames": [f"{ROOT}/f{i}", "/other/x"],
            }
        elif k == 2:
            rec = {"id": f's"{i}\\', "meta": {"src": f"{ROOT}/n/{i}", "w": 1.5, "ok": True, "none": None}}
        elif k == 3:
            rec = {"id": f"s{i}", "length": "12x" if i == 27 else 7}
        elif k == 4:
            rec = {"id": f"s{i}", "blob": "z" * 3000, "path": f"{ROOT}/big/{i}"}
        elif k == 5:
            rec = {"id": f"s{i}", f"{ROOT}/as-key": 1, "length": 2**40}
        elif k == 6:
            rec = {"id": f"s{i}", "p": f"{ROOT}x/not-under-root", "q": [ROOT, f"{ROOT}/"]}
        else:
            rec = {"id": f"s{i}", "neg": -3, "exp": 1e300, "u": "\u2603"}
        line = json.dumps(rec, ensure_ascii=(i % 3 == 0))
        out.append(line.encode() + (b"\r\n" if i % 11 == 0 else b"\n"))
        if i % 17 == 5:
            out.append(b"   \n")
    out[-1] = out[-1].rstrip(b"\r\n")  # the last line without its newline
    return out


def _same(a: M.Manifest, b: M.Manifest) -> None:
    assert (a.fingerprint(), a.sha256(), len(a), a._bad_length) == (
        b.fingerprint(),
        b.sha256(),
        len(b),
        b._bad_length,
    )
    assert np.array_equal(a.records._starts, b.records._starts)
    assert np.array_equal(a.records._sizes, b.records._sizes)
    assert (a._lengths is None) == (b._lengths is None)
    if a._lengths is not None:
        assert np.array_equal(a._lengths, b._lengths)


def test_readers_find_what_one_process_finds_and_fingerprint_v1(tmp_path: Path) -> None:
    tricky = tmp_path / "tricky.jsonl"
    tricky.write_bytes(b"".join(tricky_lines()))
    here = C.scan(tricky, ROOT, workers=1)
    spread = C.scan(tricky, ROOT, workers=3, part=300)  # ~50 parts; the 3 KB lines span several
    _same(here, spread)
    # fingerprint v1 and the first bad length, as main computed them before the readers existed
    assert spread.sha256() == "e909b95738bff11be4a696828bd450067a5680cb5fadfbd1f8cc85334ae4b664"
    assert spread.fingerprint() == (
        "fingerprint_v1:9b9341ee839436b9a8a5f1835f4d21bb37d8f1618829c5e2f72e86bd6e967a21"
    )
    assert len(spread) == 120 and spread._bad_length == "line 30: 'length' '12x' is not an integer"
    assert spread.records[5] == json.loads(tricky_lines()[5])
    # The benchmark's records: the one-parse-per-block path, the data root swapped in the canonical text.
    shaped = tmp_path / "b3000.jsonl"
    write_manifest(shaped, 3000)
    m = C.scan(shaped, "/data/lingbot", workers=2, part=4096)
    _same(C.scan(shaped, "/data/lingbot", workers=1), m)
    assert (
        m.fingerprint() == "fingerprint_v1:e2d4ef0b486896ca71869e3bfce405276532137c25bd2c0cae75448030df7e95"
    )
    assert np.array_equal(m.lengths(), np.random.default_rng(0).integers(100, 4000, 3000))


BAD = {
    "not UTF-8": (
        b'{"id": "bad\xff"}',
        "the data manifest is not UTF-8 text (invalid start byte at byte {at})",
    ),
    "not an object": (b"[1, 2]", "each manifest line must be an object with a string 'id'"),
    "id not a string": (b'{"id": 3}', "each manifest line must be an object with a string 'id'"),
    "broken JSON": (b'{"id": "x",', "not a JSON object (Expecting property name enclosed in double quotes)"),
    "huge line": (
        b'{"id": "h", "x": "' + b"y" * 200_000 + b'"',
        "not a JSON object (Expecting ',' delimiter)",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_refusal_from_a_later_part_names_its_file_and_line(tmp_path: Path, kind: str) -> None:
    bad, message = BAD[kind]
    lines = [json.dumps({"id": f"r{i}", "path": f"{ROOT}/{i}"}).encode() + b"\n" for i in range(60)]
    lines[41] = bad + b"\n"  # line 42, well past the first parts
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"".join(lines))
    at = sum(map(len, lines[:41])) + bad.index(b"\xff") if kind == "not UTF-8" else 0
    with pytest.raises(ConfigError) as one:
        C.scan(path, ROOT, workers=1)
    with pytest.raises(ConfigError) as spread:
        C.scan(path, ROOT, workers=2, part=200)
    assert str(spread.value) == str(one.value)
    assert str(spread.value).startswith(f"{path}:42: {message.format(at=at)}")


def test_duplicate_ids_across_parts_and_forged_hash_collisions(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"id": f"d{i}"}) for i in range(50)]
    path.write_text("\n".join(lines) + "\n")
    m = C.scan(path, "", workers=2, part=64)
    # Every id hashing alike (a 64-bit collision, forged): the ids are compared for real, so nothing is refused.
    C._check_unique(m, np.zeros(len(m), dtype=np.int64))
    lines[44] = lines[3]  # a repeat in a part far from the first
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=rf"^{path}:45: duplicate sample id 'd3'$"):
        C.scan(path, "", workers=2, part=64)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    ends = np.flatnonzero(data == ord("\n"))
    starts = np.concatenate([[0], ends[:-1] + 1])
    repeated = M.Manifest(str(path), "", "", starts, ends - starts, "", None, None)
    with pytest.raises(ConfigError, match=rf"^{path}:45: duplicate sample id 'd3'$"):
        C._check_unique(repeated, np.zeros(len(repeated), dtype=np.int64))  # found among forged collisions


def test_a_reader_that_cannot_start_leaves_the_pass_to_this_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"".join(tricky_lines()))
    monkeypatch.setattr(R, "_READER", "import sys; sys.exit(3)")
    assert R.scan_parallel(path, ROOT, 2, 300) is None
    _same(C.scan(path, ROOT, workers=2, part=300), C.scan(path, ROOT, workers=1))


def test_readers_ignore_the_working_directory_and_see_a_change_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"".join(tricky_lines()) + b"\n")
    (tmp_path / "json.py").write_text("raise SystemExit(9)\n")  # what a reader would import from its cwd
    monkeypatch.chdir(tmp_path)
    found = R.scan_parallel(path, ROOT, 2, 300)
    assert found is not None, "the readers failed: the working directory shadowed a module"
    _same(C._from_scanned(found), C.scan(path, ROOT, workers=1))
    deal = R._deal

    def then_append(*args: object) -> Scanned:
        m = deal(*args)  # type: ignore[arg-type]
        with open(path, "ab") as f:
            f.write(b'{"id": "late"}\n')  # written while it was read
        return m

    monkeypatch.setattr(R, "_deal", then_append)
    with pytest.raises(ConfigError, match=rf"^data manifest {path} changed while it was read"):
        C.scan(path, ROOT, workers=2, part=300)


def test_load_uses_readers_for_a_big_file_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"".join(tricky_lines()))
    calls: list[int] = []
    parallel = R.scan_parallel

    def counted(p: Path, root: str, workers: int, part: int) -> Scanned | None:
        calls.append(workers)
        return parallel(p, root, workers, part)

    monkeypatch.setattr(R, "scan_parallel", counted)
    monkeypatch.setattr(R, "reader_count", lambda: 3)
    M.Manifest.load(path, ROOT)
    assert calls == []  # below _PARALLEL_FROM: starting readers would cost more than they save
    monkeypatch.setattr(C, "_PARALLEL_FROM", 1000)
    _same(M.Manifest.load(path, ROOT), C.scan(path, ROOT, workers=1))
    assert calls == [3]
    M.Manifest.load(path, ROOT, readers=1)  # every rank at once (opening's fallback): no readers
    assert calls == [3]


@pytest.mark.parametrize("kind", ["tricky", "plain"])
def test_a_byte_order_mark_opening_the_file_is_no_part_of_the_first_record(tmp_path: Path, kind: str) -> None:
    """A manifest exported by a Windows tool starts with a UTF-8 BOM: it was refused (`line 1: not a JSON object
    (Unexpected UTF-8 BOM ...)`). Now it is read past: the records, their offsets (shifted by its 3 bytes), the
    lengths and the fingerprint are those of the file without it, in one process, in reader processes and from
    the saved index (which every rank but rank 0 reads); only the file's SHA-256, its bytes', differs."""
    body = b"".join(tricky_lines()) if kind == "tricky" else b'{"id": "a", "length": 3}\n{"id": "b"}\n'
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain, marked = tmp_path / "a" / "plain.jsonl", tmp_path / "b" / "marked.jsonl"  # each its own index
    plain.write_bytes(body)
    marked.write_bytes(BOM + body)
    want = C.scan(plain, ROOT, workers=1)
    for got in (C.scan(marked, ROOT, workers=1), C.scan(marked, ROOT, workers=3, part=300)):
        assert (got.fingerprint(), len(got), got._bad_length) == (
            want.fingerprint(),
            len(want),
            want._bad_length,
        )
        assert np.array_equal(got.records._starts, want.records._starts + 3)
        assert np.array_equal(got.records._sizes, want.records._sizes)
        assert got.lengths().tolist() == want.lengths().tolist() if want._bad_length is None else True
        assert got.records[0] == want.records[0] and got.sha256() != want.sha256()
    got.save_index(M.index_path(marked))
    want.save_index(M.index_path(plain))
    indexed = M.Manifest.load(marked, ROOT, index=M.index_path(marked), sha256=got.sha256())
    # used, not read again, wherever the file without it would be (a "\r" in the tricky lines reads them again)
    assert (
        indexed.indexed
        == M.Manifest.load(plain, ROOT, index=M.index_path(plain)).indexed
        == (kind == "plain")
    )
    assert indexed.fingerprint() == want.fingerprint()
    assert indexed.records[0] == want.records[0]
    # re-pointed (prepare, a relaunch with another data_root): written without it, the same fingerprint
    moved = indexed.rebase_into(tmp_path / "moved.jsonl", "/elsewhere")
    assert moved.fingerprint() == want.fingerprint() and not (
        tmp_path / "moved.jsonl"
    ).read_bytes().startswith(BOM)
    # a BOM alone, or one that is not the file's first bytes, is no record either way
    only = tmp_path / "only.jsonl"
    only.write_bytes(BOM + b"\n")
    with pytest.raises(ConfigError, match="lists no samples"):
        C.scan(only, ROOT, workers=1)
    later = tmp_path / "later.jsonl"
    later.write_bytes(body.split(b"\n", 1)[0] + b"\n" + BOM + b'{"id": "z"}\n')
    with pytest.raises(ConfigError, match=r"later\.jsonl:2: not a JSON object"):
        C.scan(later, ROOT, workers=1)


def test_records_held_by_a_script_until_the_interpreter_ends_close_quietly(tmp_path: Path) -> None:
    """A script that runs its training at module level (as a quick script is written) and ends with an uncaught
    error: the manifest's records close their file at the interpreter's end without a word. Before the fix,
    `Records.__del__` ran after its module's `os` was torn down and added 'Exception ignored in: <function
    Records.__del__ ...> AttributeError: 'NoneType' object has no attribute 'getpid'' under the script's traceback."""
    import subprocess
    import sys

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}"}) + "\n" for i in range(4)))
    script = tmp_path / "top.py"
    script.write_text(
        "import torchrelay as tr\n"
        f"cfg = tr.RelayConfig(seed=1, micro_batch=2, grad_accum=1, total_updates=2, warmup_updates=0, "
        f"manifest={str(path)!r}, data_root={str(tmp_path)!r})\n"
        f"run = tr.Run.open({str(tmp_path / 'run')!r}, cfg)\n"
        "run.manifest.records[0]  # the dataset read a record: the file is open\n"
        "raise ValueError('a bug in the script')\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env={"PYTHONPATH": src}, timeout=120
    )
    assert done.returncode == 1 and "ValueError: a bug in the script" in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
