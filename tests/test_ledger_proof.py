"""The incremental ledger (issue 22 goal 6): a checkpoint's LEDGER_PROOF.json stands for the prefix of the exposure
logs it proved, and `torchrelay ledger` then says exactly what the full proof says, whatever was done to the proof
or the logs. The provers are real processes (`python -m torchrelay.ledger.prover`, as rank 0 starts them), killed
for real; the run is written by tests/scale_run.py as the library writes it (4 ranks, 600 updates of 1,024, 19
updates an epoch), with checkpoints at 300 and 600 (retention keeps two).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scale_run import SRC, make_run
from torchrelay.checkpoint.inventory import check_files, read_inventory
from torchrelay.cli import main
from torchrelay.ledger import proof as ledger_proof
from torchrelay.ledger.exposure import order_and_contract, prove
from torchrelay.paths.layout import LEDGER_PROOF
from torchrelay.paths.rundir import RunDir
from torchrelay.records.train import rank_logs
from torchrelay.util.durable import temp_prefix

UPDATES, SAMPLES = 600, 20_000
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def _prover(run: Path, update: int, *, arm: str | None = None) -> subprocess.CompletedProcess[str]:
    if arm is None:
        cmd = [sys.executable, "-m", "torchrelay.ledger.prover", str(run), str(update)]
    else:  # a crash test's kill point, armed in the prover's own process
        code = (
            "import sys; from torchrelay.util import kill_points; kill_points.arm(sys.argv[1]); "
            "from torchrelay.ledger.prover import main; sys.exit(main(sys.argv[2:]))"
        )
        cmd = [sys.executable, "-c", code, arm, str(run), str(update)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def proven(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run, each of its three checkpoints proven in turn (each prover from the one before)."""
    run = make_run(
        tmp_path_factory.mktemp("ledger-proof"),
        samples=SAMPLES,
        updates=UPDATES,
        ranks=4,
        micro=8,
        checkpoints=[300, 600],
        segment_updates=200,
        total_updates=800,
    )
    for update in (300, 600):
        out = _prover(run, update)
        assert out.returncode == 0 and (run / f"checkpoint-{update}" / LEDGER_PROOF).is_file(), out.stderr
    return run


