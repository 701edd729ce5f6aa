"""Issue 19: every verb and the resume answer a hostile record with one line naming the file, exit 2.

A real run directory and bundle (the 0.1.0 fixture, copied), one hostile version of one file at a time, read by
the verbs that read it (`cli.main(argv)` in-process) and by the resume's readers: deep JSON, a huge line or file,
wrong types, a symlink out, a FIFO, a pickle named .safetensors, a header claiming 2^62 bytes, overlapping
offsets, truncated and non-UTF-8 files. The count of cases, refusals in one line, tracebacks and hangs is printed.
"""

from __future__ import annotations

import builtins
import io
import json
import math
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save as safetensors_save

from helpers import REPO
from torchrelay.checkpoint import state
from torchrelay.checkpoint.reader import load_statefuls
from torchrelay.cli import main
from torchrelay.config.relay import stored_config
from torchrelay.errors import EXIT_REFUSED, RelayError
from torchrelay.paths.layout import TRAIN_LOCK
from torchrelay.report.series import read_series
from torchrelay.util.hashing import sha256_file
from torchrelay.util.jsonl import LINE_LIMIT
from torchrelay.util.records import JSON_LIMIT
from torchrelay.util.safepath import walk_files
from torchrelay.util.sums import SUMS_NAME, SumEntry, write_sums

FIXTURE = REPO / "tests" / "fixtures" / "legacy-v0.1.0"
CKPT = "checkpoint-8"
CASE_SECONDS = 30  # a reader that takes longer on these small files is hanging
DEEP_LIST = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


class _Payload:
    """A real malicious pickle: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (builtins.open, (self.marker, "w"))


# --- hostile versions of a file ---------------------------------------------------------------------------------

# Each writes a hostile version of a file at the path, given the valid file's bytes.
Maker = Callable[[Path, bytes], None]


def _write(content: bytes) -> Maker:
    return lambda path, valid: path.write_bytes(content)


def _truncated(path: Path, valid: bytes) -> None:
    path.write_bytes(valid[: len(valid) // 2])


def _non_utf8(path: Path, valid: bytes) -> None:
    path.write_bytes(b"\xff\xfe" + valid)


def _sparse(size: int, head: bytes = b"", tail: bytes = b"") -> Maker:
    """A file of `size` bytes, most of them a hole: larger than a bound without writing it."""

    def make(path: Path, valid: bytes) -> None:
        with open(path, "wb") as f:
            f.write(head)
            f.seek(size)
            f.write(tail)

    return make


def _symlink_out(outside: Path) -> Maker:
    """A link to a file outside the run directory (or bundle) that holds the valid record."""

    def make(path: Path, valid: bytes) -> None:
        target = outside / f"outside-{path.name}"
        target.write_bytes(valid)
        path.symlink_to(target)

    return make


def _fifo(path: Path, valid: bytes) -> None:
    os.mkfifo(path)


def json_cases(outside: Path, wrong: bytes, limit: int = JSON_LIMIT) -> dict[str, Maker]:
    return {
        "100,000-deep list": _write(DEEP_LIST),
        "100,000-deep object": _write(DEEP_OBJECT),
        "wrong types": _write(wrong),
        "truncated": _truncated,
        "non-UTF-8": _non_utf8,
        "larger than its bound": _sparse(limit + 1, b"{"),
        "symlink out": _symlink_out(outside),
        "fifo": _fifo,
    }


def jsonl_cases(outside: Path, wrong_line: bytes) -> dict[str, Maker]:
    """A bad line is followed by a valid one: only a last line may be torn (util/jsonl's policy)."""

    def then_valid(head: bytes) -> Maker:
        return lambda path, valid: path.write_bytes(head + b"\n" + valid)

    def huge(path: Path, valid: bytes) -> None:
        _sparse(LINE_LIMIT + 1, b'{"', b'"}\n' + valid)(path, valid)

    return {
        "100,000-deep line": then_valid(DEEP_LIST),
        "line longer than its bound": huge,
        "wrong-typed line": then_valid(wrong_line),
        "non-UTF-8 line": then_valid(b'{"\xff": 1}'),
        "symlink out": _symlink_out(outside),
        "fifo": _fifo,
    }


def _header(entries: dict[str, Any], data: bytes) -> bytes:
    head = json.dumps(entries).encode()
    return struct.pack("<Q", len(head)) + head + data


def safetensors_cases(outside: Path, marker: Path) -> dict[str, Maker]:
    f32 = {"dtype": "F32", "shape": [2]}
    return {
        "a pickle named .safetensors": _write(pickle.dumps(_Payload(marker))),
        "a torch.save named .safetensors": _torch_saved(marker),
        "header claiming 2^62 bytes": lambda path, valid: path.write_bytes(
            struct.pack("<Q", 1 << 62) + valid[8:]
        ),
        "overlapping offsets": _write(
            _header({"a": {**f32, "data_offsets": [0, 8]}, "b": {**f32, "data_offsets": [4, 12]}}, bytes(12))
        ),
        "offsets past the end": _write(_header({"a": {**f32, "data_offsets": [0, 8]}}, bytes(4))),
        "a tensor of 2^62 elements": _write(
            _header({"a": {"dtype": "U8", "shape": [1 << 62], "data_offsets": [0, 1 << 62]}}, b"")
        ),
        "100,000-deep header": _write(struct.pack("<Q", len(DEEP_LIST)) + DEEP_LIST),
        "truncated": _truncated,
        "symlink out": _symlink_out(outside),
        "fifo": _fifo,
    }


def _torch_saved(marker: Path) -> Maker:
    def make(path: Path, valid: bytes) -> None:
        buf = io.BytesIO()
        torch.save(_Payload(marker), buf)
        path.write_bytes(buf.getvalue())

    return make


# --- the oracle -------------------------------------------------------------------------------------------------


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Hang()


@dataclass
class Tally:
    cases: int = 0
    refused: int = 0
    tolerated: int = 0
    tracebacks: int = 0
    hangs: int = 0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.cases} cases, {self.refused} refused in one line, {self.tolerated} read as valid, "
            f"{self.tracebacks} tracebacks, {self.hangs} hangs"
        )


def _bounded(fn: Callable[[], Any]) -> Any:
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_verb(tally: Tally, label: str, name: str, argv: list[str], tolerate: bool = False) -> None:
    """`torchrelay ARGV` in-process: exit 2 with one message (and its hint) naming `name`, or, when `tolerate`,
    exit 0; never a traceback, never a hang."""
    tally.cases += 1
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = _bounded(lambda: main(argv))
    except _Hang:
        tally.hangs += 1
        tally.failures.append(f"{label}: hung for {CASE_SECONDS} s")
        return
    except BaseException:  # noqa: BLE001 - the point: an exception out of main is a traceback for the user
        tally.tracebacks += 1
        tally.failures.append(f"{label}: {traceback.format_exc(limit=-3)}")
        return
    said = err.getvalue().strip()
    if "Traceback" in out.getvalue() + said:
        tally.tracebacks += 1
        tally.failures.append(f"{label}: printed a traceback: {said[-500:]}")
    elif code == EXIT_REFUSED and name in said + out.getvalue() and len(said.splitlines()) <= 2:
        # a refusal on stderr, or (verify) a failed check: a line per file on stdout
        tally.refused += 1
    elif code == 0 and tolerate:
        tally.tolerated += 1
    else:
        tally.failures.append(f"{label}: exit {code}, said {said[:400]!r}")


