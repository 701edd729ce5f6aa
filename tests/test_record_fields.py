"""Every field of a record checked before use (issue 47): a value outside its schema is one line naming the file
and the field (exit 2), never a ZeroDivisionError, OverflowError or RecursionError; what torchrelay writes is
within what its readers accept; an environment variable out of its range is one line naming it; a refusal before
`Run.open` is said once, whichever rank meets it first.

In-process on the 0.1.0 fixture's run (test_hostile_records.make_run) and small files, except the last test: real
2-rank torchrun launches.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import launch
from schema_cases import at_bounds
from test_hostile_records import _cli, make_run
from torchrelay.checkpoint.resume_check import PREPARE_RECORD_SCHEMA, prepared_layout
from torchrelay.config import envvars
from torchrelay.config.relay import stored_config
from torchrelay.controller.attempts import Attempts
from torchrelay.errors import EXIT_REFUSED, ConfigError, RecordError
from torchrelay.identity.numerics import check_resume
from torchrelay.manifest import Manifest, index_path
from torchrelay.manifest.core import scan
from torchrelay.manifest.index import INDEX_META_SCHEMA, index_root
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.costmodel import MEASUREMENTS_SCHEMA, Measurements
from torchrelay.records.contract import CONTRACT_SCHEMA, contract_manifest, contract_sha256, load_contract
from torchrelay.records.history import SEGMENT_SCHEMA, read_history, write_history
from torchrelay.util.records import LINE_LIMIT, check

ROOT = "/data/root"


def _rehashed(run: Path, **changes: object) -> None:
    """What a forger does: fields changed, the contract's digest recomputed."""
    doc = json.loads((run / "resume_contract.json").read_text())
    fields = {**doc["fields"], **changes}
    (run / "resume_contract.json").write_text(
        json.dumps({"format": 1, "fields": fields, "sha256": contract_sha256(fields)})
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("global_batch", 0), ("global_batch", math.inf), ("data.samples", "many"), ("world_size", math.inf),
     ("schedule.total_updates", -3), ("grad_accum", 2**62), ("sampler", "mine")],
)  # fmt: skip
def test_contract_numbers_outside_their_schema_are_one_line_refusals(
    tmp_path: Path, field: str, value: object
) -> None:
    """global_batch 0 was a ZeroDivisionError, Infinity an OverflowError (status, ledger, prepare), "many" a
    ValueError: the re-hashed contract passed its digest check and its fields were used as they came."""
    run = make_run(tmp_path)
    _rehashed(run, **{field: value})
    for argv in (["status", str(run)], ["ledger", str(run)], ["status", "--ledger", str(run)]):
        code, _, err = _cli(argv)
        assert code == EXIT_REFUSED, (argv, code, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
        assert f"field 'fields.{field}'" in err and "resume_contract.json" in err, err


def test_a_rebase_record_layout_of_infinity_is_refused_naming_its_field(tmp_path: Path) -> None:
    """REBASE_RECORD.json's layout_change.to.world_size: Infinity was an OverflowError at the resume."""
    record = {
        "format": 1,
        "changes": {},
        "layout_change": {"at_update": 8, "to": {"world_size": math.inf, "micro_batch": 4, "grad_accum": 2}},
    }
    (tmp_path / "REBASE_RECORD.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"field 'layout_change\.to\.world_size': inf, not a finite number"):
        prepared_layout(RunDir(tmp_path), 8)
    record["layout_change"]["to"]["world_size"] = 2  # type: ignore[index]
    (tmp_path / "REBASE_RECORD.json").write_text(json.dumps(record))
    layout = prepared_layout(RunDir(tmp_path), 8)
    assert layout is not None and layout.world_size == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("save_s", math.nan), ("update_s", -1.0), ("checkpoint_bytes", "big"), ("startup_s", 1e300)],
)
def test_measurements_outside_their_schema_are_refused_naming_the_field(
    tmp_path: Path, field: str, value: object
) -> None:
    """attempts/*/measurements.json went through float()/int() unchecked: a NaN reached every rank as
    TORCHRELAY_SAVE_ESTIMATE_S, which the user never set."""
    attempts = Attempts(RunDir(tmp_path / "run"))
    folder = attempts.root / "attempt_01"
    folder.mkdir(parents=True)
    good = Measurements(
        update_s=1.0, save_s=2.0, startup_s=3.0, checkpoint_bytes=10, source="smoke"
    ).to_dict()
    (folder / "measurements.json").write_text(json.dumps(good))
    assert attempts.latest_measurements() == good
    (folder / "measurements.json").write_text(json.dumps({**good, field: value}))
    with pytest.raises(RecordError, match=rf"measurements.json.*field '{field}'"):
        attempts.latest_measurements()


