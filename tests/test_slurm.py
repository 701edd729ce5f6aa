"""`torchrelay sbatch` under a real one-node Slurm (.ci/slurm-up.sh): warning signal, clean stop, requeue, resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import (
    REPO,
    assert_same_final_state,
    clean_env,
    last_logged,
    launch_bg,
    segments,
    write_config,
)
from test_controller import CLI, write_plan
from torchrelay.controller.argv import training_argv
from torchrelay.controller.attempts import Attempts
from torchrelay.controller.memguard import GIB, MemoryLimits
from torchrelay.controller.plan import Plan
from torchrelay.controller.slurm import (
    BatchSpec,
    parse_end_time,
    render_batch_script,
    rendezvous,
    time_limit_minutes,
)
from torchrelay.errors import ConfigError
from torchrelay.ledger.exposure import prove
from torchrelay.paths.rundir import RunDir

U = 24
U_MEMORY = 16  # the example's total_updates (save_every 8)
FIRST_JOB_PACE = 2.0  # s an update at least: U of them outlast any first job's warning (see below)
PACE = 0.25
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


@pytest.fixture(scope="session")
def slurm_up() -> str:
    """A running one-node Slurm; started by .ci/slurm-up.sh when it is not up yet. Returns the node name."""
    if os.name != "posix" or os.geteuid() != 0:
        pytest.skip("Slurm needs root here: .ci/slurm-up.sh installs slurm-wlm/munge and starts the daemons")
    out = subprocess.run(
        ["bash", str(REPO / ".ci" / "slurm-up.sh")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f".ci/slurm-up.sh failed:\n{out.stdout}\n{out.stderr}"
    return subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()


# ------------------------------------------------------------------------------------------------ units
def test_batch_script_asks_for_the_signal_traps_it_and_requeues(tmp_path: Path) -> None:
    spec = BatchSpec(
        plan_path=tmp_path / "plan.yaml",
        run_dir=tmp_path / "runs" / "lm",
        workdir=tmp_path,
        time="04:00:00",
        nodes=2,
        gpus_per_node=8,
        signal_s=300,
        sets=["smoke.when=first"],
        partition="gpu",
    )
    text = render_batch_script(spec)
    for line in (
        "#SBATCH --signal=B:USR1@300",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        f"#SBATCH --output={tmp_path / 'runs' / 'lm.slurm-%j.out'}",
        "trap 'forward USR1' USR1",
        'scontrol requeue "$SLURM_JOB_ID"',
        "3|5)",
    ):
        assert line in text, line
    assert f"launch {tmp_path / 'plan.yaml'} --set smoke.when=first ) &" in text
    script = tmp_path / "job.sh"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    with pytest.raises(ConfigError, match="leaves no time before the warning signal"):
        BatchSpec(plan_path=script, run_dir=tmp_path, workdir=tmp_path, time="5", signal_s=300)
    assert time_limit_minutes("1-02:03:04") == 1440 + 123 + 4 / 60
    assert time_limit_minutes("90") == 90 and time_limit_minutes("1:30") == 1.5
    assert parse_end_time("N/A") is None
    assert parse_end_time("2026-01-01T00:00:00") == time.mktime((2026, 1, 1, 0, 0, 0, 0, 0, -1))


def test_multi_node_command_comes_from_the_allocation(tmp_path: Path) -> None:
    plan = Plan.from_dict(
        {
            "run_dir": "run",
            "train": {"script": "train.py", "args": ["--x"], "nproc_per_node": 8, "nnodes": 4},
        },
        tmp_path,
    )
    calls = []

    def runner(argv: list[str]) -> str:
        calls.append(list(argv))
        return "gpu01\ngpu02\ngpu03\ngpu04\n"

    env = {"SLURM_JOB_ID": "170648", "SLURM_JOB_NODELIST": "gpu[01-04]"}
    assert rendezvous(env, runner) == ("gpu01", 20000 + 170648 % 20000, 4)
    limits = MemoryLimits(soft_bytes=int(691.2 * GIB), hard_bytes=740 * GIB)
    argv = training_argv(plan, tmp_path / "run", limits, env, runner)
    assert calls[-1] == ["scontrol", "show", "hostnames", "gpu[01-04]"]
    srun, rest = argv[: argv.index("-m")], argv[argv.index("-m") :]
    assert srun[0] == "srun" and "--nodes=4" in srun and "--ntasks-per-node=1" in srun
    assert rest[:2] == ["-m", "torchrelay.controller.supervisor"] and "--soft-gib=691.200" in rest
    torchrun = rest[rest.index("--") + 1 :]
    assert "--nnodes=4" in torchrun and "--node_rank={SLURM_NODEID}" in torchrun
    assert "--master_addr=gpu01" in torchrun and "--nproc_per_node=8" in torchrun
    assert torchrun[-2:] == ["train.py", "--x"]


# ------------------------------------------------------------------------------------------------ real Slurm
def job_state(job: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, env=env
    ).stdout
    state = re.search(r"JobState=(\S+)", out)
    return state.group(1) if state else "GONE"


@pytest.mark.slurm
def test_short_job_is_signalled_requeued_and_ends_bit_exact(
    example: dict[str, Path], slurm_up: str, tmp_path: Path
) -> None:
    # Slurm's warning comes 10-40 s into a one-minute job with @20 (slurmctld checks every ~30 s). The first job
    # is paced to >= 2 s an update (a runtime param: no bit changes): its 24 updates take >= 48 s of training on
    # any machine, so it can never finish them. Once it has been warned, the job's time limit is raised and the
    # configuration rewritten unpaced: the requeued job resumes at full speed, unwarned, and ends the run.
    def lm_yaml(path: Path, pace: float) -> Path:
        return write_config(
            path,
            example["manifest"],
            example["root"],
            total_updates=U,
            save_every=8,
            **{"params.min_update_s": pace},
        )

    config = lm_yaml(tmp_path / "lm.yaml", FIRST_JOB_PACE)
    run = tmp_path / "runs" / "lm"
    plan = write_plan(
        tmp_path / "plan.yaml",
        example["code"],
        config,
        run,
        smoke={"when": "never"},  # the smoke is tested in test_controller; here every second counts
        budget={"margin_s": 3.0, "startup_s": 5.0, "update_s": FIRST_JOB_PACE + 0.05, "save_s": 0.5},
        slurm={"time": "1", "signal_s": 20, "job_name": "relay-test", "max_requeues": 5},
        train={"env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}},
    )
    sub = subprocess.run(
        [*CLI, "sbatch", str(plan), "--submit"], capture_output=True, text=True, env=clean_env(), timeout=60
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = re.search(r"submitted job (\d+)", sub.stdout).group(1)  # type: ignore[union-attr]
    log = tmp_path / "runs" / f"lm.slurm-{job}.out"
    # The uninterrupted reference runs meanwhile, unpaced: the pace changes no bit, only the time and job count.
    ref = tmp_path / "reference"
    reference = launch_bg(example["code"], ref, config=lm_yaml(tmp_path / "reference.yaml", 0.0))
    metrics_file = run / "train" / "metrics-rank0.jsonl"
    t0 = time.time()
    try:
        state, paced, limited = "PENDING", True, True
        while time.time() - t0 < 480:
            state = job_state(job)
            if state in FINAL_STATES:
                break
            if paced and metrics_file.exists() and metrics_file.read_text().strip():
                # its ranks train, so they have read the file: the next job's will not be paced
                lm_yaml(config, 0.0)
                paced = False
            if limited and log.exists() and "USR1 received" in log.read_text():
                # warned: the next job gets 5 minutes, so no warning cuts it short (a requeue keeps the limit)
                extend = ["scontrol", "update", f"JobId={job}", "TimeLimit=5"]
                out = subprocess.run(extend, capture_output=True, text=True)
                assert out.returncode == 0, out.stderr
                limited = False
            time.sleep(0.5)
        else:
            pytest.fail(f"job {job} still {state} after 480 s:\n{log.read_text() if log.exists() else ''}")
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    text = log.read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text}"
    assert reference.wait(timeout=120) == 0, reference.stdout.read() if reference.stdout else ""

    # one attempt and one history segment per run of the job (the appended log shows each start)
    starts = re.findall(rf"torchrelay: job {job} \(restart (\d+)\)", text)
    assert starts == [str(i) for i in range(len(starts))] and len(starts) >= 2, text
    assert "USR1 received" in text and f"requeueing job {job}" in text, text
    segs = segments(run)
    assert len(segs) == len(starts) == len(Attempts(RunDir(run)).all()), text
    assert all(s["job"] == job for s in segs)
    assert segs[0]["runtime_changes"] == {} and segs[1]["runtime_changes"] == {
        "params.min_update_s": [FIRST_JOB_PACE, 0]
    }
    assert "signal" in [s["ended"] for s in segs[:-1]], [s["ended"] for s in segs]
    assert all(s["ended"] in ("signal", "budget") for s in segs[:-1]) and segs[-1]["last_update"] == U
    # a stop agreed at the last update is a finished run for the controller: no job only to record the end
    assert segs[-1]["ended"] in ("finished", "signal", "budget") and "torchrelay: controller exited 0" in text
    for before, after in zip(segs, segs[1:]):
        assert (
            after["first_update"] == before["last_update"] + 1
            and after["resumed_from"] == before["last_update"]
        )

    assert assert_same_final_state(ref, run, U) > 10
    report = prove(run)
    assert report.prefix_ok and report.repeats == 0 and report.skipped == 0


@pytest.fixture(scope="session")
def slurm_two(slurm_up: str) -> str:
    """A second Slurm with two nodes, n1 and n2 (its default partition), each a slurmd in a network namespace of
    its own, and a spare n3 in partition `spare` only (.ci/slurm-2node-up.sh; it leaves the one-node cluster
    alone). Returns its SLURM_CONF."""
    out = subprocess.run(
        ["bash", str(REPO / ".ci" / "slurm-2node-up.sh")], capture_output=True, text=True, timeout=300
    )
    if out.returncode == 3:
        pytest.skip(f"no network namespaces for a second node here: {out.stderr.strip()}")
    assert out.returncode == 0, f".ci/slurm-2node-up.sh failed:\n{out.stdout}\n{out.stderr}"
    return "/run/torchrelay-slurm2/slurm.conf"


@pytest.mark.slurm
def test_two_node_job_stops_on_a_signal_requeues_and_ends_bit_exact(
    example: dict[str, Path], slurm_two: str, tmp_path: Path
) -> None:
    """controller -> srun -> a per-node agent on n1 and on n2 -> torchrun's rank there; `scancel --signal=USR1`
    reaches the batch shell, the controller forwards it, srun signals every process of the step on both nodes."""
    total = 30
    config = write_config(
        tmp_path / "lm.yaml", example["manifest"], example["root"], total_updates=total, save_every=10
    )
    run = tmp_path / "runs" / "lm"
    scratch = "/run/torchrelay-slurm2/scratch"  # the same path on each node, a tmpfs of its own there
    local = {
        "TMPDIR": scratch,
        "TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor",
        "TRITON_CACHE_DIR": f"{scratch}/triton",
    }

    def two_node_plan(pace: float) -> Path:
        return write_plan(
            tmp_path / "plan.yaml",
            example["code"],
            config,
            run,
            smoke={"when": "never"},
            budget={"margin_s": 3.0, "startup_s": 5.0, "update_s": PACE + 0.05, "save_s": 0.5},
            slurm={"time": "5", "job_name": "relay-two", "max_requeues": 2},
            train={
                "nnodes": 2,
                "nproc_per_node": 1,
                "args": ["--config", str(config), "--set", f"params.min_update_s={pace}"],  # a runtime param
                "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **local},
            },
        )

    plan = two_node_plan(PACE)  # paced, so the stop lands before the end
    env = clean_env(SLURM_CONF=slurm_two)
    sub = subprocess.run(
        [*CLI, "sbatch", str(plan), "--submit"], capture_output=True, text=True, env=env, timeout=60
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = re.search(r"submitted job (\d+)", sub.stdout).group(1)  # type: ignore[union-attr]
    log = tmp_path / "runs" / f"lm.slurm-{job}.out"
    # the uninterrupted reference on one node, meanwhile: world size 2 either way, so the same contract and bits
    reference = launch_bg(example["code"], tmp_path / "reference", config=config)
    metrics_file = run / "train" / "metrics-rank0.jsonl"
    t0 = time.time()
    state = "PENDING"
    try:
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
            state = job_state(job, env)
            assert state in ("PENDING", "CONFIGURING", "RUNNING") and time.time() - t0 < 240, (
                f"job {job} {state}:\n{log.read_text() if log.exists() else ''}"
            )
            time.sleep(0.5)
        scancel = subprocess.run(
            ["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True
        )
        assert scancel.returncode == 0, scancel.stderr
        two_node_plan(0)  # the requeued job's controller reads the plan again: it finishes at full speed
        while time.time() - t0 < 420:
            state = job_state(job, env)
            if state in FINAL_STATES:
                break
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job], capture_output=True, env=env)
    text = log.read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text}"
    assert reference.wait(timeout=120) == 0, reference.stdout.read() if reference.stdout else ""

    assert "USR1 received" in text and f"requeueing job {job}" in text and "(restart 1) on n1" in text, text
    assert "preflight node-local caches: ok TMPDIR on tmpfs" in " ".join(text.split()), text
    # torchrun on each node lived through the step-wide USR1 and reported its rank; nothing was killed
    assert "outlived it" not in text and "killing" not in text, text
    segs = segments(run)
    assert [s["ended"] for s in segs] == ["signal", "finished"], text
    assert all(s["job"] == job and s["ranks_by_host"] == {"n1": [0], "n2": [1]} for s in segs), segs
    assert segs[1]["resumed_from"] == segs[0]["last_update"] < total
    assert segs[1]["runtime_changes"] == {"params.min_update_s": [PACE, 0]}, segs[1]
    notes = json.loads((Attempts(RunDir(run)).all()[0].path / "outcome.json").read_text())["notes"]
    assert "forwarded SIGUSR1 to the ranks" in notes
    assert assert_same_final_state(tmp_path / "reference", run, total) > 10
    report = prove(run)
    assert report.ok and report.repeats == 0 and report.skipped == 0


def _memory_checkpoint(root: Path, update: int) -> bool:
    """Whether the memory tier under `root` (TORCHRELAY_MEMORY_ROOT) holds a complete checkpoint of `update`."""
    return any(root.glob(f"*/*/checkpoint-{update}/COMPLETE.json"))


@pytest.mark.slurm
def test_a_requeue_that_kills_resumes_from_the_memory_tier_and_a_wiped_one_from_durable(
    example: dict[str, Path], slurm_up: str, tmp_path: Path
) -> None:
    """`scontrol requeue` of a running job: Slurm's requeue path, the one a preemption (PreemptMode=REQUEUE) and
    a NODE_FAIL requeue of a batch job also take: SIGCONT and SIGTERM to every process of the job, SIGKILL
    KillWait later, the same job pending again. It is crash-like when the ranks cannot stop within KillWait, as a
    large model's durable save cannot: here rank 0 hangs (a test hook, a rank stuck in a collective). The job's
    next run, on the same node, resumes from the memory tier; run again, requeued with its memory wiped between the
    runs, it resumes from the durable tier with the reason noted; the end is bit-exact, the ledger proved."""
    runtime = [
        *yaml.safe_load((REPO / "examples" / "lm.yaml").read_text())["runtime_params"],
        "hang_at_update",
    ]
    shm = Path("/dev/shm") / f"torchrelay-test-{tmp_path.name}"  # the plan names it: TORCHRELAY_MEMORY_ROOT

    def lm_yaml(path: Path, hang: int) -> Path:  # a runtime param: no bit changes
        return write_config(path, example["manifest"], example["root"], memory_every=1, runtime_params=runtime,
                            **{"params.hang_at_update": hang})  # fmt: skip

    config = lm_yaml(tmp_path / "lm.yaml", 11)
    run = tmp_path / "runs" / "lm"
    plan = write_plan(
        tmp_path / "plan.yaml",
        example["code"],
        config,
        run,
        smoke={"when": "never"},
        budget={"margin_s": 3.0, "startup_s": 5.0, "update_s": PACE + 0.05, "save_s": 0.5},
        slurm={"time": "5", "job_name": "relay-memory", "max_requeues": 0},  # only Slurm's own requeues
        train={"env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCHRELAY_MEMORY_ROOT": str(shm)}},
    )
    sub = subprocess.run(
        [*CLI, "sbatch", str(plan), "--submit"], capture_output=True, text=True, env=clean_env(), timeout=60
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = re.search(r"submitted job (\d+)", sub.stdout).group(1)  # type: ignore[union-attr]
    log = tmp_path / "runs" / f"lm.slurm-{job}.out"
    reference = launch_bg(example["code"], tmp_path / "reference", config=lm_yaml(tmp_path / "ref.yaml", 0))
    t0 = time.time()

    def until(done: Any, what: str) -> None:
        while not done():
            state = job_state(job)
            assert state not in FINAL_STATES and time.time() - t0 < 360, (
                f"job {job} {state} before {what}:\n{log.read_text() if log.exists() else ''}"
            )
            time.sleep(0.2)

    def requeue() -> None:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr

    try:
        # rank 0 hangs at update 11, once the memory tier holds checkpoint-10 (durable: checkpoint-8)
        until(lambda: last_logged(run) == 10 and _memory_checkpoint(shm, 10), "memory checkpoint-10")
        lm_yaml(config, 14)  # the next run hangs at 14
        requeue()
        until(lambda: last_logged(run) == 13 and _memory_checkpoint(shm, 13), "memory checkpoint-13")
        lm_yaml(config, 0)  # the last run finishes
        requeue()
        until(lambda: job_state(job) == "PENDING", "the second requeue")
        shutil.rmtree(shm)  # wiped between the runs (an epilog, a reboot, a per-job /dev/shm)
        state = "PENDING"
        while time.time() - t0 < 360 and state not in FINAL_STATES:
            state = job_state(job)
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        shutil.rmtree(shm, ignore_errors=True)
    text = log.read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text}"
    assert reference.wait(timeout=120) == 0, reference.stdout.read() if reference.stdout else ""

    assert text.count("DUE TO JOB REQUEUE") == 2 and "(restart 2)" in text, text
    segs = segments(run)
    assert [s["ended"] for s in segs] == ["crash", "crash", "finished"], segs
    assert all(s["job"] == job for s in segs), segs
    # the memory tier survived the requeue: resumed past the durable checkpoint-8, nothing lost
    assert (segs[1]["resumed_tier"], segs[1]["resumed_from"]) == ("memory", 10), segs[1]
    # wiped: the durable tier, and why
    assert (segs[2]["resumed_tier"], segs[2]["resumed_from"]) == ("durable", 8), segs[2]
    wiped = "no memory checkpoint past update 8 though the run reached update 13 (memory_every 1): "
    assert any(n.startswith(wiped) and str(shm) in n for n in segs[2]["notes"]), segs[2]["notes"]
    assert [s["runtime_changes"] for s in segs[1:]] == [
        {"params.hang_at_update": [11, 14]},
        {"params.hang_at_update": [14, 0]},
    ], segs
    shown = subprocess.run(
        [*CLI, "status", str(run)], capture_output=True, text=True, env=clean_env(COLUMNS="200")
    )
    assert "resumed from the memory tier" in shown.stdout, shown.stdout + shown.stderr
    assert assert_same_final_state(tmp_path / "reference", run, U_MEMORY) > 10
    report = prove(run)
    assert report.ok and report.repeats == 0 and report.skipped == 0


SLURM2 = Path("/run/torchrelay-slurm2")  # .ci/slurm-2node-up.sh's base: pid files, and each node's scratch


def on_node(node: str, path: Path) -> Path:
    """`path` as node `node` of the two-node cluster sees it: through its slurmd's root, in the mount namespace
    where that node's scratch tmpfs is mounted (the host sees an empty folder there)."""
    pid = (SLURM2 / f"slurmd-{node}.pid").read_text().strip()
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd", f"{node}: pid {pid} is not its slurmd"
    return Path(f"/proc/{pid}/root") / path.relative_to("/")


