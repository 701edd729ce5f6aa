"""Several nodes: where the node-local caches point (preflight), and a real 2-node torchrun on this machine."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from helpers import (
    PYTHON,
    assert_same_final_state,
    assert_same_logs,
    clean_env,
    segments,
    torchrun_cmd,
    wait_for_update,
)
from nodes import Nodes, torchrun_2node
from test_controller import launch_cli, outcome_of, write_plan
from torchrelay.cli import main
from torchrelay.controller.preflight import PreflightReport, check_node_local, filesystem_of
from torchrelay.controller.supervisor import Supervisor
from torchrelay.ledger.exposure import prove
from torchrelay.policy.stop import write_request

SHM = Path("/dev/shm")  # a real tmpfs on every Linux


def local_env(base: Path) -> dict[str, str]:
    return {
        "TMPDIR": str(base / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"),
        "TRITON_CACHE_DIR": str(base / "triton"),
    }


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        pytest.skip("no writable /dev/shm tmpfs here")
    d = SHM / f"torchrelay-test-{tmp_path.name}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ preflight
def test_caches_on_a_tmpfs_pass_on_the_run_directorys_file_system_warn(shm_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "runs" / "lm"  # not created yet: its nearest existing parent is looked at
    assert filesystem_of(shm_dir / "not" / "yet").name == "tmpfs"
    assert filesystem_of(run).device == tmp_path.stat().st_dev
    if filesystem_of(tmp_path).device == filesystem_of(shm_dir).device:
        pytest.skip("the run directory is on /dev/shm's tmpfs itself")

    report = PreflightReport()
    check_node_local(run, local_env(shm_dir), 2, report)
    (result,) = report.results
    assert not result.warning and result.detail.count("tmpfs (/dev/shm)") == 3, result.detail

    # the same caches beside the run directory: shared by both nodes of a 2-node run, named one by one
    beside = local_env(tmp_path)
    del beside["TRITON_CACHE_DIR"]
    beside["HOME"], beside["TRITON_HOME"] = str(tmp_path), str(shm_dir)  # Triton's default: under TRITON_HOME
    report = PreflightReport()
    check_node_local(run, beside, 2, report)
    (result,) = report.results
    assert result.warning and result.ok, result.detail
    assert f"TMPDIR={tmp_path / 'tmp'} (set)" in result.detail
    assert f"TORCHINDUCTOR_CACHE_DIR={tmp_path / 'inductor'} (set)" in result.detail
    assert "the run directory's file system (2 nodes share it)" in result.detail
    assert "TRITON_CACHE_DIR" not in result.detail  # $TRITON_HOME/.triton/cache, on the tmpfs
    # on one node the run directory's own (local) file system is fine
    report = PreflightReport()
    check_node_local(run, beside, 1, report)
    assert not report.results[0].warning, report.results[0].detail


def test_a_network_file_system_is_named_from_the_mount_table(tmp_path: Path) -> None:
    # No NFS server or FUSE mount can be made here: the mount table is given, the paths are real.
    mounted = tmp_path / "weka mount"
    (mounted / "cache").mkdir(parents=True)
    (tmp_path / "sshfs").mkdir()
    point = str(mounted).replace(" ", "\\040")  # how mountinfo escapes a space
    mountinfo = "\n".join(
        [
            "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
            f"90 27 0:50 / {point} rw,relatime - wekafs weka0/fs1 rw",
            f"91 27 0:51 / {tmp_path / 'sshfs'} rw - fuse.sshfs user@host:/x rw",
            f"92 27 0:52 / {tmp_path / 'ss'} rw - nfs4 server:/export rw",  # a prefix of sshfs/, not above it
        ]
    )
    fs = filesystem_of(mounted / "cache" / "inductor", mountinfo)
    assert (fs.name, fs.mount_point, fs.shared) == ("wekafs", str(mounted), True)
    fs = filesystem_of(tmp_path / "sshfs" / "tmp", mountinfo)
    assert (fs.name, fs.shared) == ("fuse.sshfs", True)
    assert filesystem_of(tmp_path / "run", mountinfo).name == "ext4"
    assert not filesystem_of(tmp_path / "run", mountinfo).shared

    env = {
        "TMPDIR": str(tmp_path / "sshfs" / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(mounted / "cache" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "triton"),
    }
    report = PreflightReport()
    check_node_local(
        tmp_path / "run", env, 1, report, mountinfo
    )  # one node: a shared file system still warns
    (result,) = report.results
    assert result.warning, result.detail
    assert f"TORCHINDUCTOR_CACHE_DIR={mounted / 'cache' / 'inductor'} (set) is on wekafs" in result.detail
    assert (
        "TMPDIR=" in result.detail
        and "fuse.sshfs" in result.detail
        and "TRITON_CACHE_DIR" not in result.detail
    )


@pytest.mark.launch
def test_launch_shows_the_cache_warning(example: dict[str, Path], tmp_path: Path) -> None:
    """Through `torchrelay launch` (stopped by a failing user check before anything starts)."""
    run = tmp_path / "run"
    check = {"name": "stop-here", "run": "exit 3"}
    plan = write_plan(
        tmp_path / "plan.yaml",
        example["code"],
        example["config"],
        run,
        preflight={"checks": [check]},
        train={"env": local_env(tmp_path)},
    )
    out = launch_cli(plan, "--set", "train.nnodes=2")
    assert out.returncode == 2 and outcome_of(run)["stage"] == "preflight", out.stdout + out.stderr
    shown = " ".join(out.stderr.split())
    assert f"preflight node-local caches: warning TMPDIR={tmp_path / 'tmp'} (set) is on" in shown
    assert "the run directory's file system (2 nodes share it)" in shown


# ------------------------------------------------------------------------------------------------ supervisor
SAVING_RANK = """
import os, pathlib, signal, sys, time
def stop(*_):
    pathlib.Path(sys.argv[2]).write_text("saved")  # the clean stop's save, then its code
    sys.exit(5)
