"""Fast in-process tests of the pure parts: order, manifest, contract, inventory, stop policies, ledger."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from torchrelay.checkpoint.inventory import (
    inventory_entries,
    safe_relpath,
    validate_complete,
    write_inventory,
)
from torchrelay.checkpoint.select import latest_complete
from torchrelay.cli import main
from torchrelay.config.relay import RelayConfig, stored_config
from torchrelay.data.order import GlobalOrder
from torchrelay.errors import (
    EXIT_BUDGET,
    EXIT_MEMORY,
    EXIT_REQUEST,
    EXIT_SIGNAL,
    ConfigError,
    IntegrityError,
    UnsafeInput,
)
from torchrelay.manifest import Manifest
from torchrelay.policy.stop import StopContext, StopRequest, decide
from torchrelay.records.contract import contract_diff
from torchrelay.records.history import Segment, read_history


def test_order_is_pure_and_world_size_independent() -> None:
    a = GlobalOrder(num_samples=1000, seed=3, global_batch=16)
    b = GlobalOrder(num_samples=1000, seed=3, global_batch=16)
    assert np.array_equal(a.epoch_order(1), b.epoch_order(1))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    for u in (0, 5, 61, 62, 130):  # across epoch boundaries (62 updates per epoch)
        # 2 ranks × micro 4 × accum 2 and 4 ranks × micro 4 × accum 1 consume the same global batch
        two = [i for m in range(2) for r in range(2) for i in a.slot(u, m, r, 2, 4)]
        four = [i for r in range(4) for i in a.slot(u, 0, r, 4, 4)]
        assert two == four == a.global_batch_indices(u).tolist()
    epoch0 = np.concatenate([a.global_batch_indices(u) for u in range(a.updates_per_epoch)])
    assert len(set(epoch0.tolist())) == len(epoch0) == 992


def test_length_bucketed_groups_lengths_and_covers_epoch() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, size=640).tolist()
    order = GlobalOrder(
        num_samples=640, seed=1, global_batch=8, kind="length_bucketed", lengths=lengths, bucket_size=10
    )
    ep = order.epoch_order(0)
    assert sorted(ep.tolist()) == list(range(640))
    spread = np.mean([np.ptp(np.asarray(lengths)[order.global_batch_indices(u)]) for u in range(80)])
    plain = GlobalOrder(num_samples=640, seed=1, global_batch=8)
    plain_spread = np.mean([np.ptp(np.asarray(lengths)[plain.global_batch_indices(u)]) for u in range(80)])
    assert spread < plain_spread / 3


def test_manifest_fingerprint_survives_moving_the_data(tmp_path: Path) -> None:
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"id": str(i), "path": f"/old/root/f{i}.txt"}) + "\n" for i in range(5)))
    m = Manifest.load(a, "/old/root")
    b = tmp_path / "b.jsonl"
    b.write_text("\n".join(m.rebased_lines("/new/place")) + "\n")
    m2 = Manifest.load(b, "/new/place")
    assert m.fingerprint() == m2.fingerprint() and m.sha256() != m2.sha256()
    c = tmp_path / "c.jsonl"
    c.write_text(a.read_text().replace('"3"', '"3b"'))
    assert Manifest.load(c, "/old/root").fingerprint() != m.fingerprint()
    dup = tmp_path / "d.jsonl"
    dup.write_text('{"id": "x"}\n{"id": "x"}\n')
    with pytest.raises(ConfigError, match="d.jsonl:2: duplicate sample id 'x'"):
        Manifest.load(dup)


def test_contract_diff_lists_every_field_and_skips_unknown_commit() -> None:
    old = {"seed": 1, "params.lr": 0.1, "code.commit": "abc", "code.tree": "t1"}
    new = {"seed": 2, "params.lr": 0.1, "code.commit": None, "code.tree": "t2"}
    assert contract_diff(old, new) == [("code.tree", "t1", "t2"), ("seed", 1, 2)]


def test_config_validation_names_the_field() -> None:
    base = {"seed": 1, "micro_batch": 2, "total_updates": 10, "manifest": "m.jsonl"}
    RelayConfig.from_dict(base)
    with pytest.raises(ConfigError, match=r"^config\.keep: must be >= 2"):
        RelayConfig.from_dict({**base, "keep": 1})
    with pytest.raises(ConfigError, match=r"^config\.lr: unknown field"):
        RelayConfig.from_dict({**base, "lr": 0.1})
    with pytest.raises(ConfigError, match="override 'nope' names no config field"):
        RelayConfig.from_dict(base).with_overrides({"nope": 1})


def test_inventory_refuses_unsafe_paths(tmp_path: Path) -> None:
    (tmp_path / "outside").write_text("x")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "link").symlink_to(tmp_path)
    for bad in ("/etc/passwd", "../outside", "a/../../outside", "link/outside"):
        with pytest.raises(UnsafeInput):
            safe_relpath(ck, bad, ck / "COMPLETE.json")


def test_inventory_detects_damage_and_extra_files(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-4"
    (ck / "sub").mkdir(parents=True)
    (ck / "sub" / "a.bin").write_bytes(b"abc" * 100)
    write_inventory(ck, inventory_entries(ck, ["sub/a.bin"]), update=4)
    validate_complete(ck)
    assert latest_complete(tmp_path) == ck
    (ck / "extra").write_text("?")
    with pytest.raises(IntegrityError, match="extra is not listed"):
        validate_complete(ck)
    (ck / "extra").unlink()
    (ck / "sub" / "a.bin").write_bytes(b"abd" * 100)
    with pytest.raises(IntegrityError, match="a.bin does not match its SHA-256"):
        validate_complete(ck)
    (ck / "COMPLETE.json").write_text("{trunc")  # there, but damaged: refused, never passed over
    with pytest.raises(IntegrityError, match="COMPLETE.json is damaged"):
        latest_complete(tmp_path)
    (ck / "COMPLETE.json").unlink()  # absent (a save that never committed): passed over
    assert latest_complete(tmp_path) is None


def test_stop_policies() -> None:
    ctx = StopContext(updates_done=5, now=100.0, job="7")
    assert decide(ctx) is None
    ctx.request = StopRequest(job="8", at_update=None, reason="user", time=0, by="")
    assert decide(ctx) is None  # another job's request
    ctx.request = StopRequest(job="7", at_update=6, reason="user", time=0, by="")
    assert decide(ctx) is None  # not yet
    ctx.updates_done = 6
    assert decide(ctx).code == EXIT_REQUEST
    ctx.request = StopRequest(job=None, at_update=None, reason="memory", time=0, by="")
    assert decide(ctx).code == EXIT_MEMORY
    ctx.request, ctx.signal_name = None, "SIGUSR1"
    assert decide(ctx).code == EXIT_SIGNAL
    ctx.signal_name, ctx.deadline = None, 110.0
    ctx.update_seconds, ctx.save_seconds, ctx.margin_seconds = 3.0, 4.0, 2.0
    assert decide(ctx) is None  # 10 s left >= one update + save + margin = 9 s
    ctx.now = 101.5
    assert decide(ctx).code == EXIT_BUDGET
    ctx.now, ctx.updates_to_next_check = 100.0, 2  # agreeing every 2 updates needs 12 s
    assert decide(ctx).code == EXIT_BUDGET


def test_stop_request_file_plain_job_id(tmp_path: Path) -> None:
    (tmp_path / "REQUEST_STOP").write_text("4242")  # the G3A1 card's `echo -n $SLURM_JOB_ID > ...`
    req = StopRequest.read(tmp_path / "REQUEST_STOP")
    assert req is not None and req.job == "4242" and req.at_update is None


def test_cli_errors_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stop", str(tmp_path)]) == 2
    assert "holds no torchrelay run" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    # A request for a run not launched yet needs saying so, and only into a new or empty directory.
    new = tmp_path / "new-run"
    assert main(["stop", str(new), "--at-update", "7", "--before-start"]) == 0
    req = StopRequest.read(new / "REQUEST_STOP")
    assert req is not None and req.at_update == 7
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    assert main(["stop", str(tmp_path / "junk"), "--before-start"]) == 2
    assert "is not empty and holds no run" in capsys.readouterr().err


@pytest.mark.launch
def test_ledger_cli_fails_on_a_repeat(example: dict[str, Path], tmp_path: Path) -> None:
    """A real run's ledger passes; a duplicated exposure line makes `torchrelay ledger` exit 1."""
    from helpers import launch

    run = tmp_path / "run"
    out = launch(example["code"], run, config=example["config"], sets={"total_updates": 4, "save_every": 2})
    assert out.returncode == 0, out.stderr
    assert main(["ledger", str(run)]) == 0
    log = run / "train" / "exposures-rank1.jsonl"
    lines = log.read_text().splitlines()
    tampered = json.loads(lines[2])
    tampered["u"] = 4
    log.write_text("\n".join(lines + [json.dumps(tampered)]) + "\n")
    assert main(["ledger", str(run)]) == 1
    shutil.rmtree(run)


