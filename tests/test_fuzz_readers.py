"""Every reader of a file that may come from elsewhere (a bundle, another cluster, a hand edit), fed garbage.

Truncated, huge, deeply nested, negative, wrong-typed, non-UTF-8, binary, special files: each reader answers with a
value or a RelayError whose message names the file, never another exception, never a hang. In-process library
calls on tiny files, deterministic seeds: a few hundred cases in seconds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from torchrelay.checkpoint import dcp_io
from torchrelay.checkpoint.handed_off import read_marker
from torchrelay.checkpoint.inventory import inventory_entries, list_files, validate_complete, write_inventory
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.config.relay import stored_config
from torchrelay.errors import EXIT_REFUSED, RelayError, from_exception
from torchrelay.handoff.bundle_readme import render_readme
from torchrelay.handoff.verify import check_inventory, verify_bundle
from torchrelay.paths.rundir import Bundle, RunDir
from torchrelay.policy.stop import REQUEST_FILE, StopRequest, write_request
from torchrelay.records.contract import CONTRACT_FILE, contract_sha256, load_contract
from torchrelay.records.history import read_history
from torchrelay.util.hashing import sha256_file
from torchrelay.util.safepath import walk_files
from torchrelay.util.sums import SUMS_NAME, SumEntry, write_sums

SEED = 20260909
# A reader blocked on a pipe or a lock uses no CPU: the wall clock catches it, with room for a host at load 25 (where
# 200,000 lines took 12 s of wall for 1 s of CPU). A reader spinning or quadratic on a tiny file uses CPU: its own
# process time catches that whatever the load.
CASE_SECONDS = 60
CASE_CPU_SECONDS = 10
WRONG = [None, -1, -(2**70), 2**70, "x", "", [], {}, True, 1.5, float("nan"), [[[]]], {"a": None}]


# --- garbage: every mutation of a valid file, deterministic ---------------------------------------------------


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every position in a JSON tree (the root too), as a key path."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, (*prefix, i))


def _replaced(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    copy = json.loads(json.dumps(obj))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return copy


def garbage(valid: bytes, rng: random.Random, structured: int = 24) -> Iterator[tuple[str, bytes]]:
    """(label, content): truncations, encodings, sizes, nesting, numbers, binary noise, and wrong-typed values."""
    n = len(valid)
    for cut in sorted({0, 1, n // 3, n // 2, n - 1}):
        if 0 <= cut < n:
            yield f"truncated at {cut}", valid[:cut]
    yield "non-UTF-8 prefix", b"\xff\xfe" + valid
    yield "non-UTF-8 inside", valid[: n // 2] + b"\xc3\x28\x80" + valid[n // 2 :]
    yield "NUL bytes", valid.replace(b'"', b'"\x00', 3)
    yield "whitespace", b" \n\t\n"
    for literal in (b"null", b"[]", b"{}", b'"text"', b"0", b"-1", b"1e999", b"NaN", b"-Infinity", b"true"):
        yield f"literal {literal.decode()}", literal
    yield "deeply nested list", b"[" * 100_000 + b"]" * 100_000
    yield "deeply nested object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000
    yield "unclosed nesting", b"[" * 200_000
    yield "huge number", b"9" * 200_000
    yield "long line", b'{"x": "' + b"a" * 3_000_000 + b'"}'
    yield "many lines", b"{}\n" * 200_000
    for i in range(3):
        yield f"random bytes {i}", rng.randbytes(rng.randint(1, 4096))
    flipped = bytearray(valid)
    for _ in range(8):
        flipped[rng.randrange(n)] = rng.randrange(256)
    yield "bytes flipped", bytes(flipped)
    try:
        doc = json.loads(valid)
    except ValueError:
        return
    positions = list(_paths(doc))
    for _ in range(structured):
        where, value = rng.choice(positions), rng.choice(WRONG)
        yield (
            f"{'/'.join(map(str, where)) or 'root'} = {value!r}",
            json.dumps(_replaced(doc, where, value)).encode(),
        )


def special_files(path: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """Ways a file can be no file: an endless device, a pipe that never answers, a folder, a dangling link."""

    def zero() -> None:
        os.symlink("/dev/zero", path)

    def fifo() -> None:
        os.mkfifo(path)

    def folder() -> None:
        path.mkdir()

    def dangling() -> None:
        os.symlink(path.parent / "nowhere", path)

    def sparse() -> None:  # larger than any limit, without writing a byte
        with open(path, "wb") as f:
            f.truncate(5 << 30)

    yield from (
        ("symlink to /dev/zero", zero),
        ("fifo", fifo),
        ("folder", folder),
        ("dangling symlink", dangling),
    )
    yield "sparse 5 GiB", sparse


# --- the oracle -----------------------------------------------------------------------------------------------


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: object) -> None:
    raise _Hang()


@dataclass
class Outcome:
    cases: int = 0
    refused: int = 0
    failures: list[str] | None = None


def run_case(outcome: Outcome, label: str, name: str, read: Callable[[], object]) -> None:
    """A value or a RelayError naming `name`; anything else (or a hang) is recorded as a failure."""
    outcome.cases += 1
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    started, cpu_started = time.monotonic(), time.process_time()
    try:
        read()
    except _Hang:
        outcome.failures.append(f"{label}: hung for {CASE_SECONDS} s")  # type: ignore[union-attr]
    except RelayError as exc:
        outcome.refused += 1
        if name not in str(exc):
            outcome.failures.append(f"{label}: refusal does not name {name}: {exc}")  # type: ignore[union-attr]
    except OSError as exc:  # a wrong path (a folder), which the CLI and Run.open turn into PathError, exit 2
        outcome.refused += 1
        said = from_exception(exc)
        if said.exit_code != EXIT_REFUSED or name not in str(said):
            outcome.failures.append(f"{label}: {type(exc).__name__} said as {said!r}")  # type: ignore[union-attr]
    except BaseException:  # noqa: BLE001 - the point: any other exception is a finding
        outcome.failures.append(f"{label}: {traceback.format_exc(limit=-3)}")  # type: ignore[union-attr]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    took, cpu = time.monotonic() - started, time.process_time() - cpu_started
    if took > CASE_SECONDS + 1 or cpu > CASE_CPU_SECONDS:
        outcome.failures.append(f"{label}: took {took:.1f} s ({cpu:.1f} s of CPU)")  # type: ignore[union-attr]


def fuzz_file(
    outcome: Outcome, target: Path, valid: bytes, reads: dict[str, Callable[[], object]], seed: int
) -> None:
    """Write each garbage version of `target`, call every reader of it; restore the valid file at the end."""
    rng = random.Random(seed)
    for label, content in garbage(valid, rng):
        target.write_bytes(content)
        for who, read in reads.items():
            run_case(outcome, f"{target.name} [{label}] via {who}", target.name, read)
    for label, make in special_files(target):
        _remove(target)
        make()
        for who, read in reads.items():
            run_case(outcome, f"{target.name} [{label}] via {who}", target.name, read)
    _remove(target)
    target.write_bytes(valid)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


# --- fixtures: tiny but real files ----------------------------------------------------------------------------


def _checkpoint(root: Path) -> Path:
    """A tiny checkpoint: a real DCP save of two tensors, state files, and its inventory."""
    import warnings

    import torch

    ckpt = root / "checkpoint-3"
    (ckpt / "model").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        import torch.distributed.checkpoint as dcp

        state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)}}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt / "model")), no_dist=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"format": 1, "update": 3}))
    write_inventory(ckpt, inventory_entries(ckpt, list_files(ckpt)), update=3, world_size=1)
    return ckpt


def _bundle_like(root: Path) -> Path:
    bundle = root / "bundle"
    (bundle / "data").mkdir(parents=True)
    (bundle / "a.txt").write_text("hello\n")
    (bundle / "data" / "b.bin").write_bytes(bytes(range(256)))
    entries = [SumEntry(rel, sha256_file(bundle / rel)[0]) for rel in walk_files(bundle)]
    write_sums(bundle / SUMS_NAME, entries)
    return bundle


def _run_like(root: Path) -> Path:
    from helpers import REPO

    run = root / "run"
    run.mkdir()
    config = json.loads((REPO / "tests" / "fixtures" / "legacy-v0.1.0" / "run" / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(config))
    fields = {"seed": 1, "world_size": 2, "code.tree": "ab" * 20, "schedule.total_updates": 16}
    (run / CONTRACT_FILE).write_text(
        json.dumps({"format": 1, "fields": fields, "sha256": contract_sha256(fields)})
    )
    segment = {
        "segment": "s1",
        "hosts": ["h"],
        "first_update": 1,
        "last_update": 5,
        "started": 1e9,
        "ended": "x",
    }
    (run / "history.jsonl").write_text(
        json.dumps(segment) + "\n" + json.dumps({**segment, "segment": "s2"}) + "\n"
    )
    return run


# --- the readers ----------------------------------------------------------------------------------------------


def _readme_with(run: Path) -> str:
    """The bundle README from what pack reads in a run (history, contract, config) and its own records."""
    history = read_history(run)
    contract = load_contract(run)
    info = {
        "update": 5,
        "lineage": "l",
        "parent_lineage": None,
        "packed_at": "t",
        "packed_by": "u@h",
        "source_run": str(run),
        "tool_version": "0",
        "checkpoint": "checkpoint-5",
        "runtime_keys": ["data_root"],
        "source": {},
        "warnings": [],
    }
    manifest_info = {"samples": 1, "sha256": "0" * 64, "data_root": "/d", "fingerprint": "f"}
    config = json.loads((run / "config.json").read_text())
    return render_readme(
        info, contract, config, manifest_info, {"ledger": history[0] if history else {}}, history
    )


def test_every_reader_refuses_garbage_in_one_line(tmp_path: Path) -> None:
    outcome = Outcome(failures=[])
    started = time.monotonic()

    bundle = _bundle_like(tmp_path)
    fuzz_file(
        outcome,
        bundle / SUMS_NAME,
        (bundle / SUMS_NAME).read_bytes(),
        {"verify": lambda: verify_bundle(bundle)},
        SEED,
    )

    run = tmp_path / "runs"
    ckpt = _checkpoint(run)
    inventory = ckpt / "COMPLETE.json"
    reads: dict[str, Callable[[], object]] = {
        "validate_complete": lambda: validate_complete(ckpt),
        "list_checkpoints": lambda: list_checkpoints(run),
        "bundle check_inventory": lambda: check_inventory(run, ckpt),
    }
    fuzz_file(outcome, inventory, inventory.read_bytes(), reads, SEED + 1)

    metadata = ckpt / "model" / ".metadata"
    fuzz_file(
        outcome,
        metadata,
        metadata.read_bytes(),
        {"read_metadata": lambda: dcp_io.read_metadata(ckpt / "model")},
        SEED + 2,
    )

    marker = ckpt / "HANDED_OFF.json"
    marker.write_text(json.dumps({"format": 1, "state": "handed-off", "lineage": "l", "bundle": "/b"}))
    fuzz_file(outcome, marker, marker.read_bytes(), {"read_marker": lambda: read_marker(ckpt)}, SEED + 3)

    info = {"format": 1, "lineage": "abc", "parent_lineage": None, "checkpoint": "checkpoint-3", "update": 3,
            "contract_sha256": "0" * 64, "world_size": 2, "runtime_keys": ["data_root"], "source": {"archive": None},
            "warnings": []}  # fmt: skip
    (bundle / "bundle.json").write_text(json.dumps(info))
    fuzz_file(
        outcome,
        bundle / "bundle.json",
        (bundle / "bundle.json").read_bytes(),
        {"read_bundle_info": lambda: Bundle(bundle).info()},
        SEED + 4,
    )

    manifest_info = {"path": "data/manifest.jsonl", "sha256": "0" * 64, "fingerprint": "f" * 64, "data_root": "/d",
                     "samples": 3}  # fmt: skip
    target = bundle / "data" / "manifest_info.json"
    target.write_text(json.dumps(manifest_info))
    fuzz_file(
        outcome,
        target,
        target.read_bytes(),
        {"read_manifest_info": lambda: Bundle(bundle).manifest_info()},
        SEED + 5,
    )

    run_dir = _run_like(tmp_path)
    history = run_dir / "history.jsonl"
    fuzz_file(
        outcome,
        history,
        history.read_bytes(),
        {"read_history": lambda: read_history(run_dir), "README": lambda: _readme_with(run_dir)},
        SEED + 6,
    )
    contract = run_dir / CONTRACT_FILE
    fuzz_file(
        outcome,
        contract,
        contract.read_bytes(),
        {"load_contract": lambda: load_contract(run_dir), "README": lambda: _readme_with(run_dir)},
        SEED + 7,
    )
    # a contract re-signed as anyone can (its sha256 is no secret) with values of any type: the README still renders
    doc = json.loads(contract.read_bytes())
    rng = random.Random(SEED + 9)
    for i in range(40):
        fields = dict(doc["fields"])
        fields[rng.choice([*sorted(fields), "external.x.sha256", "code.commit"])] = rng.choice(WRONG)
        contract.write_text(json.dumps({"format": 1, "fields": fields, "sha256": contract_sha256(fields)}))
        run_case(
            outcome,
            f"{CONTRACT_FILE} [re-signed {i}] via README",
            CONTRACT_FILE,
            lambda: _readme_with(run_dir),
        )
    contract.write_text(json.dumps(doc))
    config = run_dir / "config.json"
    fuzz_file(
        outcome,
        config,
        config.read_bytes(),
        {"load_config": lambda: stored_config(RunDir(run_dir))},
        SEED + 8,
    )

    request = run_dir / REQUEST_FILE
    write_request(run_dir, job="123", at_update=4)
    fuzz_file(
        outcome,
        request,
        request.read_bytes(),
        {"StopRequest.read": lambda: StopRequest.read(request)},
        SEED + 10,
    )

    # issue 19: the records of a checkpoint, of validation, of prepare and of a plan, each through its reader
    import torch
    from safetensors.torch import save as safetensors_save

    from torchrelay.checkpoint.resume_check import prepared_keys, prepared_layout
    from torchrelay.checkpoint.state import read_rank_statefuls, read_trainer_state
    from torchrelay.checkpoint.state import rng as rng_state
    from torchrelay.controller.plan import read_plan_file
    from torchrelay.records.validation import read_pending
    from torchrelay.records.validation import read_records as read_validations

    relay_state = ckpt / "relay_state.json"
    relay_state.write_text(json.dumps({"format": 2, "loop": {"update": 3}, "statefuls": {"s": 1},
                                       "optimizer": None, "per_rank": {"statefuls": ["r"]}}))  # fmt: skip
    fuzz_file(outcome, relay_state, relay_state.read_bytes(), {"read_trainer_state": lambda: read_trainer_state(ckpt)},
              SEED + 11)  # fmt: skip
    (ckpt / "statefuls").mkdir()
    own = ckpt / "statefuls" / "rank-1.json"
    own.write_text(json.dumps({"format": 1, "rank": 1, "statefuls": {"r": {"__tensor__": "r.x"}}}))
    (ckpt / "statefuls" / "rank-1.safetensors").write_bytes(safetensors_save({"r.x": torch.ones(2)}))
    fuzz_file(
        outcome,
        own,
        own.read_bytes(),
        {"read_rank_statefuls": lambda: read_rank_statefuls(ckpt, 1)},
        SEED + 12,
    )
    tensors = ckpt / "statefuls" / "rank-1.safetensors"
    fuzz_file(outcome, tensors, tensors.read_bytes(), {"read_rank_statefuls": lambda: read_rank_statefuls(ckpt, 1)},
              SEED + 13)  # fmt: skip
    (ckpt / "rng").mkdir()
    rng_file = ckpt / "rng" / "rank-0.safetensors"
    rng_state.save(rng_file)
    fuzz_file(outcome, rng_file, rng_file.read_bytes(), {"rng.load": lambda: rng_state.load(rng_file, root=ckpt)},
              SEED + 14)  # fmt: skip
    record = run_dir / "validation" / "checkpoint-3" / "record.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"update": 3, "checkpoint": "checkpoint-3", "command": "c", "status": "ok",
                                  "metrics": {"loss": 1.0}, "seconds": 1.0, "code": {}}))  # fmt: skip
    fuzz_file(outcome, record, record.read_bytes(), {"validation records": lambda: read_validations(RunDir(run_dir))},
              SEED + 15)  # fmt: skip
    pending = run_dir / "validation" / "pending.json"
    pending.write_text(json.dumps({"format": 1, "left": {"4": "budget"}, "missing": {}, "command": "c"}))
    fuzz_file(
        outcome,
        pending,
        pending.read_bytes(),
        {"read_pending": lambda: read_pending(RunDir(run_dir))},
        SEED + 16,
    )
    rebase = run_dir / "REBASE_RECORD.json"
    rebase.write_text(json.dumps({"format": 1, "changes": {"data_root": ["/a", "/b"]}, "layout_change":
                                  {"at_update": 3, "to": {"world_size": 1, "micro_batch": 2, "grad_accum": 1}}}))  # fmt: skip
    reads = {
        "prepared_keys": lambda: prepared_keys(RunDir(run_dir)),
        "prepared_layout": lambda: prepared_layout(RunDir(run_dir), 3),
    }
    fuzz_file(outcome, rebase, rebase.read_bytes(), reads, SEED + 17)
    plan = run_dir / "plan.yaml"
    plan.write_text(json.dumps({"run_dir": "r", "train": {"command": "c"}}))
    fuzz_file(outcome, plan, plan.read_bytes(), {"read_plan_file": lambda: read_plan_file(plan)}, SEED + 18)

    seconds = time.monotonic() - started
    print(
        f"{outcome.cases} cases, {outcome.refused} refused, {len(outcome.failures)} failures in {seconds:.1f} s"
    )
    assert not outcome.failures, f"{len(outcome.failures)} of {outcome.cases} cases:\n" + "\n".join(
        outcome.failures[:40]
    )
    assert outcome.cases > 300 and outcome.refused > outcome.cases // 2
    assert seconds < 120


@pytest.mark.parametrize("verb", ["verify", "prepare"])
def test_a_garbage_sha256sums_is_one_line_and_exit_2(
    tmp_path: Path, verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from torchrelay.cli import main

    bundle = _bundle_like(tmp_path)
    for label, content in garbage((bundle / SUMS_NAME).read_bytes(), random.Random(SEED), structured=0):
        (bundle / SUMS_NAME).write_bytes(content)
        argv = [verb, str(bundle)] + (["--run-dir", str(tmp_path / "run")] if verb == "prepare" else [])
        try:
            damaged = not verify_bundle(bundle).ok
        except RelayError:
            damaged = True
        code = main(argv)
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err and code in (0, 2), (label, code, out, err)
        assert len(err.strip().splitlines()) <= 2, (label, err)  # one message and its hint
        if damaged:  # a refusal (stderr) or a failed check (stdout, a line per file): both name SHA256SUMS
            assert code == 2 and "SHA256SUMS" in out + err, (label, code, out, err)
        assert not (tmp_path / "run").exists()


# --- every field of every record, the cases generated from its schema ------------------------------------------


@dataclass
class FieldOutcome:
    cases: int = 0
    refused: int = 0  # one line naming the file and the field
    tracebacks: int = 0
    silent: int = 0  # a value out of its schema accepted
    findings: list[str] | None = None

    def judge(self, label: str, read: Callable[[], object], names: tuple[str, ...]) -> None:
        """`read` must refuse in one line (its first) naming each of `names` (the file, the field)."""
        self.cases += 1
        try:
            read()
        except RelayError as exc:
            first = str(exc).splitlines()[0]
            if all(n in first for n in names):
                self.refused += 1
            else:
                self.findings.append(f"{label}: refusal does not name {names}: {first[:300]}")  # type: ignore[union-attr]
        except BaseException:  # noqa: BLE001 - the point: any other exception is a finding
            self.tracebacks += 1
            self.findings.append(f"{label}: {traceback.format_exc(limit=-2)}")  # type: ignore[union-attr]
        else:
            self.silent += 1
            self.findings.append(f"{label}: accepted")  # type: ignore[union-attr]

    def accepted(self, label: str, read: Callable[[], object]) -> None:
        """A value inside its schema: `read` takes it."""
        try:
            read()
        except BaseException as exc:  # noqa: BLE001
            self.findings.append(f"{label}: a valid value refused: {exc}")  # type: ignore[union-attr]


def test_every_field_of_every_record_out_of_its_schema_is_one_line(tmp_path: Path) -> None:
    """Cases generated from each record's schema (tests/schema_cases.py): for every field of the contract, a
    history segment, REBASE_RECORD.json (its layout change too), measurements.json and the index's meta, and for
    every environment variable: another type, NaN, Infinity, negative, huge, an overlong string, a path that
    climbs out. Each must be one line naming the file and the field (the index, a cache: read again)."""
    import numpy as np

    from schema_cases import env_cases, field_cases, small
    from test_hostile_records import make_run
    from torchrelay.checkpoint.resume_check import PREPARE_RECORD_SCHEMA, prepared_layout
    from torchrelay.config import envvars
    from torchrelay.controller.attempts import Attempts
    from torchrelay.manifest import Manifest, index_path
    from torchrelay.manifest.core import scan
    from torchrelay.manifest.index import INDEX_META_SCHEMA
    from torchrelay.policy.costmodel import MEASUREMENTS_SCHEMA
    from torchrelay.records.contract import CONTRACT_SCHEMA
    from torchrelay.records.history import SEGMENT_SCHEMA

    out = FieldOutcome(findings=[])
    counts: dict[str, int] = {}
    run = make_run(tmp_path / "c")
    fixture = json.loads((run / CONTRACT_FILE).read_text())["fields"]
    contract = {
        **fixture,
        **small(CONTRACT_SCHEMA),
        "params.lr": 0.1,
        "versions.numpy": "2",
        "external.t.sha256": "0",
    }
    prefixed = {"params.lr": CONTRACT_SCHEMA.prefixes["params."], "versions.numpy": CONTRACT_SCHEMA.prefixes["versions."],
                "external.t.sha256": CONTRACT_SCHEMA.prefixes["external."]}  # fmt: skip

    def write_contract(fields: dict[str, Any]) -> None:
        (run / CONTRACT_FILE).write_text(
            json.dumps({"format": 1, "fields": fields, "sha256": contract_sha256(fields)})
        )

    write_contract(contract)
    out.accepted("contract", lambda: load_contract(run))
    before = out.cases
    for field, label, doc in field_cases({**CONTRACT_SCHEMA, **prefixed}, contract):
        write_contract(doc)
        out.judge(
            f"contract {field} [{label}]", lambda: load_contract(run), (CONTRACT_FILE, f"fields.{field}")
        )
    counts["contract"] = out.cases - before

    history = tmp_path / "h"
    history.mkdir()
    segment = small(SEGMENT_SCHEMA)
    (history / "history.jsonl").write_text(json.dumps(segment) + "\n")
    out.accepted("segment", lambda: read_history(history))
    before = out.cases
    for field, label, doc in field_cases(SEGMENT_SCHEMA, segment):
        (history / "history.jsonl").write_text(json.dumps(doc) + "\n")
        out.judge(
            f"history {field} [{label}]", lambda: read_history(history), ("history.jsonl", f"field '{field}")
        )
    counts["history segment"] = out.cases - before

    prepared = tmp_path / "p"
    prepared.mkdir()
    record = small(PREPARE_RECORD_SCHEMA)
    record["layout_change"]["at_update"] = 3
    (prepared / "REBASE_RECORD.json").write_text(json.dumps(record))
    out.accepted("rebase", lambda: prepared_layout(RunDir(prepared), 3))
    before = out.cases
    for field, label, doc in field_cases(PREPARE_RECORD_SCHEMA, record):
        (prepared / "REBASE_RECORD.json").write_text(json.dumps(doc))
        out.judge(f"REBASE_RECORD {field} [{label}]", lambda: prepared_layout(RunDir(prepared), 3),
                  ("REBASE_RECORD.json", f"field '{field}"))  # fmt: skip
    counts["REBASE_RECORD.json"] = out.cases - before

    attempts = Attempts(RunDir(tmp_path / "a" / "run"))
    (attempts.root / "attempt_01").mkdir(parents=True)
    target = attempts.root / "attempt_01" / "measurements.json"
    measured = small(MEASUREMENTS_SCHEMA)
    target.write_text(json.dumps(measured))
    out.accepted("measurements", attempts.latest_measurements)
    before = out.cases
    for field, label, doc in field_cases(MEASUREMENTS_SCHEMA, measured):
        target.write_text(json.dumps(doc))
        out.judge(
            f"measurements {field} [{label}]",
            attempts.latest_measurements,
            ("measurements.json", f"field '{field}"),
        )
    counts["measurements.json"] = out.cases - before

    validated = tmp_path / "v"
    (validated / "validation" / "checkpoint-8").mkdir(parents=True)
    target = validated / "validation" / "checkpoint-8" / "record.json"
    from torchrelay.records.validation import RECORD_SCHEMA, read_records

    valid = {**small(RECORD_SCHEMA), "update": 8, "checkpoint": "checkpoint-8"}
    target.write_text(json.dumps(valid))
    out.accepted("validation record", lambda: read_records(RunDir(validated)))
    before = out.cases
    for field, label, doc in field_cases(RECORD_SCHEMA, valid):
        target.write_text(json.dumps(doc))
        out.judge(
            f"validation {field} [{label}]",
            lambda: read_records(RunDir(validated)),
            ("record.json", f"field '{field}"),
        )
    counts["validation record.json"] = out.cases - before

    # the index is a cache: a meta out of its schema is not believed, the lines are read (no refusal to say)
    data = tmp_path / "i"
    data.mkdir()
    manifest = data / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "length": i + 1}) + "\n" for i in range(20)))
    scan(manifest, "", workers=1).save_index(index_path(manifest))
    arrays = dict(np.load(index_path(manifest), allow_pickle=False))
    meta = json.loads(str(arrays["meta"]))
    before = out.cases
    for field, label, doc in field_cases(INDEX_META_SCHEMA, meta):
        np.savez(index_path(manifest), **{**arrays, "meta": np.array(json.dumps(doc))})
        out.cases += 1
        try:
            m = Manifest.load(manifest, "", index=index_path(manifest))
            if m.indexed:
                out.silent += 1
                out.findings.append(f"index meta {field} [{label}]: believed")  # type: ignore[union-attr]
            else:
                out.refused += 1
        except BaseException:  # noqa: BLE001
            out.tracebacks += 1
            out.findings.append(f"index meta {field} [{label}]: {traceback.format_exc(limit=-2)}")  # type: ignore[union-attr]
    counts["index meta"] = out.cases - before

    before = out.cases
    for var in envvars.ALL:
        for label, text, refused in env_cases(var):
            env = {var.name: text}
            if refused:
                out.judge(f"{var.name} [{label}]", lambda v=var, e=env: v.get(e), (f"{var.name}=",))  # type: ignore[misc]
            else:
                out.accepted(f"{var.name} [{label}]", lambda v=var, e=env: v.get(e))  # type: ignore[misc]
    counts["environment variables"] = out.cases - before

    print(f"{out.cases} cases ({counts}): {out.refused} one-line refusals, {out.tracebacks} tracebacks, "
          f"{out.silent} silent accepts")  # fmt: skip
    assert not out.findings, f"{len(out.findings)} of {out.cases}:\n" + "\n".join(out.findings[:40])
    assert out.cases > 600 and out.refused == out.cases
