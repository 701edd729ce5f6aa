"""Several nodes: where the node-local caches point (preflight), and a real 2-node torchrun on this machine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_controller import launch_cli, outcome_of, write_plan
from torchrelay.controller.preflight import PreflightReport, check_node_local, filesystem_of

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