def test_non_utf8_run_files_are_named(tmp_path: Path) -> None:
    from torchrelay.paths.rundir import RunDir
    from torchrelay.records.contract import load_contract
    from torchrelay.records.history import read_history

    for name in ("config.json", "resume_contract.json", "history.jsonl"):
        (tmp_path / name).write_bytes(b"\xff\xfe\x80 not utf-8")
    with pytest.raises(IntegrityError, match=r"config.json \(the run's configuration\): not UTF-8 text"):
        stored_config(RunDir(tmp_path))
    with pytest.raises(
        IntegrityError, match=r"resume_contract.json \(the training contract\): not UTF-8 text"
    ):
        load_contract(tmp_path)
    with pytest.raises(IntegrityError, match="history.jsonl is not UTF-8"):
        read_history(tmp_path)


def test_jsonl_skips_a_torn_last_line_and_names_a_bad_middle_line(tmp_path: Path) -> None:
    from torchrelay.records.history import read_history
    from torchrelay.util.jsonl import read_records

    path = tmp_path / "history.jsonl"
    path.write_text('{"segment": "a"}\n\n{"segment": "b"}\n{"segment": "c", "ended')  # killed mid-write
    assert [r["segment"] for r in read_records(path)] == ["a", "b"]
    path.write_text('{"segment": "a"}\n{"segment": "b"}')  # whole JSON but no newline: the write was cut
    assert [r["segment"] for r in read_history(tmp_path)] == ["a"]
    path.write_text('{"segment": "a"}\n[1, 2]\n{"segment": "c"}\n')  # history.jsonl used to skip it silently
    with pytest.raises(
        IntegrityError, match=r"history.jsonl: line 2 is not a JSON object, and lines follow it"
    ):
        read_history(tmp_path)
    path.write_bytes(b'{"segment": "a"}\n{"segment": "\xff"}\n')
    with pytest.raises(IntegrityError, match="history.jsonl is not UTF-8 text .* at line 2"):
        read_history(tmp_path)
    assert read_records(tmp_path / "absent.jsonl") == []