def _manifest(path: Path, n: int) -> Path:
    lines = [
        json.dumps({"id": f"s{i}", "path": f"{ROOT}/{i}.bin", "length": 10 + (i * 7) % 50}) for i in range(n)
    ]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_deeply_nested_index_meta_is_no_traceback(tmp_path: Path) -> None:
    """The index's meta parsed with RecursionError uncaught (ledger, status --ledger, the resume): now the meta
    is read by the guarded parser and its schema, and an index whose meta is not one is read again."""
    path = _manifest(tmp_path / "manifest.jsonl", 50)
    scan(path, ROOT, workers=1).save_index(index_path(path))
    z = dict(np.load(index_path(path), allow_pickle=False))
    for meta in (
        "[" * 100_000 + "]" * 100_000,
        json.dumps({**json.loads(str(z["meta"])), "samples": math.inf}),
    ):
        z["meta"] = np.array(meta)
        np.savez(index_path(path), **z)
        assert index_root(index_path(path)) is None
        m = Manifest.load(path, ROOT, index=index_path(path))
        assert not m.indexed and len(m) == 50


def _believed_forgery(path: Path) -> tuple[Manifest, np.ndarray]:
    """An index whose lengths differ from the lines' at one position the spot check does not look at."""
    truth = scan(path, ROOT, workers=1)
    truth.save_index(index_path(path))
    clean = dict(np.load(index_path(path), allow_pickle=False))
    for pos in range(1, len(truth), 97):
        lengths = truth.lengths().copy()
        lengths[pos] += 1000
        np.savez(index_path(path), **{**clean, "lengths": lengths})
        m = Manifest.load(path, ROOT, index=index_path(path))
        if m.indexed:
            return m, truth.lengths()
    raise AssertionError("the spot check looked at every position tried")


def test_an_index_with_other_lengths_past_the_spot_check_is_not_believed_by_a_resume(tmp_path: Path) -> None:
    """The lengths were spot-checked at 1,024 predictable positions: a length-bucketed run resumed on an index
    with other lengths elsewhere and trained other batches. The contract now records the lengths' SHA-256
    (data.lengths_sha256) and a resume believes an index's lengths only when they give it, all of them."""
    path = _manifest(tmp_path / "manifest.jsonl", 20_000)
    forged, truth = _believed_forgery(path)
    assert forged.lengths().tolist() != truth.tolist()  # the spot check alone is fooled
    fields = {
        "data.fingerprint": forged.fingerprint(),
        "data.sha256": forged.sha256(),
        "data.lengths_sha256": scan(path, ROOT, workers=1).lengths_sha256(),
        "sampler": "length_bucketed",
    }
    m = contract_manifest(path, [ROOT], fields, index=index_path(path), root=None)
    assert m.lengths().tolist() == truth.tolist()
    # a contract made before the field: a length-bucketed run reads the lines; a shuffled one uses no length
    old = {k: v for k, v in fields.items() if k != "data.lengths_sha256"}
    assert (
        contract_manifest(path, [ROOT], old, index=index_path(path), root=None).lengths().tolist()
        == truth.tolist()
    )
    shuffled = contract_manifest(
        path, [ROOT], {**old, "sampler": "shuffled"}, index=index_path(path), root=None
    )
    assert shuffled.indexed


def test_the_complete_lengths_check_is_cheap_on_10_million_samples() -> None:
    """What the complete check costs a resume: one SHA-256 of the lengths (80 MB at 10 M samples)."""
    lengths = np.random.default_rng(0).integers(1, 4096, 10_000_000, dtype=np.int64)
    m = Manifest(
        "x", "", "0" * 64, np.zeros(0, np.int64), np.zeros(0, np.int64), "fingerprint_v1:x", lengths, None
    )
    started = time.perf_counter()
    digest = m.lengths_sha256()
    took = time.perf_counter() - started
    print(f"lengths_sha256 of 10M samples: {took:.3f} s")
    assert len(digest) == 64 and took < 5