def run_reader(tally: Tally, label: str, name: str, read: Callable[[], Any], tolerate: bool = False) -> None:
    """A library reader the resume calls: one RelayError of exit 2 naming `name` (a message and its hint)."""
    tally.cases += 1
    try:
        _bounded(read)
    except _Hang:
        tally.hangs += 1
        tally.failures.append(f"{label}: hung for {CASE_SECONDS} s")
        return
    except RelayError as exc:
        text = str(exc)
        if exc.exit_code == EXIT_REFUSED and name in text and len(text.splitlines()) <= 2:
            tally.refused += 1
        else:
            tally.failures.append(f"{label}: {type(exc).__name__} (exit {exc.exit_code}): {text[:400]}")
        return
    except BaseException:  # noqa: BLE001 - any other exception is a traceback for the user
        tally.tracebacks += 1
        tally.failures.append(f"{label}: {traceback.format_exc(limit=-3)}")
        return
    if tolerate:
        tally.tolerated += 1
    else:
        tally.failures.append(f"{label}: read as valid")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def plant(path: Path, make: Maker) -> bytes:
    """Replace `path` with a hostile version; returns the valid bytes to put back."""
    valid = path.read_bytes()
    _remove(path)
    make(path, valid)
    return valid


# --- fixtures: a real run directory, a bundle and a plan -------------------------------------------------------


class _Sink:
    """A tracked object that takes whatever state it is given (the readers are under test, not the objects)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, value: Any) -> None:
        pass


def make_run(root: Path) -> Path:
    """The fixture's run, with a validation record, what validation left to do, and shared stateful tensors."""
    run = root / "run"
    shutil.copytree(FIXTURE / "run", run, symlinks=True)
    config = json.loads((run / "config.json").read_text())
    config["data_root"] = str(root / "no-data")  # what the verbs here read never needs the data
    (run / "config.json").write_text(json.dumps(config, indent=1))
    record = {"update": 8, "checkpoint": CKPT, "command": "true", "status": "ok", "reason": "", "exit_code": 0,
              "metrics": {"loss": 1.5}, "started": 1.0, "ended": 2.0, "seconds": 1.0, "attempt": 1, "host": "h",
              "cwd": "/", "code": {}, "inventory_sha256": "", "contract_sha256": None, "format": 1}  # fmt: skip
    (run / "validation" / CKPT).mkdir(parents=True)
    (run / "validation" / CKPT / "record.json").write_text(json.dumps(record, indent=1))
    pending = {"format": 1, "written": 3.0, "command": "true", "updates": "kept", "left": {"4": "budget"},
               "missing": {}}  # fmt: skip
    (run / "validation" / "pending.json").write_text(json.dumps(pending, indent=1))
    tensors = safetensors_save({"ema": torch.arange(6.0)})
    (run / CKPT / state.STATE_TENSORS).write_bytes(tensors)
    return run


def resume_readers(run: Path) -> dict[str, Callable[[], Any]]:
    """What a resume reads of the checkpoint, as `Run.open`, `run.track` and `run.steps` call it on rank 0."""
    ckpt = run / CKPT
    doc = json.loads((ckpt / state.LEGACY_STATE).read_text())
    statefuls = {name: _Sink() for name in doc["statefuls"]}
    return {
        "load_state": lambda: state.load_state(ckpt, rank=0, model=None, optimizer=None, statefuls=statefuls),
        "load_rng": lambda: state.load_rng(ckpt, 0),
        "load_statefuls": lambda: load_statefuls(ckpt),
    }


def test_every_verb_and_the_resume_answer_a_hostile_record_in_one_line(tmp_path: Path) -> None:
    tally = Tally()
    started = time.monotonic()
    marker = tmp_path / "PWNED"
    run = make_run(tmp_path)
    out = tmp_path / "outside"
    out.mkdir()
    r = str(run)
    series = ["report-series", lambda: read_series(run)]
    resume = resume_readers(run)
    status, ledger = ["status", r], ["ledger", r]
    validate = ["validate", r, "--cmd", f"touch {marker}", "--updates", "8"]
    contract = json.loads((run / "resume_contract.json").read_text())
    wrong_contract = json.dumps({**contract, "fields": [], "sha256": 5}).encode()
    record = json.loads((run / "validation" / CKPT / "record.json").read_text())
    targets: list[tuple[str, dict[str, Maker], list[Any]]] = [
        ("config.json", json_cases(out, b'{"total_updates": "many"}'), [status, ledger]),
        ("resume_contract.json", json_cases(out, wrong_contract), [status, ledger]),
        ("history.jsonl", jsonl_cases(out, b'{"first_update": "one", "hosts": 3}'), [status, series]),
        ("train/metrics-rank0.jsonl", jsonl_cases(out, b'{"update": "x"}'), [status, series]),
        ("train/exposures-rank0.jsonl", jsonl_cases(out, b'{"u":"x","i":7}'), [ledger]),
        (f"{CKPT}/COMPLETE.json", json_cases(out, b'{"format": 1, "files": 7}'), [status + ["(incomplete)"]]),
        (f"{CKPT}/{state.LEGACY_STATE}", json_cases(out, b'{"format": 1, "loop": [], "statefuls": 3}'),
         [("load_state", resume["load_state"]), ("load_statefuls", resume["load_statefuls"])]),
        (f"{CKPT}/rng/rank-0.safetensors", safetensors_cases(out, marker), [("load_rng", resume["load_rng"])]),
        (f"{CKPT}/{state.STATE_TENSORS}", safetensors_cases(out, marker),
         [("load_state", resume["load_state"]), ("load_statefuls", resume["load_statefuls"])]),
        (f"validation/{CKPT}/record.json",
         json_cases(out, json.dumps({**record, "metrics": [1], "seconds": "slow"}).encode()),
         [status, ["report", r], validate]),
        ("validation/pending.json", json_cases(out, b'{"left": [4], "missing": "none"}'), [status]),
    ]  # fmt: skip
    for rel, cases, readers in targets:
        path = run / rel
        for label, make in cases.items():
            valid = plant(path, make)
            for reader in readers:
                who = reader[0]
                if isinstance(reader[1], str):
                    # a checkpoint whose inventory is damaged is listed as incomplete, never chosen: no refusal
                    tolerate = reader[-1] == "(incomplete)"
                    argv = [a for a in reader if a != "(incomplete)"]
                    run_verb(tally, f"{rel} [{label}] via {who}", path.name, argv, tolerate=tolerate)
                else:
                    run_reader(tally, f"{rel} [{label}] via {who}", path.name, reader[1])
            _remove(path)
            path.write_bytes(valid)
    # the writer lock: a pipe, a link or a deep record in its place is nobody's lock, and never blocks status
    lock = run / TRAIN_LOCK
    for label, make in {"fifo": _fifo, "symlink out": _symlink_out(out), "deep": _write(b"[" * 4096)}.items():
        lock.write_bytes(b"{}")
        plant(lock, make)
        run_verb(tally, f"{TRAIN_LOCK} [{label}] via status", TRAIN_LOCK, status, tolerate=True)
        _remove(lock)
    # a symlinked folder on the way out of the checkpoint: the link is not followed (its target holds valid files)
    rng_dir = run / CKPT / "rng"
    outside = tmp_path / "outside-rng"
    shutil.move(rng_dir, outside)
    rng_dir.symlink_to(outside)
    run_reader(tally, "rng/ [a folder symlinked out] via load_rng", "rng", resume["load_rng"])
    rng_dir.unlink()
    shutil.move(outside, rng_dir)

    seconds = time.monotonic() - started
    print(f"{tally.line()} in {seconds:.1f} s")
    assert not marker.exists(), "a payload executed"
    assert not tally.failures, f"{len(tally.failures)} of {tally.cases}:\n" + "\n".join(tally.failures[:40])
    assert tally.tracebacks == 0 and tally.hangs == 0 and tally.cases > 140


