"""At scale (issue 11): `status`, `ledger` and a rank's manifest read in memory that does not grow with the run.

A small version of benchmarks/bench_scale.py (both write the run with tests/scale_run.py): a run of 2,000 updates x
1,024 (2 M exposures in 4 ranks' logs) over a 200,000-sample manifest, written as the library writes it. Each command
runs in a fresh process that reports its own peak RSS (VmHWM). Measured on main before this change: status 377 MiB,
ledger 375 MiB, the manifest 245 MiB; after: 40, 113 and 44 MiB. The bounds sit between, with room for a slower or
busier machine; no time is asserted.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from scale_run import _HWM, cli, make_run, measure, write_manifest
from torchrelay.ledger.exposure import order_for, prove
from torchrelay.manifest import Manifest, index_path
from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import trim_after

UPDATES, BATCH, SAMPLES = 2000, 1024, 200_000

_MANIFEST = (
    _HWM
    + """
import sys
from pathlib import Path
from torchrelay.manifest import Manifest
run = Path(sys.argv[1])
m = Manifest.load(run / "data" / "manifest.jsonl", "/data/lingbot", index=run / "data" / "manifest.index.npz")
print(len(m), m.indexed, m.fingerprint(), "hwm_kib", _hwm())
"""
)


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("scale")
    return make_run(
        base,
        samples=SAMPLES,
        updates=UPDATES,
        ranks=4,
        micro=8,
        checkpoints=[1000],
        segment_updates=500,
        total_updates=3000,
    )


def _json(result: dict) -> dict:
    return json.loads(result["stdout"][: result["stdout"].rindex("}") + 1])


def _measure(args: list[str]) -> dict:
    r = measure(args, keep_stdout=True)
    assert r["rc"] == 0, r["err"]
    return r


def test_status_reads_no_exposure_and_stays_small(scale_run: Path) -> None:
    r = _measure(cli("status", "--json", str(scale_run)))
    s = _json(r)
    assert (s["updates_done"], s["exposures"], s["global_batch"]) == (UPDATES, UPDATES * BATCH, BATCH)
    assert s["ledger_ok"] is None and s["distinct"] is None  # not proven: that is `ledger`'s job
    per_epoch = SAMPLES // BATCH
    assert s["epoch"] == round(UPDATES / per_epoch, 4)
    assert s["remaining_in_epoch"] == (per_epoch - UPDATES % per_epoch) * BATCH
    assert len(s["segments"]) == 4 and [c["update"] for c in s["checkpoints"]] == [1000]
    assert r["peak_rss_mib"] < 100, r  # main: 377 MiB (it proved the ledger from every exposure)


def test_ledger_proves_2m_exposures_in_bounded_memory(scale_run: Path) -> None:
    r = _measure(cli("ledger", "--json", str(scale_run)))
    rep = _json(r)
    assert rep["ok"] and rep["exposures"] == UPDATES * BATCH and rep["updates"] == UPDATES
    order, _ = order_for(RunDir(scale_run))
    seen = np.zeros(SAMPLES, dtype=bool)
    for update in range(0, UPDATES, order.updates_per_epoch):  # each epoch's samples, the last one's in part
        epoch, left = order.epoch_of(update), min(UPDATES - update, order.updates_per_epoch)
        seen[order.epoch_order(epoch)[: left * BATCH]] = True
    assert rep["distinct"] == seen.sum() and rep["repeats"] == rep["skipped"] == 0
    assert r["peak_rss_mib"] < 200, r  # main: 375 MiB (a Python int per exposure, a Counter per epoch)


def test_a_rank_reads_the_manifest_index_not_its_lines(scale_run: Path, tmp_path: Path) -> None:
    r = _measure([sys.executable, "-c", _MANIFEST, str(scale_run)])
    samples, indexed, fingerprint = r["stdout"].split()[:3]
    assert (int(samples), indexed) == (SAMPLES, "True")
    assert r["peak_rss_mib"] < 120, r  # main: 245 MiB (a dict per sample)
    # Without its index (a run made before it), every line is read, in bounded memory, to the same fingerprint.
    copy = tmp_path / "run"
    (copy / "data").mkdir(parents=True)
    shutil.copy(scale_run / "data" / "manifest.jsonl", copy / "data")
    cold = _measure([sys.executable, "-c", _MANIFEST, str(copy)])
    assert cold["stdout"].split()[:3] == [str(SAMPLES), "False", fingerprint]
    assert cold["peak_rss_mib"] < 120, cold


def test_the_index_is_used_only_for_the_bytes_it_was_made_from(tmp_path: Path) -> None:
    src = tmp_path / "manifest.jsonl"
    write_manifest(src, 3000)
    cold = Manifest.load(src, "/data/lingbot", index=index_path(src))
    assert not cold.indexed
    cold.save_index(index_path(src))
    m = Manifest.load(src, "/data/lingbot", index=index_path(src))
    assert m.indexed and m.fingerprint() == cold.fingerprint() and list(m.lengths()) == list(cold.lengths())
    assert m.records[1234]["id"] == "ep000001234" and m.id_of(-1) == "ep000002999"
    edited = tmp_path / "edited" / "manifest.jsonl"
    edited.parent.mkdir()
    edited.write_text(src.read_text().replace("ep000000007", "ep00000000X", 1))  # same size, other bytes
    shutil.copy(index_path(src), index_path(edited))
    m2 = Manifest.load(edited, "/data/lingbot", index=index_path(edited))
    assert not m2.indexed and m2.fingerprint() != m.fingerprint()
    assert not Manifest.load(src, "/elsewhere", index=index_path(src)).indexed  # another data root


def test_a_damaged_ledger_across_epochs_names_the_update_and_the_repeat(
    scale_run: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(scale_run, run, ignore=shutil.ignore_patterns("checkpoint-*"))
    log = run / "train" / "exposures-rank2.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    # update 1500 lies in epoch 7 (195 updates an epoch): its micro-step 0 logged twice, micro-step 1 lost
    at = next(i for i, line in enumerate(lines) if line.startswith('{"u":') and json.loads(line)["u"] == 1500)
    assert [(json.loads(lines[k])["u"], json.loads(lines[k])["m"]) for k in (at, at + 1)] == [
        (1500, 0),
        (1500, 1),
    ]
    first_id = json.loads(lines[at])["i"][0]
    lines[at + 1] = lines[at]
    log.write_text("".join(lines))
    rep = prove(run)
    assert (rep.ok, rep.exposures, rep.repeats, rep.skipped) == (False, UPDATES * BATCH, 8, 8)
    assert rep.problems[0] == "update 1500: 8 expected sample(s) missing, 8 unexpected (e.g. {})".format(
        [f"ep{first_id:09d}"] + [f"ep{i:09d}" for i in json.loads(lines[at])["i"][1:3]]
    )
    assert rep.problems[1].startswith("epoch 7: 8 repeated exposure(s), e.g. ['ep")


def test_a_swap_and_a_repeat_inside_one_update_are_each_named(scale_run: Path, tmp_path: Path) -> None:
    """The two damages that leave every update's count right: a good epoch's shortcut (every exposure a distinct
    sample in its own update) must not take them for good ones."""
    run = tmp_path / "run"
    shutil.copytree(scale_run, run, ignore=shutil.ignore_patterns("checkpoint-*"))
    log = run / "train" / "exposures-rank1.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    recs = {(r["u"], r["m"]): (k, r) for k, r in ((k, json.loads(line)) for k, line in enumerate(lines))}
    (k400, r400), (k1500, r1500), (k1501, r1501) = recs[400, 0], recs[1500, 0], recs[1501, 0]
    twice = r400["i"][0]
    r400["i"][1] = twice  # epoch 2: a sample logged twice in its own update, one never
    a, b = r1500["i"][0], r1501["i"][0]
    r1500["i"][0], r1501["i"][0] = b, a  # epoch 7: two samples swapped across updates
    for k, r in ((k400, r400), (k1500, r1500), (k1501, r1501)):
        lines[k] = json.dumps(r, separators=(",", ":")) + "\n"
    log.write_text("".join(lines))
    rep = prove(run)
    assert (rep.ok, rep.exposures, rep.repeats, rep.skipped, rep.distinct) == (
        False,
        UPDATES * BATCH,
        1,
        3,
        SAMPLES,
    )
    name = "ep{:09d}".format
    assert rep.problems == [
        f"update 400: 1 expected sample(s) missing, 1 unexpected (e.g. {[name(twice)]})",
        f"update 1500: 1 expected sample(s) missing, 1 unexpected (e.g. {[name(b)]})",
        f"update 1501: 1 expected sample(s) missing, 1 unexpected (e.g. {[name(a)]})",
        f"epoch 2: 1 repeated exposure(s), e.g. {[name(twice)]}",
    ]


def test_trimming_cuts_the_tail_past_the_checkpoint(scale_run: Path, tmp_path: Path) -> None:
    train = tmp_path / "train"
    shutil.copytree(scale_run / "train", train)
    log = train / "exposures-rank0.jsonl"
    before = log.read_bytes()
    with open(log, "ab") as f:
        f.write(b'{"u":2001,"m":0,"i":[1,')  # a torn last line
    archive = trim_after(train, 1000)
    assert archive is not None
    kept = log.read_bytes()
    assert before.startswith(kept) and kept.endswith(b"\n")
    assert json.loads(kept.splitlines()[-1])["u"] == 1000
    assert kept + (archive / log.name).read_bytes() == before + b'{"u":2001,"m":0,"i":[1,'
    assert trim_after(train, 1000) is None  # nothing past 1000 any more