def _copy(proven: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(proven, run)
    return run


def _cli(run: Path, *args: str) -> tuple[int, str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "torchrelay", "ledger", *args, str(run)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    return out.returncode, out.stdout, out.stderr


def _in_process(run: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["ledger", *args, str(run)])
    return code, capsys.readouterr().out


def _same_as_full(run: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """The report with the proofs equals the full proof's, text and --json, exit code included."""
    for args in ((), ("--json",)):
        assert _in_process(run, capsys, *args) == _in_process(run, capsys, *args, "--full")
    return prove(run, full=True).to_dict()


def _newest(run: Path) -> int | None:
    order, _, contract_sha = order_and_contract(RunDir(run))
    logs = {p.name: p for p in rank_logs(run / "train", "exposures").values()}
    proof = ledger_proof.newest(RunDir(run), ledger_proof.identity(order, contract_sha), logs)
    return None if proof is None else proof.update


def test_the_ledger_with_proofs_says_what_the_full_proof_says(proven: Path, tmp_path: Path) -> None:
    assert _newest(proven) == 600
    for args in ((), ("--json",)):
        rc, out, err = _cli(proven, *args)
        assert (rc, out, err) == _cli(proven, *args, "--full") and rc == 0 and not err
    rep = json.loads(_cli(proven, "--json")[1])
    assert rep["ok"] and rep["updates"] == UPDATES and rep["exposures"] == UPDATES * 1024
    # The newest proof gone: 300's stands for its prefix, the 300 updates after it are read; the same report.
    run = _copy(proven, tmp_path)
    (run / "checkpoint-600" / LEDGER_PROOF).unlink()
    assert _newest(run) == 300
    assert _cli(run, "--json") == _cli(proven, "--json")
    # A proof made from the one before is the proof made from nothing: the same bytes.
    (run / "checkpoint-300" / LEDGER_PROOF).unlink()
    assert _prover(run, 600).returncode == 0
    assert (run / "checkpoint-600" / LEDGER_PROOF).read_bytes() == (
        proven / "checkpoint-600" / LEDGER_PROOF
    ).read_bytes()
    # A checkpoint retention removed has no proof to write: one line, exit 1.
    out = _prover(run, 200)
    assert out.returncode == 1 and "checkpoint-200 is not a complete checkpoint" in out.stderr
    assert "Traceback" not in out.stderr


def _reseal(doc: dict[str, Any]) -> dict[str, Any]:
    """A proof whose own digest is right again (FORMATS.md: of the canonical JSON of every other key)."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return {**body, "sha256": hashlib.sha256(text.encode()).hexdigest()}


def _tamper(run: Path, kind: str, tmp_path: Path) -> int | None:
    """Do `kind` to checkpoint-600's proof; the update of the proof the ledger must fall back to."""
    path = run / "checkpoint-600" / LEDGER_PROOF
    data = path.read_bytes()
    doc = json.loads(data)
    if kind == "byte changed":
        at = data.index(b'"sha256": "') + 11
        path.write_bytes(data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :])
    elif kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "wrong log hash, resealed":
        doc["logs"]["exposures-rank1.jsonl"]["sha256"] = hashlib.sha256(b"other").hexdigest()
        path.write_text(json.dumps(_reseal(doc)))
    elif kind == "another order, resealed":
        doc["order"]["seed"] += 1
        path.write_text(json.dumps(_reseal(doc)))
    elif kind == "planted on one checkpoint":  # 600's proof in 300, none in 600
        shutil.move(path, run / "checkpoint-300" / LEDGER_PROOF)
        return None
    elif kind == "symlink":
        outside = tmp_path / "elsewhere.json"
        shutil.move(path, outside)
        path.symlink_to(outside)
    elif kind == "a log it names is gone":
        os.rename(run / "train" / "exposures-rank3.jsonl", run / "train" / "moved-exposures-rank3.jsonl")
        return None  # every proof names rank 3's log: none holds
    else:
        raise AssertionError(kind)
    return 300


@pytest.mark.parametrize(
    "kind",
    [
        "byte changed",
        "truncated",
        "wrong log hash, resealed",
        "another order, resealed",
        "planted on one checkpoint",
        "symlink",
        "a log it names is gone",
    ],
)
def test_a_tampered_proof_is_ignored(
    proven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    run = _copy(proven, tmp_path)
    fallback = _tamper(run, kind, tmp_path)
    assert _newest(run) == fallback
    _same_as_full(run, capsys)
    rc, out, err = _cli(run)
    assert "Traceback" not in err and "LEDGER" in out


def _lines(log: Path) -> list[bytes]:
    return log.read_bytes().splitlines(keepends=True)


def _at(lines: list[bytes], update: int, micro: int) -> int:
    records = (json.loads(line) for line in lines)
    return next(k for k, r in enumerate(records) if (r["u"], r["m"]) == (update, micro))


def test_damage_after_the_proven_prefix_is_reported_as_the_full_proof_reports_it(
    proven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(proven, tmp_path)
    (run / "checkpoint-600" / LEDGER_PROOF).unlink()  # proven to 300; the damage at 500 is in the tail
    log = run / "train" / "exposures-rank2.jsonl"
    lines = _lines(log)
    at = _at(lines, 500, 0)
    lines[at + 1] = lines[at]  # micro-step 0 logged twice, micro-step 1 lost
    log.write_bytes(b"".join(lines))
    assert _newest(run) == 300
    rep = _same_as_full(run, capsys)
    assert not rep["ok"] and rep["repeats"] == 8 and rep["problems"][0].startswith("update 500: 8 expected")


def test_damage_inside_the_proven_prefix_is_caught_by_its_hash(
    proven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(proven, tmp_path)
    log = run / "train" / "exposures-rank1.jsonl"
    lines = _lines(log)
    a, b = _at(lines, 400, 0), _at(lines, 401, 0)
    ra, rb = json.loads(lines[a]), json.loads(lines[b])
    # Two samples swapped across updates, the file the same length (padded lines): only the hash tells.
    first_a, first_b = (b"[" + str(r["i"][0]).rjust(5).encode() for r in (ra, rb))
    lines[a] = lines[a].replace(first_a, first_b, 1)
    lines[b] = lines[b].replace(first_b, first_a, 1)
    size = log.stat().st_size
    log.write_bytes(b"".join(lines))
    assert log.stat().st_size == size
    assert _newest(run) == 300  # 600's prefix holds the swap, 300's ends before it
    rep = _same_as_full(run, capsys)
    assert not rep["ok"] and rep["skipped"] == 2
    assert [p.split(":")[0] for p in rep["problems"]] == ["update 400", "update 401"]
    # A prover given these logs proves nothing: no proof of a prefix that is not exact.
    (run / "checkpoint-600" / LEDGER_PROOF).unlink()
    out = _prover(run, 600)
    assert (
        out.returncode == 1
        and "not exact" in out.stderr
        and not (run / "checkpoint-600" / LEDGER_PROOF).exists()
    )


def test_a_killed_prover_leaves_no_proof(
    proven: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(proven, tmp_path)
    (run / "checkpoint-600" / LEDGER_PROOF).unlink()
    ckpt = run / "checkpoint-600"
    # Killed with its proof made, before a byte of it was written.
    out = _prover(run, 600, arm="ledger-prover:proven")
    assert out.returncode == -9 and "Traceback" not in out.stderr
    assert not any(p.name.startswith((LEDGER_PROOF, temp_prefix(LEDGER_PROOF))) for p in ckpt.iterdir())
    # Killed while it waits for its turn (the provers of a run take turns: an flock on train/).
    fd = os.open(run / "train", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchrelay.ledger.prover", str(run), "600"],
            env=ENV,
            stderr=subprocess.PIPE,
        )
        time.sleep(3)
        assert proc.poll() is None  # still waiting
        proc.kill()
        assert proc.wait() == -9
    finally:
        os.close(fd)
    assert not (ckpt / LEDGER_PROOF).exists()
    # A temporary an atomic write killed before its rename left: tolerated by the checkpoint, ignored by the ledger.
    half = (proven / "checkpoint-600" / LEDGER_PROOF).read_bytes()[:99]
    (ckpt / f"{temp_prefix(LEDGER_PROOF)}12345").write_bytes(half)
    assert check_files(ckpt, read_inventory(ckpt)) == []
    assert _newest(run) == 300
    assert _same_as_full(run, capsys)["ok"]
    rc, _, err = _cli(run)
    assert rc == 0 and not err
    # The next prover does the work.
    assert _prover(run, 600).returncode == 0 and _newest(run) == 600


def _provers_of(run: Path) -> list[int]:
    """The pids of the ledger provers of `run` alive now."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"torchrelay.ledger.prover" in argv and str(run).encode() in argv:
            out.append(int(pid))
    return out


def test_a_training_run_starts_provers_once_its_logs_grew_past_the_threshold(
    example: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from torchrelay import RelayConfig, Run

    def train(run_dir: Path) -> None:
        cfg = RelayConfig(
            seed=3,
            micro_batch=2,
            total_updates=6,
            manifest=str(example["manifest"]),
            data_root=str(example["root"]),
            save_every=3,
        )
        with Run.open(run_dir, cfg, code_dir=example["code"]) as run:
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)
            run.track(model=model, optimizer=opt)
            for step in run.steps(run.dataloader(list(range(len(run.manifest))))):
                for _, batch in step.micro_batches():
                    model(torch.randn(2, 8) + float(sum(batch))).square().mean().backward()
                opt.step()
                opt.zero_grad()

    # The default threshold (16 MiB): a small run starts none.
    monkeypatch.delenv("TORCHRELAY_LEDGER_PROOF_BYTES", raising=False)
    small = tmp_path / "small"
    train(small)
    assert _provers_of(small) == [] and not list(small.glob(f"checkpoint-*/{LEDGER_PROOF}"))
    # 0: after every commit. The prover of the last checkpoint outlives the run; it takes its turn after the first.
    monkeypatch.setenv("TORCHRELAY_LEDGER_PROOF_BYTES", "0")
    run_dir = tmp_path / "run"
    train(run_dir)
    deadline = time.monotonic() + 180
    while _provers_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(p.parent.name for p in run_dir.glob(f"checkpoint-*/{LEDGER_PROOF}")) == [
        "checkpoint-3",
        "checkpoint-6",
    ]
    assert _newest(run_dir) == 6
    assert _same_as_full(run_dir, capsys)["ok"]