def resign(bundle: Path) -> None:
    """What a forger who controls the bundle does: make SHA256SUMS agree with every file."""
    entries = [SumEntry(rel, sha256_file(bundle / rel)[0]) for rel in walk_files(bundle) if rel != SUMS_NAME]
    write_sums(bundle / SUMS_NAME, entries)


def test_verify_and_prepare_answer_a_hostile_bundle_record_in_one_line(tmp_path: Path) -> None:
    """Files of a bundle whose SHA256SUMS a forger re-signed: what verify and prepare read refuses them."""
    tally = Tally()
    bundle = tmp_path / "bundle"
    shutil.copytree(FIXTURE / "bundle", bundle, symlinks=True)
    target = tmp_path / "target"
    out = tmp_path / "outside"
    out.mkdir()
    verify, prepare = ["verify", str(bundle)], ["prepare", str(bundle), "--run-dir", str(target)]
    info = json.loads((bundle / "bundle.json").read_text())
    targets = [
        ("bundle.json", json_cases(out, json.dumps({**info, "lineage": 5}).encode(), 1 << 24),
         [prepare]),  # verify checks its bytes against SHA256SUMS only; prepare reads it
        ("data/manifest_info.json", json_cases(out, b'{"samples": "many", "sha256": 1}', 1 << 26), [prepare]),
        (f"{CKPT}/COMPLETE.json", json_cases(out, b'{"format": 1, "files": 7}'), [verify, prepare]),
    ]  # fmt: skip
    for rel, cases, verbs in targets:
        path = bundle / rel
        for label, make in cases.items():
            if label == "larger than its bound":
                continue  # a 256 MiB hole that SHA256SUMS would hash: the bound is the library fuzz's
            valid = plant(path, make)
            if label not in ("symlink out", "fifo"):
                resign(bundle)
            for argv in verbs:
                run_verb(tally, f"bundle {rel} [{label}] via {argv[0]}", path.name, argv)
                assert not target.exists() or not any(target.iterdir()), f"{label}: prepare wrote {target}"
                shutil.rmtree(target, ignore_errors=True)
            _remove(path)
            path.write_bytes(valid)
            resign(bundle)
    print(tally.line())
    assert not tally.failures, f"{len(tally.failures)} of {tally.cases}:\n" + "\n".join(tally.failures[:40])


def test_launch_answers_a_hostile_plan_in_one_line(tmp_path: Path) -> None:
    tally = Tally()
    plan = tmp_path / "plan.yaml"
    cases: dict[str, Maker] = {
        "100,000-deep YAML": _write(b"[" * 100_000 + b"]" * 100_000),
        "100,000-deep YAML mapping": _write(b"{a: " * 100_000 + b"1" + b"}" * 100_000),
        "larger than its bound": _sparse(64 << 20, b"a: "),  # 4 x util/records.YAML_LIMIT
        "non-UTF-8": _write(b"run_dir: \xff\xfe\n"),
        "not YAML": _write(b"a: [\n"),
        "a list, not a mapping": _write(b"- 1\n- 2\n"),
        "fifo": _fifo,
    }
    for label, make in cases.items():
        _remove(plan)
        make(plan, b"")
        run_verb(tally, f"plan [{label}] via launch", plan.name, ["launch", str(plan)])
    print(tally.line())
    assert not tally.failures, f"{len(tally.failures)} of {tally.cases}:\n" + "\n".join(tally.failures[:40])


# --- the defects 3, 4 and 5, one by one -----------------------------------------------------------------


def test_a_deepspeed_payload_is_refused_in_one_line(tmp_path: Path) -> None:
    """Defect 3: weights_only refuses a planted pickle in a DeepSpeed partition, and safe_load says so in one
    line naming the file (exit 2), not an UnpicklingError traceback; the payload never runs."""
    from torchrelay.checkpoint.deepspeed_engine import safe_load

    marker = tmp_path / "PWNED"
    cases = {
        "a planted pickle": pickle.dumps(_Payload(marker)),
        "truncated": b"\x80\x04\x95",
        "noise": b"\x00" * 64,
    }
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    cases["a torch.save'd payload"] = buf.getvalue()
    for label, content in cases.items():
        path = tmp_path / f"zero_pp_rank_0_mp_rank_00_optim_states-{len(label)}.pt"
        path.write_bytes(content)
        with pytest.raises(RelayError) as caught:
            safe_load(path)
        assert caught.value.exit_code == EXIT_REFUSED and path.name in str(caught.value), (
            label,
            caught.value,
        )
        assert len(str(caught.value).splitlines()) <= 2, (label, str(caught.value))
    assert not marker.exists()


def test_the_stop_request_never_follows_a_link_out_of_the_run(tmp_path: Path) -> None:
    """Defect 4: REQUEST_STOP linked to a file outside the run: its text is never read (it would reach
    history.jsonl's notes and status, which travel in bundles); the link still asks the run to stop."""
    from torchrelay.policy.stop import REQUEST_FILE, StopRequest

    run = tmp_path / "run"
    run.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"reason": "TOP-SECRET-TEXT", "by": "TOP-SECRET-TEXT", "job": "TOPSECRET"}))
    (run / REQUEST_FILE).symlink_to(secret)
    request = StopRequest.read(run / REQUEST_FILE)
    assert request is not None and request.job is None and request.at_update is None
    assert "TOPSECRET" not in repr(request).replace("-", ""), request
    assert "symbolic link" in (request.note or ""), request
    # a FIFO asks the same, without blocking the rank that reads it
    (run / REQUEST_FILE).unlink()
    os.mkfifo(run / REQUEST_FILE)
    request = _bounded(lambda: StopRequest.read(run / REQUEST_FILE))
    assert request is not None and "not a regular file" in (request.note or "")


LEDGER_LINE = 600 << 20  # a 600 MB line (a hole): nine times the bound