def _held(root: Path, update: int, sub: str = "") -> bool:
    """Whether memory root `root` (as a node sees it) holds a complete `update`: its own part, or under `sub`
    (replica-node<n>) the replica of node n's."""
    return any(root.glob(f"*/*/{sub + '/' if sub else ''}checkpoint-{update}/COMPLETE.json"))


@pytest.mark.slurm
def test_a_two_node_requeue_resumes_from_memory_and_a_replacement_node_from_its_partners_replica(
    example: dict[str, Path], slurm_two: str, tmp_path: Path
) -> None:
    """Two nodes, one rank each, the memory tier in each node's own scratch (a tmpfs only that node sees), every
    part replicated to the partner. `scontrol requeue` while rank 0 hangs (the ranks SIGKILLed after KillWait):
    the job's next run, on the same nodes, resumes from the memory tier, each node its own part. Then n2 is lost
    (drained, its memory wiped) and the job requeued: it runs on n1 and the spare n3, n3 (node 1) empty-handed
    takes node 1's part from the replica n1 holds. The end is bit-exact, the ledger proved, each tier on record."""
    total = 12
    runtime = [
        *yaml.safe_load((REPO / "examples" / "lm.yaml").read_text())["runtime_params"],
        "hang_at_update",
    ]
    # the same path on each node, in the scratch tmpfs each node has of its own
    memory = SLURM2 / "scratch" / f"torchrelay-memory-{tmp_path.name}"

    def lm_yaml(path: Path, hang: int) -> Path:  # a runtime param: no bit changes
        return write_config(path, example["manifest"], example["root"], total_updates=total, save_every=4,
                            memory_every=1, async_save=True, runtime_params=runtime,
                            **{"params.hang_at_update": hang})  # fmt: skip

    config = lm_yaml(tmp_path / "lm.yaml", 7)  # durable checkpoints 4, 8, 12; memory ones in between
    run = tmp_path / "runs" / "lm"
    plan = write_plan(
        tmp_path / "plan.yaml",
        example["code"],
        config,
        run,
        smoke={"when": "never"},
        budget={"margin_s": 3.0, "startup_s": 5.0, "update_s": PACE + 0.05, "save_s": 0.5},
        # partition `spare`: n1 and n2, n3 only once one of them is out
        slurm={"time": "5", "job_name": "relay-replica", "max_requeues": 0, "partition": "spare"},
        train={
            "nnodes": 2,
            "nproc_per_node": 1,
            "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCHRELAY_MEMORY_ROOT": str(memory)},
        },
    )
    env = clean_env(SLURM_CONF=slurm_two)
    sub = subprocess.run(
        [*CLI, "sbatch", str(plan), "--submit"], capture_output=True, text=True, env=env, timeout=60
    )
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = re.search(r"submitted job (\d+)", sub.stdout).group(1)  # type: ignore[union-attr]
    log = tmp_path / "runs" / f"lm.slurm-{job}.out"
    reference = launch_bg(example["code"], tmp_path / "reference", config=lm_yaml(tmp_path / "ref.yaml", 0))
    t0 = time.time()

    def until(done: Any, what: str) -> None:
        while not done():
            state = job_state(job, env)
            assert state not in FINAL_STATES and time.time() - t0 < 300, (
                f"job {job} {state} before {what}:\n{log.read_text() if log.exists() else ''}"
            )
            time.sleep(0.2)

    def scontrol(*args: str) -> None:
        out = subprocess.run(["scontrol", *args], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr

    def saved(update: int) -> bool:
        """Both nodes hold their part of `update` and the partner's replica of it."""
        n1, n2 = on_node("n1", memory), on_node("n2", memory)
        return (_held(n1, update) and _held(n2, update) and _held(n1, update, "replica-node1")
                and _held(n2, update, "replica-node0"))  # fmt: skip

    state = "PENDING"
    try:
        # rank 0 hangs at update 7 once both nodes hold memory checkpoint-6 (durable: checkpoint-4)
        until(lambda: last_logged(run) == 6 and saved(6), "memory checkpoint-6 on n1 and n2")
        lm_yaml(config, 11)  # the next run hangs at 11
        scontrol("requeue", job)
        until(lambda: last_logged(run) == 10 and saved(10), "memory checkpoint-10 on n1 and n2")
        # n2 is lost: drained (the job's next run goes to n1 and the spare n3), its memory gone
        scontrol("update", "nodename=n2", "state=drain", "reason=torchrelay test: n2 lost")
        lm_yaml(config, 0)  # the last run finishes
        scontrol("requeue", job)
        until(lambda: job_state(job, env) == "PENDING", "the second requeue")
        shutil.rmtree(on_node("n2", memory))
        assert not _held(on_node("n3", memory), 10), "n3 held a part before it ever ran the job"
        while time.time() - t0 < 300 and state not in FINAL_STATES:
            state = job_state(job, env)
            time.sleep(0.2)
    finally:
        subprocess.run(["scancel", job], capture_output=True, env=env)
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], capture_output=True, env=env)
        for node in ("n1", "n2", "n3"):
            shutil.rmtree(on_node(node, memory), ignore_errors=True)
    text = log.read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text}"
    assert reference.wait(timeout=120) == 0, reference.stdout.read() if reference.stdout else ""

    assert "(restart 2) on n1" in text, text
    segs = segments(run)
    assert [s["ended"] for s in segs] == ["crash", "crash", "finished"], segs
    assert all(s["job"] == job for s in segs), segs
    hosts = [s["ranks_by_host"] for s in segs]
    assert hosts == [{"n1": [0], "n2": [1]}, {"n1": [0], "n2": [1]}, {"n1": [0], "n3": [1]}], hosts
    # the requeue on the same nodes: each node's own part, past the durable checkpoint-4
    assert (segs[1]["resumed_tier"], segs[1]["resumed_from"]) == ("memory", 6), segs[1]
    # the replacement: node 1's part from n1's replica of it, past the durable checkpoint-8, and said so
    assert (segs[2]["resumed_tier"], segs[2]["resumed_from"]) == ("replica", 10), segs[2]
    from_replica = "node 1's part of memory checkpoint-10 from its replica on n1 (node 0)"
    assert from_replica in segs[2]["notes"] and not any("replica" in n for n in segs[1]["notes"]), segs
    # each rank names what it loads: the parts assembled in its own node's memory (on n3: all sent by n1)
    for rank, update in ((0, 6), (1, 6), (0, 10), (1, 10)):
        tier = "memory" if update == 6 else "replica"
        said = (
            rf"\[rank {rank}\] resuming from the {tier} tier: {re.escape(str(memory))}/\S+/resume-{update}\n"
        )
        assert re.search(said, text), (said, text)
    shown = subprocess.run(
        [*CLI, "status", str(run)], capture_output=True, text=True, env=clean_env(COLUMNS="250")
    )
    table = " ".join(shown.stdout.replace("\u2502", " ").split())  # a note wrapped in its cell, read whole
    for line in ("resumed from the memory tier", "resumed from the replica tier", from_replica):
        assert line in table, shown.stdout + shown.stderr
    assert assert_same_final_state(tmp_path / "reference", run, total) > 10
    report = prove(run)
    assert report.ok and report.repeats == 0 and report.skipped == 0