@pytest.mark.parametrize(
    ("var", "text"),
    [(envvars.COLLECTIVE_TIMEOUT_S, "-5"), (envvars.BUDGET_S, "0"), (envvars.BUDGET_S, "inf"),
     (envvars.CHECK_EVERY, "0"), (envvars.PERSIST_STREAMS, "-1"), (envvars.LOCK_WAIT_S, "-1"),
     (envvars.PERSIST_WRITER, "fork"), (envvars.DEADLINE, "-1"), (envvars.MARGIN_S, "1e99"),
     (envvars.OVERRIDES, "[" * 100_000), (envvars.RUN_DIR, "x" * 70_000)],
)  # fmt: skip
def test_every_training_variable_out_of_its_range_is_one_line_naming_it(var: envvars.Var, text: str) -> None:
    """TORCHRELAY_COLLECTIVE_TIMEOUT_S=-5 failed inside gloo on every rank; each variable now has a type and a
    range, checked when a run opens (envvars.TRAINING)."""
    assert var in envvars.TRAINING
    with pytest.raises(ConfigError) as caught:
        envvars.check(envvars.TRAINING, {var.name: text})
    said = str(caught.value).splitlines()[0]
    assert said.startswith(f"{var.name}=") and len(said) < 200, said


# --- what torchrelay writes, its readers accept ------------------------------------------------------------------