def test_ledger_refuses_a_huge_line_at_the_bound_in_bounded_memory(tmp_path: Path) -> None:
    """Defect 5: `torchrelay ledger` refuses an exposure log whose line is longer than the bound `status` uses,
    reading at most about the bound: the peak memory of the process stays far below the line's size."""
    run = make_run(tmp_path)
    lines = (
        ("ledger", "exposures", b'{"u":9,"m":0,"i":[', b"]}\n"),
        ("status", "metrics", b'{"x":"', b'"}\n'),
    )
    for verb, name, head, end in lines:
        target = run / "train" / f"{name}-rank0.jsonl"  # status reads the tail of rank 0's metrics
        with open(target, "ab") as f:  # whole lines first, then one line of 600 MB (a hole: written at once)
            f.write(head)
            f.truncate(target.stat().st_size + LEDGER_LINE)
            f.seek(0, os.SEEK_END)
            f.write(end)
        code = (
            "import resource, sys\n"
            "from torchrelay.cli import main\n"
            "import torchrelay.ledger.exposure, torchrelay.records.summary, torchrelay.audit.verdict\n"
            "print('BEFORE_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
            f"code = main([{verb!r}, {str(run)!r}])\n"
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
            "sys.exit(code)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == EXIT_REFUSED, (verb, out.returncode, out.stdout[-2000:], out.stderr[-2000:])
        assert target.name in out.stderr and f"longer than {LINE_LIMIT:,} bytes" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2, out.stderr
        before = int(out.stdout.split("BEFORE_KB")[1].split()[0]) << 10
        grown = (int(out.stdout.split("MAXRSS_KB")[1].split()[0]) << 10) - before
        # what the verb itself held at its peak (after its imports): about the bound, never the line
        print(f"{verb}: refused a {LEDGER_LINE >> 20} MB line, growing by {grown >> 20} MB")
        assert grown < LEDGER_LINE / 4, f"{verb}: grew {grown >> 20} MB for a {LEDGER_LINE >> 20} MB line"
        target.write_bytes((FIXTURE / "run" / "train" / target.name).read_bytes())


# --- the hostile round of the read-only verbs: each case below was a traceback, a wrong code or a write ----------


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`torchrelay ARGV` in-process, bounded: (exit code, stdout, stderr); an exception out of main fails."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = _bounded(lambda: main(argv))
    return code, out.getvalue(), err.getvalue()


def _one_line(code: int, err: str, name: str, want: int = EXIT_REFUSED) -> None:
    assert code == want, (code, err[-1000:])
    assert "Traceback" not in err and name in err and len(err.strip().splitlines()) <= 2, err[-1000:]


def _padded(run: Path) -> Path:
    """Rank 0's exposure log of the fixture written padded, as the writer of today writes it (ids 4 wide)."""
    log = run / "train" / "exposures-rank0.jsonl"
    lines = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        lines.append(
            f'{{"u":{rec["u"]},"m":{rec["m"]},"i":[' + ",".join(f"{i:4d}" for i in rec["i"]) + "]}\n"
        )
    log.write_text("".join(lines))
    return log


def test_a_padded_exposure_line_wider_than_its_layout_is_read_line_by_line(tmp_path: Path) -> None:
    """`{"u":2,"m":0,"i":[99999,   1,   2,   3]}` among padded lines: the fixed-column reader took the first id's
    width for every id and laid the columns past the line's end (numpy `cannot reshape`, a traceback out of
    `ledger` and `status --ledger`); now the line is read as JSON, and the ledger says what is wrong (exit 1)."""
    from torchrelay.records.exposure_read import read_exposures

    run = make_run(tmp_path)
    log = _padded(run)
    assert read_exposures(log).ids.size == 16 * 4  # the padded log itself reads as before
    lines = log.read_text().splitlines(keepends=True)
    lines[2] = '{"u":2,"m":0,"i":[99999,   1,   2,   3]}\n'
    log.write_text("".join(lines))
    got = read_exposures(log)
    assert got.ids[8:12].tolist() == [99999, 1, 2, 3] and got.updates.tolist()[2] == 2
    for argv in (["ledger", str(run)], ["ledger", "--full", str(run)], ["status", "--ledger", str(run)]):
        code, out, err = _cli(argv)
        assert "Traceback" not in out + err, (argv, err[-2000:])
        assert code == (1 if argv[0] == "ledger" else 0), (argv, code, err[-1000:])
        if argv[0] == "ledger":
            assert "#99999" in out and "LEDGER_FAIL" in out, out


def test_report_refuses_an_exposure_that_is_no_integer_in_one_line(tmp_path: Path) -> None:
    """A NaN (or a string, a float) among a line's sample ids: `report` read the log without its schema and
    raised `ValueError: cannot convert float NaN to integer`; now one line naming the file and the field."""
    run = make_run(tmp_path)
    log = run / "train" / "exposures-rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    for bad in ('{"u":2,"m":0,"i":[NaN,1]}\n', '{"u":2,"m":0,"i":["7",1]}\n', '{"u":2,"m":0,"i":[1.5]}\n'):
        log.write_text("".join([*lines[:2], bad, *lines[3:]]))
        code, _, err = _cli(["report", str(run), "--out", str(tmp_path / "report")])
        _one_line(code, err, "exposures-rank0.jsonl")
        assert "field 'i'" in err, err


def test_report_reads_the_manifest_the_guarded_way(tmp_path: Path) -> None:
    """`report` counted the manifest's samples through a plain open: it followed a link out of the run, and a
    byte that is not UTF-8 was `not UTF-8 text (...)` naming no file. Now the manifest is opened as every file of
    a run is (a link or a pipe refused naming it) and its lines counted on their bytes."""
    run = make_run(tmp_path)
    manifest = run / "data" / "manifest.jsonl"
    valid = manifest.read_bytes()
    report = ["report", str(run), "--out", str(tmp_path / "report")]
    manifest.write_bytes(valid + b'{"id": "\xff\xfe"}\n')
    code, _, err = _cli(report)
    assert code == 0 and "Traceback" not in err, err  # a count of lines needs no decoding
    samples = valid.count(b"\n") + 1
    assert f"of {samples} distinct samples" in (tmp_path / "report" / "report.html").read_text()
    plant(manifest, _symlink_out(tmp_path))  # a link to a copy outside the run
    code, _, err = _cli(report)
    _one_line(code, err, "manifest.jsonl")
    assert "symbolic link" in err, err
    manifest.unlink()
    os.mkfifo(manifest)
    code, _, err = _cli(report)  # never blocks on the pipe
    _one_line(code, err, "manifest.jsonl")


def test_report_never_writes_through_a_link_in_the_run(tmp_path: Path) -> None:
    """`report RUN_DIR` writes RUN_DIR/report/. A `report` linked out of the run, or a link planted at one of its
    files (`overview.png -> /somewhere/else`), made it write outside the run (savefig and write_text opened the
    link). Now a linked report folder is refused, and each file is replaced by a rename, never written through."""
    run = make_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "report").symlink_to(elsewhere)
    code, _, err = _cli(["report", str(run)])
    _one_line(code, err, "report")
    assert not any(elsewhere.iterdir()), list(elsewhere.iterdir())
    (run / "report").unlink()
    (run / "report").mkdir()
    victim = elsewhere / "victim"
    victim.write_text("VICTIM")
    for name in ("overview.png", "loss.png", "report.html"):
        (run / "report" / name).symlink_to(victim)
    (run / "report" / f".report.html.tmp-{os.getpid()}").symlink_to(elsewhere / "by-the-temporary")
    code, out, err = _cli(["report", str(run)])
    # the temporary's link refuses the page (its own name) rather than write through it
    assert victim.read_text() == "VICTIM" and not (elsewhere / "by-the-temporary").exists()
    assert code in (0, EXIT_REFUSED) and "Traceback" not in err, err
    (run / "report" / f".report.html.tmp-{os.getpid()}").unlink()
    code, out, err = _cli(["report", str(run)])
    assert code == 0, err
    assert victim.read_text() == "VICTIM"
    for name in ("overview.png", "loss.png", "report.html"):
        assert not (run / "report" / name).is_symlink() and (run / "report" / name).stat().st_size > 100