signal.signal(signal.SIGUSR1, stop)
pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(120)
"""
AGENT = f"""
import subprocess, sys
# like torchrun: the rank in a session of its own, its exit code reported; SIGUSR1's default action kills it
rank = subprocess.Popen([sys.executable, "-c", {SAVING_RANK!r}, *sys.argv[1:]], start_new_session=True)
sys.exit(rank.wait())
"""


@pytest.mark.launch
def test_a_usr1_to_every_process_of_the_step_leaves_torchrun_to_wait_for_its_ranks(tmp_path: Path) -> None:
    """Slurm signals every process of a job step (srun forwarding it, `scancel --signal`), torchrun included."""
    ready, saved = tmp_path / "ready", tmp_path / "saved"
    sup = Supervisor(
        argv=[PYTHON, "-c", AGENT, str(ready), str(saved)], cwd=tmp_path, env=clean_env(), poll_s=0.05
    )

    def slurmstepd() -> None:
        deadline = time.monotonic() + 300
        while not ready.exists() or not ready.read_text():
            if time.monotonic() > deadline:
                return  # the agent never started (the fast tier skips its launch): nothing to signal
            time.sleep(0.02)
        rank = psutil.Process(int(ready.read_text()))
        for proc in (psutil.Process(rank.ppid()), rank):
            proc.send_signal(signal.SIGUSR1)

    step = threading.Thread(target=slurmstepd, daemon=True)  # never keeps pytest alive
    step.start()
    result = sup.run()
    step.join()
    assert result.returncode == 5 and not result.killed, result  # the agent lived to report its rank's code
    assert saved.read_text() == "saved"


# ------------------------------------------------------------------------------------------------ two nodes
U = 16  # the example config's schedule (save_every 8)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    made = Nodes(tmp_path_factory.mktemp("nodes"))
    why = made.available()
    if why:
        pytest.skip(f"two nodes cannot be made here: {why}")
    made.up()
    print(
        f"nodes: {'network namespaces joined by a veth pair' if made.netns else made.why_not + '; loopback'}"
    )
    yield made
    made.down()


def agent_exit_codes(log: Path) -> list[int]:
    """The worker exit codes a torchrun agent reported (it exits 1 itself for any of them)."""
    return [int(c) for c in re.findall(r"exitcode\s+:\s*(-?\d+)", log.read_text(errors="replace"))]


def signalled_agents(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> list[int]:
    """The exit codes of torchrun agents sent SIGTERM, each read as 1 where the agent shut its worker down and raised
    its SignalException (its log says so) but then died of SIGABRT at interpreter exit: torchrun's own rendezvous
    threads can abort it there (seen once in CI, under load). An abort before that stays -6 and fails the test."""
    codes = wait_all(procs)
    done = "SignalException: Process"
    return [
        1 if c == -6 and done in log.read_text(errors="replace") else c
        for c, log in zip(codes, logs, strict=True)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.launch
def test_two_nodes_stop_resume_elsewhere_and_end_on_one_bit_exact(
    example: dict[str, Path], nodes: Nodes, tmp_path: Path
) -> None:
    code, config, logs = example["code"], example["config"], tmp_path / "logs"
    run, ref = tmp_path / "run", tmp_path / "reference"
    port = iter(range(29500, 29600)) if nodes.netns else None

    def two(names: list[str], run_dir: Path, **kw: Any) -> list[subprocess.Popen[bytes]]:
        p = next(port) if port is not None else free_port()
        return torchrun_2node(nodes, names, code, run_dir, port=p, logs=logs / names[0], **kw)

    # the uninterrupted 2-node run, meanwhile
    reference = two(["ref-a", "ref-b"], ref, config=config)

    # 1. a request file, honoured after update 5 on both nodes; torchrun folds each node's 4 into its own 1
    run.mkdir()
    write_request(run, at_update=5)
    assert wait_all(two(["node-a", "node-b"], run, config=config)) == [1, 1]
    assert agent_exit_codes(logs / "node-a" / "node-a.log") == [4]
    assert agent_exit_codes(logs / "node-a" / "node-b.log") == [4]
    seg = segments(run)[-1]
    assert (seg["ended"], seg["last_update"], seg["hosts"], seg["world_size"]) == (
        "request", 5, ["node-a", "node-b"], 2
    )  # fmt: skip
    assert main(["status", str(run), "--last-exit"]) == 4

    # 2. a save killed on some node left a temporary; SIGTERM reaches node b's agent only, while rank 0 (node a)
    # is frozen holding the writer lock, which a launch from a third host finds taken
    stale = run / ".tmp-checkpoint-7-4242-1796000000000"
    stale.mkdir()
    (stale / "__1_0.distcp").write_bytes(b"torn")
    paced = {"params.min_update_s": 0.3}
    second = two(["node-a", "node-b"], run, sets=paced, env={"TORCHRELAY_CHECK_EVERY": "1"})
    wait_for_update(run, 6, second[0])
    holder = json.loads((run / ".torchrelay-train.lock").read_text())
    assert holder["host"] == "node-a"
    os.kill(holder["pid"], signal.SIGSTOP)
    one_rank = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        probe = subprocess.run(
            nodes.command(
                1, ["node-a", "node-x"], [PYTHON, str(code / "train_lm.py"), "--run-dir", str(run)]
            ),
            capture_output=True,
            text=True,
            timeout=300,
            env=clean_env(TORCHRELAY_LOCK_WAIT_S="0", **one_rank),
            cwd=code,
        )
        os.kill(second[1].pid, signal.SIGTERM)
    finally:
        os.kill(holder["pid"], signal.SIGCONT)
    assert probe.returncode == 2, probe.stdout + probe.stderr
    assert f"is in use by a writer: pid {holder['pid']} on node-a" in probe.stderr
    assert signalled_agents(second, [logs / "node-a" / "node-a.log", logs / "node-a" / "node-b.log"]) == [
        1,
        1,
    ]
    seg = segments(run)[-1]
    assert seg["ended"] == "signal" and 6 <= seg["last_update"] < U, seg
    assert seg["hosts"] == ["node-a", "node-b"] and not stale.exists()
    assert agent_exit_codes(logs / "node-a" / "node-a.log")[-1] == 5
    assert main(["status", str(run), "--last-exit"]) == 5
    stopped_at = seg["last_update"]

    # a node whose own copy of the script differs (a node-local checkout): refused before any update, naming it
    edited = tmp_path / "train_lm.py"
    edited.write_text((code / "train_lm.py").read_text() + "\n# edited on node-d only\n")
    other = two(["node-c", "node-d"], run, binds={1: [(edited, code / "train_lm.py")]})
    assert wait_all(other) == [1, 1]
    assert agent_exit_codes(logs / "node-c" / "node-c.log") == [2]
    shown = (logs / "node-c" / "node-c.log").read_text()
    assert "rank 1 on node-d does not run what rank 0 on node-c runs: train_lm.py sha256" in shown
    seg = segments(run)[-1]
    assert (seg["ended"], seg["hosts"], seg["last_update"]) == ("refused", ["node-c", "node-d"], stopped_at)
    assert main(["status", str(run), "--last-exit"]) == 2

    # 3. another pair of hosts continues it, with 2 loader workers a rank (forkserver: its socket in the node's
    # own TMPDIR); SIGTERM reaches both agents, as scancel does
    third = two(
        ["node-c", "node-d"], run, sets={**paced, "num_workers": 2}, env={"TORCHRELAY_CHECK_EVERY": "1"}
    )
    wait_for_update(run, stopped_at + 1, third[0])
    for agent in third:
        os.kill(agent.pid, signal.SIGTERM)
    assert signalled_agents(third, [logs / "node-c" / "node-c.log", logs / "node-c" / "node-d.log"]) == [1, 1]
    seg = segments(run)[-1]
    assert seg["ended"] == "signal" and stopped_at < seg["last_update"] < U, seg
    assert seg["hosts"] == ["node-c", "node-d"] and seg["runtime_changes"]["num_workers"] == [0, 2]

    # 4. one node with both ranks ends it: the same world size, so the same contract and the same bits
    one = nodes.command(0, ["node-e", "unused"], torchrun_cmd(code, run, sets={"num_workers": 0}))
    out = subprocess.run(one, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert wait_all(reference) == [0, 0]
    assert [(s["ended"], s["hosts"]) for s in segments(run)] == [
        ("request", ["node-a", "node-b"]),
        ("signal", ["node-a", "node-b"]),
        ("refused", ["node-c", "node-d"]),
        ("signal", ["node-c", "node-d"]),
        ("finished", ["node-e"]),
    ]
    assert segments(ref)[-1]["hosts"] == ["ref-a", "ref-b"]
    assert assert_same_final_state(ref, run, U) > 10
    assert_same_logs(ref, run)
    report = prove(run)
    assert report.ok and report.exposures == report.distinct == U * 16
    segs = [s for s in segments(run) if s["ended"] != "refused"]
    assert [s["resumed_from"] for s in segs[1:]] == [s["last_update"] for s in segs[:-1]]
    assert [s["ranks_by_host"] for s in segs] == [
        {"node-a": [0], "node-b": [1]},
        {"node-a": [0], "node-b": [1]},
        {"node-c": [0], "node-d": [1]},
        {"node-e": [0, 1]},
    ]