def test_the_ledger_names_a_damaged_exposure_line_instead_of_stopping_there(tmp_path: Path) -> None:
    # The ledger's reader used to stop silently at the first bad line: nothing after it was proven or named.
    from torchrelay.ledger.exposure import prove

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "fixtures" / "legacy-v0.1.0" / "run", run)
    assert prove(run).ok
    path = run / "train" / "exposures-rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = lines[2][:9] + "\n"
    path.write_text("".join(lines))
    with pytest.raises(IntegrityError, match=r"exposures-rank0.jsonl: line 3 is not JSON"):
        prove(run)


def test_one_map_between_end_states_and_exit_codes() -> None:
    from torchrelay.records.ended import CLEAN_STOPS, Ended, ended_of, exit_code_of

    for code in (0, 2, 3, 4, 5, 6):
        assert exit_code_of(ended_of(code)) == code
    assert (ended_of(1), ended_of(137), exit_code_of("crash"), exit_code_of("no such state")) == (
        "error",
    ) * 2 + (1, 1)
    assert (
        exit_code_of("memory-killed") == 6 and json.dumps(Ended.CRASH) == '"crash"'
    )  # history.jsonl unchanged
    assert all(exit_code_of(e) in (3, 4, 5, 6) for e in CLEAN_STOPS)