def test_diff_refuses_a_configuration_that_is_no_object_in_one_line(tmp_path: Path) -> None:
    """`config.json` holding `[]`, a number or null: diff flattened it (`'list' object has no attribute
    'items'`, a traceback) on either side; now one line naming the file."""
    run = make_run(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(run, other, symlinks=True)
    for doc in (b"[]", b"5", b"null", b'"x"'):
        (run / "config.json").write_bytes(doc)
        for argv in (["diff", str(run), str(other)], ["diff", str(other), str(run)]):
            code, _, err = _cli(argv)
            _one_line(code, err, "config.json")
            assert "not an object" in err, err


def test_a_negative_seed_is_refused_in_one_line(tmp_path: Path) -> None:
    """`config.json` with `"seed": -5` passed the configuration's check (an integer of 64 bits) and `ledger` and
    `status --ledger` ended in numpy's `ValueError: expected non-negative integer` (a traceback) where the order
    is drawn, as would the training of a run created so. Now the seed is refused where the configuration is
    read: one line naming the file and the field (exit 2)."""
    from torchrelay.config.relay import RelayConfig
    from torchrelay.errors import ConfigError

    run = make_run(tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["seed"] = -5
    (run / "config.json").write_text(json.dumps(config))
    for argv in (["ledger", str(run)], ["status", str(run), "--ledger"]):
        code, _, err = _cli(argv)
        _one_line(code, err, "config.json")
        assert "seed" in err, err
    with pytest.raises(ConfigError, match="seed"):
        RelayConfig(seed=-1, micro_batch=1, total_updates=1, manifest="m.jsonl")


def _fixture_code(tmp_path: Path) -> Path:
    """The fixture's code (the commit its run was trained from), cloned for `pack --code-dir`."""
    from helpers import git

    git(tmp_path, "clone", "-q", "-b", "main", str(FIXTURE / "code.gitbundle"), "code")
    return tmp_path / "code"


@pytest.mark.parametrize(
    "line",
    [b"[1]", b"5", b'{"update": 1' + b"0" * 5000 + b"}", DEEP_LIST],
    ids=["a list", "a number", "a 5001-digit update", "nested 10^5 deep"],
)
def test_pack_and_the_resume_s_trim_read_a_hostile_log_line_without_a_traceback(
    tmp_path: Path, line: bytes
) -> None:
    """A metrics line `[1]`, `5`, an update of 5001 digits or a 10^5-deep array: `pack` (copying the logs up to
    the checkpoint) and the resume's trim of what lies past it (`trim_after`, on rank 0) ended in AttributeError,
    ValueError or RecursionError tracebacks; such a line is now what a line that is no JSON already was: no
    record of an update (left out of the bundle; moved aside by the trim with what follows the checkpoint)."""
    from torchrelay.records.train import trim_after

    run = make_run(tmp_path)
    # the fixture's own data root: its manifest copy's paths lie under it, and `pack` proves the copy is the
    # contract's (make_run's root elsewhere would be a copy of other data, refused in one line)
    (run / "config.json").write_bytes((FIXTURE / "run" / "config.json").read_bytes())
    log = run / "train" / "metrics-rank0.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join([*lines[:3], line + b"\n", *lines[3:]]))
    code, _, err = _cli(
        ["pack", str(run), str(tmp_path / "bundle"), "--code-dir", str(_fixture_code(tmp_path))]
    )
    assert code == 0 and "Traceback" not in err, err[-1000:]
    assert line + b"\n" not in (
        tmp_path / "bundle" / "train" / "metrics-rank0.jsonl"
    ).read_bytes().splitlines(True)
    log.write_bytes(b"".join([*lines, line + b"\n"]))
    trim_after(run / "train", 4)
    assert log.read_bytes() == b"".join(x for x in lines if json.loads(x)["update"] <= 4)


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link out"])
def test_pack_never_reads_a_log_that_is_no_file(tmp_path: Path, kind: str) -> None:
    """A rank's metrics log or OOM log that is a FIFO or a link (to /dev/zero, or out of the run): `pack` opened it
    plainly, waiting on the FIFO for ever, reading /dev/zero into memory until none was left (the metrics log)
    or copying it until the disk was full (the OOM log), and copying a file outside the run into the bundle. Now
    it is refused naming the log (exit 2), and nothing is packed."""
    run = make_run(tmp_path)
    code_dir = str(_fixture_code(tmp_path))
    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"update": 1}\n')
    for name in ("metrics-rank0.jsonl", "ooms-rank0.jsonl"):
        log = run / "train" / name
        log.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(log)
        else:
            log.symlink_to("/dev/zero" if kind == "link to /dev/zero" else outside)
        bundle = tmp_path / f"bundle-{name}"
        code, _, err = _cli(["pack", str(run), str(bundle), "--code-dir", code_dir])
        _one_line(code, err, name)
        assert not bundle.exists()
        log.unlink()
        if name.startswith("metrics"):
            shutil.copyfile(FIXTURE / "run" / "train" / name, log)


@pytest.mark.parametrize("link", [False, True], ids=["copied", "--link"])
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link out"])
def test_pack_never_reads_a_checkpoint_file_that_is_no_file(tmp_path: Path, kind: str, link: bool) -> None:
    """A file of the packed checkpoint (its state record, or one beside its inventory) that is a FIFO or a link:
    pack's copy opened it plainly, so a FIFO hung pack for ever, a link to /dev/zero was copied into the bundle
    until the disk was full, and a link out of the run copied (or, with --link, hardlinked) what it points to
    into the bundle before the inventory's check. Now the copy opens the one safe way: refused naming the file
    (exit 2), and the bundle is not left behind."""
    run = make_run(tmp_path)
    code_dir = str(_fixture_code(tmp_path))
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    for name in ("trainer_state.json", "extra.bin"):
        target = run / CKPT / name
        saved = target.read_bytes() if target.exists() else None
        target.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(target)
        else:
            target.symlink_to("/dev/zero" if kind == "link to /dev/zero" else outside)
        bundle = tmp_path / f"bundle-{name}"
        argv = ["pack", str(run), str(bundle), "--code-dir", code_dir, *(["--link"] if link else [])]
        code, _, err = _cli(argv)
        _one_line(code, err, name)
        assert not bundle.exists()
        target.unlink()
        if saved is not None:
            target.write_bytes(saved)


HUGE = "1" + "0" * 4000  # an integer JSON reads (under Python's 4300 digits) that no float holds


@pytest.mark.parametrize(
    "field, value, refused",
    [
        ("update", HUGE, True),
        ("loss", HUGE, False),
        ("lr", HUGE, False),
        ("update_time", HUGE, False),
        ("update_time", "NaN", False),
        ("update_time", "Infinity", False),
        ("samples_per_s", HUGE, False),
    ],
)
def test_status_and_report_answer_a_metric_no_float_holds(
    tmp_path: Path, field: str, value: str, refused: bool
) -> None:
    """Rank 0's last metric line (its update: the line before) with a 4001-digit integer or a NaN / infinite number (JSON reads them): `status`
    ended in OverflowError (`int too large to convert to float`: the loss's mean, the ETA) or ValueError
    (`cannot convert float NaN to integer`: the ETA of a NaN update time), `report` in OverflowError (the value, or
    the update, as a float for matplotlib). A metric value is now a float as far as one holds it (NaN or +-inf past
    that), an update past 64 bits is refused as damage naming the file and field (exit 2)."""
    run = make_run(tmp_path)
    log = run / "train" / "metrics-rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    at = -2 if refused else -1  # a last line that is no record may be torn: passed over by `status`
    changed = json.loads(lines[at])
    changed[field] = "__VALUE__"
    lines[at] = json.dumps(changed).replace('"__VALUE__"', value) + "\n"
    log.write_text("".join(lines))
    for argv in (["status", str(run)], ["status", str(run), "--json"], ["report", str(run)]):
        code, out, err = _cli(argv)
        if refused:
            _one_line(code, err, "metrics-rank0.jsonl")
            assert field in err, err
        else:
            assert code == 0 and "Traceback" not in out + err, (argv, code, err[-1000:])
            if "--json" in argv:
                json.loads(out)


def test_report_answers_an_exposure_update_past_64_bits_in_one_line(tmp_path: Path) -> None:
    """An exposure line whose update is a 4001-digit integer: `report` drew it (OverflowError in matplotlib); now
    it is refused as the ledger refuses a damaged exposure line, naming the file and field (exit 2)."""
    run = make_run(tmp_path)
    log = run / "train" / "exposures-rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    first = json.loads(lines[0])
    log.write_text(json.dumps({**first, "u": "__U__"}).replace('"__U__"', HUGE) + "\n" + "".join(lines[1:]))
    code, _, err = _cli(["report", str(run)])
    _one_line(code, err, "exposures-rank0.jsonl")


def test_status_and_ledger_show_recorded_text_as_text(tmp_path: Path) -> None:
    """rich read `[...]` in what a run's files hold as markup: a `[/]` in a segment's note, job or host, a
    validation record's status, a checkpoint's inventory, a pending update, the run directory's own path or a
    manifest id the ledger names was `rich.errors.MarkupError` (a traceback), any other tag restyled the table."""
    base = tmp_path / "a["
    base.mkdir()
    run = make_run(base)
    run = run.rename(base / "run]")  # the path `.../a[/run]`
    history = run / "history.jsonl"
    seg = json.loads(history.read_text())
    seg.update(notes=["[/]"], job="[/x]", hosts=["[/]"], ended="[/]", segment="[/]")
    history.write_text(json.dumps(seg) + "\n")
    record = run / "validation" / CKPT / "record.json"
    rec = json.loads(record.read_text())
    rec.update(status="[/]", reason="[/x]", metrics={"[/]": "[/]"})
    record.write_text(json.dumps(rec))
    (run / "validation" / "pending.json").write_text(
        json.dumps({"left": {"[/]": "[/]"}, "missing": {"[/x]": "[/]"}})
    )
    inventory = run / "checkpoint-4" / "COMPLETE.json"
    inventory.write_text(json.dumps({**json.loads(inventory.read_text()), "update": "[/]"}))
    code, out, err = _cli(["status", str(run)])
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert "[/x]" in out and "a[/run]" in out.replace("\n", ""), out
    # the ledger names the ids of a repeated sample: the manifest's id of one of them is `[/]`
    log = run / "train" / "exposures-rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    first = json.loads(lines[0])["i"][0]
    log.write_text("".join([*lines[:2], lines[0].replace('"u":1', '"u":2'), *lines[3:]]))
    manifest = run / "data" / "manifest.jsonl"
    rows = manifest.read_text().splitlines(keepends=True)
    rows[first] = json.dumps({**json.loads(rows[first]), "id": "[/]"}) + "\n"
    manifest.write_text("".join(rows))
    code, out, err = _cli(["ledger", str(run)])
    assert code == 1 and "Traceback" not in err and "[/]" in out, (code, out[-2000:], err[-2000:])


def test_status_last_exit_never_reads_a_recorded_code_as_another(tmp_path: Path) -> None:
    """`status --last-exit` exited with the recorded code as it was: 256 became 0 (finished, to a batch script),
    300 became 44; now a code past 255 is refused naming the field, and a negative one (a signal, as the
    controller records a killed segment) is exit 1, a crash."""
    run = make_run(tmp_path)
    history = run / "history.jsonl"
    seg = json.loads(history.read_text())
    for code_, want in ((256, EXIT_REFUSED), (300, EXIT_REFUSED), (10**20, EXIT_REFUSED), (-9, 1), (4, 4)):
        history.write_text(json.dumps({**seg, "exit_code": code_}) + "\n")
        code, out, err = _cli(["status", "--last-exit", str(run)])
        assert code == want, (code_, code, out, err)
        if want == EXIT_REFUSED:
            _one_line(code, err, "history.jsonl")
            assert "exit_code" in err, err


def test_status_json_is_json_for_a_diverged_run(tmp_path: Path) -> None:
    """A NaN loss (a diverged run) or an infinite metric made `status --json` print `NaN`, which no strict JSON
    parser (jq, JSON.parse) reads; now such a number is null."""
    run = make_run(tmp_path)
    for rank in (0, 1):
        log = run / "train" / f"metrics-rank{rank}.jsonl"
        rows = [{**json.loads(line), "loss": math.nan} for line in log.read_text().splitlines()]
        log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = run / "validation" / CKPT / "record.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "metrics": {"loss": math.inf}}))
    code, out, err = _cli(["status", "--json", str(run)])
    assert code == 0, err
    doc = json.loads(out, parse_constant=lambda name: pytest.fail(f"status --json printed {name}"))
    assert doc["loss_mean"] is None and doc["validation"]["records"][0]["metrics"] == {"loss": None}


def test_a_manifest_that_is_no_file_is_not_said_missing(tmp_path: Path) -> None:
    """The ledger said `data manifest ... does not exist` of a manifest that is a pipe or a folder."""
    run = make_run(tmp_path)
    manifest = run / "data" / "manifest.jsonl"
    manifest.unlink()
    os.mkfifo(manifest)
    code, _, err = _cli(["ledger", str(run)])
    _one_line(code, err, "manifest.jsonl")
    assert "not a regular file" in err and "does not exist" not in err, err
    manifest.unlink()
    manifest.mkdir()
    code, _, err = _cli(["ledger", str(run)])
    _one_line(code, err, "manifest.jsonl")
    assert "is a directory" in err, err


def test_the_run_s_copy_of_its_manifest_is_never_followed_out_of_the_run(tmp_path: Path) -> None:
    """`ledger` and `status --ledger` read data/manifest.jsonl through Manifest.load, which followed a link there
    to wherever it led (every other file of a run is opened refusing that). Now the run's copy is opened the guarded
    way: a link out of the run or a pipe is refused in one line naming it; a link that stays inside is followed."""
    run = make_run(tmp_path)
    manifest = run / "data" / "manifest.jsonl"
    valid = manifest.read_bytes()
    verbs = (["ledger", str(run)], ["status", "--ledger", str(run)])
    for argv in verbs:
        assert _cli(argv)[0] == 0, argv
    plant(manifest, _symlink_out(tmp_path))  # a link to a copy of the same bytes outside the run
    outside = tmp_path / "outside-manifest.jsonl"
    before = outside.stat()
    for argv in verbs:
        code, _, err = _cli(argv)
        _one_line(code, err, "manifest.jsonl")
        assert "outside" in err and str(run) in err, err
    after = outside.stat()
    assert outside.read_bytes() == valid and (after.st_mtime_ns, after.st_size) == (
        before.st_mtime_ns,
        before.st_size,
    )
    manifest.unlink()
    inside = run / "data" / "manifest-copy.jsonl"
    inside.write_bytes(valid)
    manifest.symlink_to(inside)  # a link that stays in the run is the run's own file
    for argv in verbs:
        code, out, err = _cli(argv)
        assert code == 0 and "Traceback" not in err, (argv, err[-1000:])
    manifest.unlink()
    os.mkfifo(manifest)
    for argv in verbs:
        code, _, err = _cli(argv)  # never blocks on the pipe
        _one_line(code, err, "manifest.jsonl")
        assert "not a regular file" in err, err


def test_status_shows_control_characters_of_a_record_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status` printed a segment's note, job and host as the history held them: an ESC (`\\x1b]0;pwned\\x07`
    retitles the terminal, `\\x1b[2J` clears it) went to whoever ran it (rich drops a BEL but passes an ESC). Now
    every control character of recorded text is shown as repr shows it; `--json` is JSON, which escapes them."""
    monkeypatch.setenv("COLUMNS", "400")  # one cell on one line: the shown text is looked for whole
    run = make_run(tmp_path)
    history = run / "history.jsonl"
    seg = json.loads(history.read_text())
    title, clear = "\x1b]0;pwned\x07", "\x1b[2J"
    seg.update(notes=[f"note {title}{clear}"], hosts=[f"host{clear}{title}"], job=f"job{title}")
    history.write_text(json.dumps(seg) + "\n")
    capsys.readouterr()
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out, repr(out)
    for text in (
        "note \\x1b]0;pwned\\x07\\x1b[2J",
        "host\\x1b[2J\\x1b]0;pwned\\x07",
        "job\\x1b]0;pwned\\x07",
    ):
        assert text in out, (text, out)
    # `--last-exit` prints the segment's end and, for a refused one, its first note, with `print`
    history.write_text(json.dumps({**seg, "ended": f"refused{clear}", "exit_code": 2}) + "\n")
    main(["status", "--last-exit", str(run)])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "ended refused\\x1b[2J" in out, repr(out)
    history.write_text(json.dumps({**seg, "ended": "refused", "exit_code": 2}) + "\n")
    main(["status", "--last-exit", str(run)])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "note \\x1b]0;pwned" in out, repr(out)
    assert main(["status", "--json", str(run)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["segments"][0]["notes"] == [f"note {title}{clear}"]


def test_the_logs_a_run_appends_to_or_trims_are_never_written_through_a_link(tmp_path: Path) -> None:
    """A rank's exposure log linked to a file outside the run: the resume appended to that file and, resuming from
    an older checkpoint, cut it; a linked train/ was written through the same way. Now the resume refuses either
    in one line naming it before it writes anything (history.jsonl included), and so does every writer of a log."""
    from torchrelay.paths.rundir import RunDir
    from torchrelay.records.train import ExposureLog, RankLog, record_oom, trim_after
    from torchrelay.run.directory import reopen_run

    run = make_run(tmp_path)
    train = run / "train"
    history = (run / "history.jsonl").read_bytes()
    outside = tmp_path / "outside-log.jsonl"
    shutil.move(train / "exposures-rank0.jsonl", outside)
    (train / "exposures-rank0.jsonl").symlink_to(outside)
    (train / "ooms-rank0.jsonl").symlink_to(outside)
    kept = outside.read_bytes()

    def reopen() -> Any:
        return reopen_run(RunDir(run), None, {}, world_size=2, code_dir=None, reshard=False, numerics={})

    writers: list[Callable[[], Any]] = [
        lambda: trim_after(train, 0),
        lambda: ExposureLog(train / "exposures-rank0.jsonl", (2, 2, 4)).write_exposure(99, 0, [1]),
        lambda: RankLog(train / "ooms-rank0.jsonl").write({"update": 99}),
        lambda: record_oom(train, 0, {"update": 99}),
        reopen,
    ]
    for write in writers:
        with pytest.raises(RelayError, match=r"\.jsonl .*is a (symlink: remove it|symbolic link)") as info:
            write()
        assert info.value.exit_code == EXIT_REFUSED and str(train) in info.value.message
        assert outside.read_bytes() == kept and (run / "history.jsonl").read_bytes() == history
    (train / "exposures-rank0.jsonl").unlink()
    (train / "ooms-rank0.jsonl").unlink()
    shutil.move(outside, train / "exposures-rank0.jsonl")
    # the whole train/ linked out of the run
    elsewhere = tmp_path / "elsewhere"
    shutil.move(train, elsewhere)
    train.symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir() if p.is_file()}
    for write in writers:
        with pytest.raises(RelayError, match=r"train \(the run's per-rank logs\) is a symlink: remove it"):
            write()
        assert {p.name: p.read_bytes() for p in elsewhere.iterdir() if p.is_file()} == before
        assert (run / "history.jsonl").read_bytes() == history


def test_the_example_reads_the_run_s_configuration_the_guarded_way(tmp_path: Path) -> None:
    """examples/train_lm.py picked its device from config.json with yaml.safe_load, following a link out of the run
    before torchrelay's reader ran (/etc/passwd there: a TypeError traceback). Now it reads it the guarded way and
    leaves the refusal to Run.open; a valid configuration still gives its device."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_lm_example", REPO / "examples" / "train_lm.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    run = make_run(tmp_path)
    args = argparse.Namespace(set=[], run_dir=str(run), config=None)
    assert example._device_of(args) == "cpu"
    outside = tmp_path / "passwd"
    outside.write_text("root:x:0:0:root:/root:/bin/bash\n")
    (run / "config.json").unlink()
    (run / "config.json").symlink_to(outside)
    assert example._device_of(args) == "cpu"  # not followed: Run.open refuses the link in one line


def test_an_atomic_write_never_writes_through_a_link_at_its_temporary(tmp_path: Path) -> None:
    """HANDED_OFF.json's and SHA256SUMS's temporaries have names a planter can guess (the pid, or none): a link
    there made the write land in whatever it points to. Now it is refused (O_NOFOLLOW) and that file untouched."""
    from torchrelay.checkpoint.handed_off import TMP_PREFIX, write_marker

    victim = tmp_path / "victim"
    victim.write_text("VICTIM")
    ckpt = tmp_path / CKPT
    ckpt.mkdir()
    (ckpt / f"{TMP_PREFIX}{os.getpid()}").symlink_to(victim)
    from torchrelay.util.durable import temp_prefix

    (tmp_path / f"{temp_prefix(SUMS_NAME)}{os.getpid()}").symlink_to(victim)
    for write in (
        lambda: write_marker(ckpt, {"format": 1}, step="test"),
        lambda: write_sums(tmp_path / SUMS_NAME, [SumEntry("a", "0" * 64)]),
    ):
        with pytest.raises(OSError):
            write()
        assert victim.read_text() == "VICTIM"


# Each plants a link named `name` to `victim` (a file outside the run, or a folder holding one) where a writer
# writes, and returns that writer.
Planter = Callable[[Path, Path, pytest.MonkeyPatch], Callable[[], Any]]


def _killed_creation(tmp_path: Path) -> tuple[Any, Path]:
    """A configuration and a directory as a creation killed after its copy of the manifest left it."""
    from torchrelay.paths.rundir import RunDir

    config = stored_config(RunDir(FIXTURE / "run"))
    config = config.replace(
        manifest=str(FIXTURE / "data" / "manifest.jsonl"), data_root=str(FIXTURE / "data" / "root")
    )
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "train").mkdir()
    return config, run


def _plant_manifest_copy(tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    from torchrelay.paths.rundir import RunDir
    from torchrelay.run.directory import create_run

    config, run = _killed_creation(tmp_path)
    (run / "data" / "manifest.jsonl").symlink_to(victim)
    return lambda: create_run(RunDir(run), config, {}, world_size=2, code_dir=None)


def _plant_data_folder(tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    from torchrelay.paths.rundir import RunDir
    from torchrelay.run.directory import create_run

    config, run = _killed_creation(tmp_path)
    (run / "data").rmdir()
    (run / "data").symlink_to(victim.parent)
    victim.rename(victim.parent / "manifest.jsonl")  # what the copy would replace, through the folder
    return lambda: create_run(RunDir(run), config, {}, world_size=2, code_dir=None)


def _plant_validation_log(tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    from torchrelay.controller import validation
    from torchrelay.paths.rundir import RunDir

    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run, symlinks=True)
    log = RunDir(run).validation_of(8) / validation.LOG

    def plant(out: Path) -> None:  # right after the pass removed an earlier attempt's log
        if not os.path.lexists(log):
            log.symlink_to(victim)

    monkeypatch.setattr(validation, "_remove_weights", plant)
    return lambda: validation.run_one(RunDir(run), 8, validation.ValidationSpec(command="echo WRITTEN"))


def _plant_smoke_log(tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    from torchrelay.controller.attempts import Outcome
    from torchrelay.controller.launcher import Controller, LaunchRequest
    from torchrelay.controller.plan import Plan

    plan = Plan.from_dict({"run_dir": "run", "train": {"script": "t.py", "nproc_per_node": 2}}, tmp_path)
    controller = Controller(LaunchRequest(plan_path=tmp_path / "plan.yaml"), plan=plan)
    attempt, _ = controller.attempts.start(plan.to_dict(), {})
    (attempt.path / "smoke.log").symlink_to(victim)

    class Launched:  # the smoke's torchrun, whose output goes to the log
        output: Any = None

        def run(self) -> Any:
            self.output.write("WRITTEN\n")
            raise AssertionError("the smoke ran with its log linked out of the run")

    monkeypatch.setattr(controller, "_supervisor", lambda *args, **kwargs: Launched())
    outcome = Outcome(exit_code=1, ended="error", stage="smoke")
    return lambda: controller._smoke(attempt, outcome)


def _plant_probe(kind: str) -> Planter:
    def plant(tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
        from torch.utils.data import DataLoader

        from torchrelay.audit import probe

        folder = tmp_path / "probe" / "interrupted"
        folder.mkdir(parents=True)
        monkeypatch.setenv(probe.ENV, str(folder))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setitem(probe._state, "refused", False)
        name = "rank0.jsonl" if kind == "batches" else "streams-rank0.jsonl"
        (folder / name).symlink_to(victim)
        reader = probe.read if kind == "batches" else probe.read_streams

        def record() -> Any:
            if kind == "batches":
                loader = iter(DataLoader([1, 2, 3]))
                with pytest.raises(RelayError, match=name):  # (the audited run suppresses it)
                    probe._record(loader, next(loader))
            else:
                with pytest.raises(RelayError, match=name):
                    probe._record_streams(3)
            assert victim.read_text() == "VICTIM"
            return reader(folder)  # the audit reads what the probe wrote: the link refused there, exit 2

        return record

    return plant


def _plant_audit_log(tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    from torchrelay.audit.runner import subprocess_launcher

    log = tmp_path / "work" / "logs" / "interrupted-1.log"
    log.parent.mkdir(parents=True)
    log.symlink_to(victim)
    return lambda: subprocess_launcher(["echo", "WRITTEN"], dict(os.environ), log, 30)


@pytest.mark.parametrize(
    ("plant", "name"),
    [
        (_plant_manifest_copy, "data/manifest.jsonl"),
        (_plant_data_folder, "data (the run's data folder)"),
        (_plant_validation_log, "validation/checkpoint-8/output.log"),
        (_plant_smoke_log, "smoke.log"),
        (_plant_audit_log, "logs/interrupted-1.log"),
        (_plant_probe("batches"), "rank0.jsonl"),
        (_plant_probe("streams"), "streams-rank0.jsonl"),
    ],
    ids=[
        "manifest-copy",
        "data-folder",
        "validation-log",
        "smoke-log",
        "audit-log",
        "probe-batches",
        "probe-streams",
    ],
)
def test_a_writer_into_a_run_never_writes_through_a_planted_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plant: Planter, name: str
) -> None:
    """A link planted where a writer writes into an existing run (a killed creation's data/ or its manifest copy,
    the validation command's log, the smoke's log in its attempt, an audit's segment log and its probe's records) made the writer
    replace or append to the file outside it points to. Now each refuses it in one line naming it (exit 2), and
    that file is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("VICTIM")
    write = plant(tmp_path, victim, monkeypatch)
    kept = {p.name: p.read_bytes() for p in outside.iterdir()}
    with pytest.raises(RelayError) as caught:
        write()
    message = caught.value.message
    assert caught.value.exit_code == EXIT_REFUSED and name in message and "\n" not in message, message
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == kept


def test_ledger_beside_a_training_proves_the_updates_every_rank_has_logged(tmp_path: Path) -> None:
    """`ledger` run while a 2-rank training saved and logged said LEDGER_FAIL (exit 1, `update 70: 8 expected
    sample(s) missing`) in 18 of 42 runs: rank 0 had logged the update rank 1 had not yet. While the run's train
    lock is held the ledger now proves the updates every rank has gone past; a run no one trains is read whole, so
    the same line there is still a gap (exit 1)."""
    from torchrelay.paths.lock import RunLock

    run = make_run(tmp_path)
    log = run / "train" / "exposures-rank0.jsonl"
    last = json.loads(log.read_text().splitlines()[-1])
    with log.open("a") as f:  # rank 0 has begun the next update; rank 1 has not
        f.write(json.dumps({**last, "u": last["u"] + 1, "m": 0}) + "\n")
    code, out, err = _cli(["ledger", str(run)])
    assert code == 1 and "LEDGER_FAIL" in out, (code, out, err)
    lock = RunLock(run, "train").acquire()
    try:
        code, out, err = _cli(["ledger", str(run)])
    finally:
        lock.release()
    assert code == 0 and "LEDGER_OK" in out, (code, out[-1500:], err[-1000:])