def test_each_record_written_at_its_bounds_reads_back(tmp_path: Path) -> None:
    """Each record with every field at its bound, written by its writer (history.jsonl) or as its writer writes it
    (JSON), is read back whole by its reader; past its bounds, the history writer cuts what it echoes."""
    segment = {**at_bounds(SEGMENT_SCHEMA), "first_update": 1}
    write_history(RunDir(tmp_path), [segment])
    assert (tmp_path / "history.jsonl").stat().st_size < LINE_LIMIT
    assert read_history(tmp_path) == [segment]
    past = {**segment, "notes": ["n" * 100_000] * 5000, "numerics": {"cpu.model": "m" * (25 << 20)}}
    write_history(RunDir(tmp_path), [past])
    (back,) = read_history(tmp_path)
    assert len(back["notes"]) == 1024 and all(len(n) <= 4096 for n in back["notes"])
    assert len(json.dumps(back["numerics"])) <= 64 << 10
    for name, schema in [("contract", CONTRACT_SCHEMA), ("REBASE_RECORD.json", PREPARE_RECORD_SCHEMA),
                         ("measurements.json", MEASUREMENTS_SCHEMA), ("index meta", INDEX_META_SCHEMA)]:  # fmt: skip
        doc = at_bounds(schema)
        (tmp_path / "r.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
        from torchrelay.util.records import read_json

        assert read_json(tmp_path / "r.json", what=name, schema=schema) == doc, name


def test_a_contract_at_its_bounds_loads(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    _rehashed(run, **at_bounds(CONTRACT_SCHEMA))
    assert load_contract(run)["fields"]["global_batch"] == 1 << 40


def test_a_numerics_value_at_its_bound_is_echoed_cut_and_the_history_stays_readable(tmp_path: Path) -> None:
    """A 25 MB string in a segment's numerics was echoed three times into the next segment's numerics_change: a
    78.6 MB line its own reader refused, after which no launch, status or pack could read the run. The reader now
    takes at most 64 KiB of numerics, and the echo is cut (numerics.SHOWN characters a value)."""
    before = {"cpu.model": "m" * 60_000, "torch": "2.0"}
    seg = {"segment": "a", "first_update": 1, "last_update": 8, "ended": "finished", "numerics": before}
    write_history(RunDir(tmp_path), [seg])
    history = read_history(tmp_path)
    change = check_resume(history, {"cpu.model": "other", "torch": "2.0"}, upto=8, strict=False)
    assert change is not None and len(json.dumps(change)) < 2000
    write_history(
        RunDir(tmp_path), [*history, {"segment": "b", "first_update": 9, "numerics_change": change}]
    )
    assert [s["segment"] for s in read_history(tmp_path)] == ["a", "b"]
    # a numerics string past its bound, written by hand, is refused in one line naming the field
    (tmp_path / "history.jsonl").write_text(
        json.dumps({**seg, "numerics": {"cpu.model": "m" * (25 << 20)}}) + "\n"
    )
    with pytest.raises(RecordError, match="field 'numerics'"):
        read_history(tmp_path)


def test_a_schema_check_refuses_naming_the_nested_field() -> None:
    from torchrelay.records.reshard import LAYOUT_CHANGE_SCHEMA

    doc = {"to": {"world_size": 2, "micro_batch": 0, "grad_accum": 1}}
    with pytest.raises(RecordError, match=r"field 'layout_change\.to\.micro_batch': 0, below its least 1"):
        check(doc, LAYOUT_CHANGE_SCHEMA, source="x", prefix="layout_change.")


# --- a refusal before Run.open: said once --------------------------------------------------------------------------


@pytest.mark.launch
def test_a_refusal_before_run_open_is_said_once_by_the_first_rank(
    example: dict[str, Path], tmp_path: Path
) -> None:
    """A non-zero rank left a configuration error for rank 0 and exited; torchrun then ended rank 0 before it
    printed (`grad_accum: -2`: no line in 4 launches of 5; a bad TORCHRELAY_BUDGET_S in 3 of 4). Now the first
    rank to meet it says it, the others stay quiet, and every rank that ends by it exits 2."""
    cases = [({"grad_accum": -2}, {}, "grad_accum")] * 3 + [
        ({}, {"TORCHRELAY_BUDGET_S": "soon"}, "TORCHRELAY_BUDGET_S"),
        ({}, {"TORCHRELAY_COLLECTIVE_TIMEOUT_S": "-5"}, "TORCHRELAY_COLLECTIVE_TIMEOUT_S"),
    ]
    for i, (sets, env, name) in enumerate(cases):
        out = launch(
            example["code"], tmp_path / f"run{i}", config=example["config"], sets=sets, env=env, timeout=240
        )
        text = out.stdout + out.stderr
        said = [line for line in text.splitlines() if line.startswith("torchrelay") and name in line]
        assert len(said) == 1, (i, text[-3000:])
        # no rank's traceback (torchrun's own summary of the failed child is one, through its own files)
        assert "torchrelay/" not in text.replace("torchrelay-tests", "") and 'train_lm.py", line' not in text
        codes = [
            line.split(":", 1)[1].split()[0]
            for line in text.splitlines()
            if line.strip().startswith("exitcode")
        ]
        assert codes and set(codes) <= {"2", "-15"} and "2" in codes, (i, codes, text[-2000:])


def test_a_validation_record_past_its_bounds_is_written_cut_and_reads_back(tmp_path: Path) -> None:
    """A command's metrics were read up to 16 MiB and echoed into record.json (16 MiB at most, indented): a record
    its reader refused. Metrics past 1 MiB now fail the validation with a reason; the record is fitted to its
    schema (a command line or a reason cut)."""
    from torchrelay.controller.validation import _finish, _read_metrics
    from torchrelay.records.validation import METRICS_LIMIT, ValidationRecord, read_records

    out = tmp_path / "validation" / "checkpoint-8"
    out.mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({"loss": 1.0, "notes": "n" * METRICS_LIMIT}))
    metrics, reason = _read_metrics(out / "metrics.json")
    assert metrics is None and "more than" in reason
    record = ValidationRecord(update=8, checkpoint="checkpoint-8", command="c" * (1 << 20), status="ok",
                              reason="r" * (1 << 20), metrics={"loss": 1.0, "n": "x" * (METRICS_LIMIT - 100)})  # fmt: skip
    _finish(out, record, time.time)
    back = read_records(RunDir(tmp_path))[8]
    assert len(back.command) == 1 << 16 and back.metrics == record.metrics


def test_a_segment_code_past_its_bound_keeps_its_commit_and_reads_back(tmp_path: Path) -> None:
    """A segment's `code` holds the contract's file maps (a plain tree lists every file): past 8 MiB its maps are
    kept as cut text, its commit and tree as they are, and the line stays one the reader takes."""
    files = {f"src/module_{i:07d}.py": "0" * 64 for i in range(120_000)}
    segment = {
        "segment": "a",
        "first_update": 1,
        "code": {"commit": "c" * 40, "tree": "t" * 40, "changed": files},
    }
    write_history(RunDir(tmp_path), [segment])
    (back,) = read_history(tmp_path)
    assert back["code"]["commit"] == "c" * 40 and back["code"]["tree"] == "t" * 40
    assert isinstance(back["code"]["changed"], str) and len(back["code"]["changed"]) <= 200


def test_a_contract_of_code_outside_any_checkout_loads(tmp_path: Path) -> None:
    """A run given no code directory records code.dirty as null (nothing to call dirty); the schema took only a
    boolean, so every verb that read such a run's contract (pack, verify, status) refused it as damaged."""
    from test_hostile_records import FIXTURE
    from torchrelay.paths.rundir import RunDir
    from torchrelay.records.contract import build_contract, write_contract

    source = RunDir(FIXTURE / "run")
    cfg = stored_config(source)
    manifest = Manifest.load(source.path / "data" / "manifest.jsonl", str(FIXTURE / "data"))
    contract = build_contract(cfg, 2, None, manifest)
    assert contract["fields"]["code.dirty"] is None
    write_contract(RunDir(tmp_path), contract)
    assert load_contract(tmp_path)["fields"]["code.dirty"] is None