def test_the_segment_record_round_trips_history_lines_exactly() -> None:
    fixtures = Path(__file__).parent / "fixtures" / "legacy-v0.1.0"
    lines = [r for d in ("run", "bundle") for r in read_history(fixtures / d)]
    assert lines and all("deadline" not in r for r in lines)  # written before the field existed
    newer = {**lines[-1], "deadline": None, "hosts": ["a", "b"], "ranks_by_host": {"a": [0], "b": [1]}}
    newer["elastic"] = {"from": 2}
    for doc in [*lines, newer]:
        segment = Segment.from_dict(doc)
        again = pickle.loads(pickle.dumps(segment))  # as rank 0 broadcasts it
        assert json.dumps(again.to_dict(), sort_keys=True) == json.dumps(doc, sort_keys=True)
    assert Segment.from_dict(newer).extra == {"elastic": {"from": 2}}  # a newer writer's field is kept
    with pytest.raises(ValueError, match="lacks \\['world_size'\\]"):
        Segment.from_dict({k: v for k, v in lines[0].items() if k != "world_size"})


def test_kill_points_are_armed_in_the_process_never_by_the_environment() -> None:
    """A crash test's kill lands where it was armed; the old variable in the environment arms nothing."""
    import os
    import signal

    from torchrelay.util import kill_points

    def child(arm: str | None) -> int:
        pid = os.fork()
        if pid == 0:  # the child never returns into pytest
            os.environ["TORCHRELAY_TEST_KILL"] = "pack:marked"
            kill_points.arm(arm)
            kill_points.kill_point("pack:marked")
            hook = kill_points.save_hook(8, 1)
            if hook is not None:
                hook("inventory")
            os._exit(0)
        return os.waitpid(pid, 0)[1]

    assert os.WIFEXITED(child(None)) and os.WEXITSTATUS(child(None)) == 0
    for spec in ("pack:marked", "inventory:8:1"):
        status = child(spec)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, spec
    assert os.WIFEXITED(child("inventory:8:0"))  # another rank's save
    try:
        kill_points.arm("shards:8:1")
        assert kill_points.save_hook(8, 1) is not None and kill_points.save_hook(4, 1) is None
        with pytest.raises(ValueError, match="expected <shards|inventory|rename>"):
            kill_points.arm("write:8:1")
        kill_points.arm(
            "stall:8:1"
        )  # inside that save's write (its writer process or persist thread): no phase
        assert kill_points.write_fault(8, 1) == "stall" and kill_points.save_hook(8, 1) is None
        assert kill_points.write_fault(8, 0) is None and kill_points.write_fault(4, 1) is None
        kill_points.arm("writer:8:1")
        assert kill_points.write_fault(8, 1) == "writer"
    finally:
        kill_points.arm(None)


def test_the_heap_is_frozen_at_exit_once_after_the_handlers_registered_later() -> None:
    # A fresh interpreter: the handler is the process's own. The probe, registered first, runs last (atexit is last in,
    # first out) and sees what freeze_at_exit's one handler did; a second call registers nothing more.
    import subprocess
    import sys

    probe = (
        "import atexit, gc\n"
        "atexit.register(lambda: print(gc.get_freeze_count() > 0))\n"
        "from torchrelay.util.finalize import freeze_at_exit\n"
        "before = atexit._ncallbacks()\n"
        "freeze_at_exit(); freeze_at_exit()\n"
        "print(atexit._ncallbacks() - before, gc.get_freeze_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "0", "True"], out.stdout + out.stderr
