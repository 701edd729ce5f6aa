"""Preflight: everything that can refuse a launch before a GPU-hour is spent.

Built in: the resume contract against the run directory (the trainer's own `validate_resume`), free disk for the
next K checkpoints (size measured from the newest COMPLETE.json, or the smoke's), the data manifest's files, the
installed versions the contract pins, and where the node-local caches point (a warning, never a refusal). Then the
plan's own checks: shell commands that must exit 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import getpass
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.commit import stale_bytes
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.config.relay import stored_config
from torchrelay.controller.plan import CheckSpec, Plan
from torchrelay.errors import EXIT_REFUSED, RelayError
from torchrelay.identity import find_code_dir, tree_note
from torchrelay.manifest import Manifest
from torchrelay.paths.rundir import RunDir
from torchrelay.util import proctree

GIB = 1024**3
OUTPUT_LINES = 30  # lines of a failed check's output shown in the message


class PreflightFailed(RelayError):
    """A preflight check failed; nothing was started."""

    exit_code = EXIT_REFUSED


@dataclass(slots=True)
class CheckResult:
    name: str
    ok: bool
    detail: str
    skipped: bool = False
    warning: bool = False  # passed, but with something the user should change (nothing was refused)


@dataclass(slots=True)
class PreflightReport:
    results: list[CheckResult] = field(default_factory=list)

    def add(self, name: str, detail: str, *, skipped: bool = False, warning: bool = False) -> None:
        self.results.append(CheckResult(name, True, detail, skipped, warning))

    def to_list(self) -> list[dict[str, Any]]:
        return [
            {"name": r.name, "ok": r.ok, "skipped": r.skipped, "warning": r.warning, "detail": r.detail}
            for r in self.results
        ]


def checkpoint_bytes(run: RunDir) -> int:
    """Size of the newest complete checkpoint (sum of its COMPLETE.json sizes), 0 when there is none."""
    complete = [c for c in list_checkpoints(run) if c.complete]
    return complete[-1].size if complete else 0


def check_disk(path: Path, ckpt_bytes: int, ahead: int, report: PreflightReport) -> None:
    """Refuse when the file system of `path` cannot hold `ahead` more checkpoints of `ckpt_bytes`."""
    if ahead == 0 or ckpt_bytes == 0:
        report.add("disk", "checkpoint size not known yet", skipped=True)
        return
    probe = path
    while not probe.exists():
        probe = probe.parent
    # what the run's next start removes (a killed segment's spare, a killed save's temporary) is room too
    stale = stale_bytes(path) if probe == path else 0
    free = shutil.disk_usage(probe).free + stale
    need = ckpt_bytes * ahead
    freed = f" (with {stale / GIB:.2f} GiB the start removes)" if stale else ""
    detail = f"{free / GIB:.2f} GiB free on {probe}{freed}, {ahead} checkpoint(s) of {ckpt_bytes / GIB:.3f} GiB need {need / GIB:.2f} GiB"
    if free < need:
        raise PreflightFailed(
            f"preflight check 'disk' failed: {detail}",
            hint="free disk space, lower preflight.checkpoints_ahead, or move the run directory",
        )
    report.add("disk", detail)


def check_manifest(manifest: Path | Manifest, data_root: str, report: PreflightReport) -> None:
    """Every file the manifest names under `data_root` exists. A run's copy comes read (the resume's check found
    the root it is written under): its files are checked re-pointed at `data_root`, where the launch re-points it
    (a plan's train.overrides.data_root; under the copy's own root they were not checked at all)."""
    m = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest, data_root)
    missing = m.check_files(data_root)
    if missing:
        shown = "\n".join(f"  {p}" for p in missing[:10])
        more = f"\n  ... and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise PreflightFailed(
            f"preflight check 'manifest' failed: {len(missing)} of the files {m.path} names do not exist "
            f"(data_root {data_root!r}):\n{shown}{more}",
            hint="fix data_root (a runtime override) or restore the data",
        )
    count = sum(1 for _ in m.paths(data_root))
    report.add("manifest", f"{len(m)} samples, {count} file(s) under {data_root or '(no data root)'} present")


def check_pins(pins: list[str], python: str, report: PreflightReport) -> None:
    """The training interpreter must have exactly the pinned versions."""
    if not pins:
        report.add("versions", "the contract pins no packages", skipped=True)
        return
    code = (
        "import json, sys\n"
        "from importlib import metadata\n"
        "out = {}\n"
        "for pin in json.loads(sys.argv[1]):\n"
        "    name = pin.split('==', 1)[0].strip()\n"
        "    try:\n"
        "        out[pin] = metadata.version(name)\n"
        "    except metadata.PackageNotFoundError:\n"
        "        out[pin] = 'not installed'\n"
        "print(json.dumps(out))\n"
    )
    proc = proctree.run(
        [python, "-c", code, json.dumps(pins)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise PreflightFailed(
            f"preflight check 'versions' failed: {python} could not report versions:\n{proc.stderr}"
        )
    have = json.loads(proc.stdout)
    wrong = [(pin, have.get(pin)) for pin in pins if pin.split("==", 1)[1].strip() != have.get(pin)]
    if wrong:
        lines = "\n".join(f"  {pin}: installed {got}" for pin, got in wrong)
        raise PreflightFailed(
            f"preflight check 'versions' failed: the contract pins versions {python} does not have:\n{lines}",
            hint="install the pinned versions in the training environment (plan train.python)",
        )
    report.add("versions", ", ".join(f"{p} ok" for p in pins))


# statfs(2) f_type of file systems that other machines share: a cache or temporary directory there is written by
# every node at once (linux/magic.h and the file systems' own headers).
SHARED_FS_MAGIC = {
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x00C36400: "ceph",
    0x5346414F: "afs",
    0x6B414653: "afs",
    0x73757245: "coda",
    0x01021997: "9p",
    0x19830326: "beegfs",
    0x7461636F: "ocfs2",
    0x01161970: "gfs2",
    0xAAD7AAEA: "panfs",
    0x20030528: "orangefs",
    0x65735546: "fuse",  # sshfs, s3fs, juicefs, virtiofs, weka's client ...: could be anything, assume shared
}
# /proc/self/mountinfo names of the same (and those whose magic is not public, e.g. WekaFS)
SHARED_FS_NAMES = frozenset(
    {"nfs", "nfs4", "smb3", "cifs", "lustre", "gpfs", "ceph", "afs", "coda", "9p", "beegfs", "ocfs2", "gfs2",
     "panfs", "pvfs2", "orangefs", "wekafs", "glusterfs", "virtiofs", "fuse"}
)  # fmt: skip
# Where compile caches and temporaries go; each is written by every rank (tmp + rename), which a shared file system
# makes racy (the LingBot card: transient FileNotFoundError on WekaFS).
CACHE_VARS = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@dataclass(frozen=True, slots=True)
class FileSystem:
    """The file system a path lies on: statfs's magic, the mount table's type name and mount point, its device."""

    path: Path  # the nearest existing ancestor that was looked at
    magic: int | None
    name: str  # mountinfo's type ("ext4", "nfs4", "fuse.sshfs"), else the magic's name, else "?"
    mount_point: str
    device: int

    @property
    def shared(self) -> bool:
        """True for a network or cluster file system (one other machines may mount too)."""
        base = self.name.split(".", 1)[0]
        return base in SHARED_FS_NAMES or (self.magic is not None and self.magic in SHARED_FS_MAGIC)


def _statfs_magic(path: Path) -> int | None:
    """statfs(2)'s f_type (the first field of struct statfs on Linux), or None where it cannot be asked."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _mount_of(path: Path, mountinfo: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount holding `path`: the longest mount point above it."""
    best = ("/", "?")
    text = str(path)
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        inside = text == point or text.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, tail[0])
    return best


def filesystem_of(path: str | os.PathLike[str], mountinfo: str | None = None) -> FileSystem:
    """The file system that holds `path`, or would hold it (a path not created yet: its nearest existing parent)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    probe = probe.resolve()
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            mountinfo = ""
    point, name = _mount_of(probe, mountinfo)
    magic = _statfs_magic(probe)
    if name == "?" and magic is not None:
        name = SHARED_FS_MAGIC.get(magic, f"0x{magic:x}")
    return FileSystem(probe, magic, name, point, probe.stat().st_dev)


def cache_locations(env: dict[str, str]) -> list[tuple[str, str, str]]:
    """(variable, path, how it was found) for each node-local cache, from the training environment."""
    tmp = env.get("TMPDIR") or "/tmp"
    user = env.get("USER") or env.get("LOGNAME") or _user()
    home = env.get("HOME") or os.path.expanduser("~")
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tmp, f"torchinductor_{user}")
    return [
        ("TMPDIR", tmp, "set" if env.get("TMPDIR") else "unset: /tmp"),
        (
            "TORCHINDUCTOR_CACHE_DIR",
            inductor,
            "set" if env.get("TORCHINDUCTOR_CACHE_DIR") else "unset: torch.compile's default under TMPDIR",
        ),
        (
            "TRITON_CACHE_DIR",
            env.get("TRITON_CACHE_DIR") or os.path.join(env.get("TRITON_HOME") or home, ".triton", "cache"),
            "set"
            if env.get("TRITON_CACHE_DIR")
            else "unset: Triton's default under $HOME (torch.compile puts its own under its cache)",
        ),
    ]


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        return str(os.getuid())


def check_node_local(
    run_dir: Path, env: dict[str, str], nnodes: int, report: PreflightReport, mountinfo: str | None = None
) -> None:
    """Warn when a compile cache or TMPDIR lies on a shared file system, or on the run directory's when that one is
    shared by several nodes: every rank writes there at once (tmp + rename), which shared file systems make racy."""
    run_fs = filesystem_of(run_dir, mountinfo)
    run_shared = nnodes > 1 or run_fs.shared
    warned: list[str] = []
    fine: list[str] = []
    for var, path, how in cache_locations(env):
        fs = filesystem_of(path, mountinfo)
        where = f"{var}={path} ({how}) is on {fs.name} at {fs.mount_point}"
        if fs.shared:
            warned.append(f"{where}, a shared file system")
        elif fs.device == run_fs.device and run_shared:
            why = f"{nnodes} nodes share it" if nnodes > 1 else f"{run_fs.name} is shared"
            warned.append(f"{where}, the run directory's file system ({why})")
        else:
            fine.append(f"{var} on {fs.name} ({fs.mount_point})")
    if warned:
        report.add(
            "node-local caches",
            "; ".join(warned)
            + ". Ranks writing compile caches or temporaries there at once can fail transiently "
            "(FileNotFoundError after another rank's rename): set these in train.env to a node-local disk or "
            "tmpfs (the job's local scratch, /tmp or /dev/shm where those are local)",
            warning=True,
        )
    else:
        report.add("node-local caches", ", ".join(fine))


def check_contract(plan: Plan, report: PreflightReport) -> tuple[dict[str, Any], Manifest] | None:
    """Run the trainer's own resume validation; returns the stored config (with the plan's overrides) and the
    run's manifest as the check read it, when the run exists."""
    from torchrelay.checkpoint.resume_check import (
        validate_resume,  # imports torch: only when there is a run to check
    )

    rd = plan.run
    if not rd.exists():
        report.add("contract", f"{rd.path} holds no run yet: the formal run creates it", skipped=True)
        return None
    cfg = stored_config(rd)
    if plan.train.overrides:
        cfg = cfg.with_overrides(plan.train.overrides)
    script = str(plan.work_path / plan.train.script)
    code_dir = find_code_dir(script)
    # Sizes only: the ranks hash every checkpoint file themselves when they open the run; hashing a 70 GiB
    # checkpoint twice would cost minutes of the allocation. The script is part of the code whether git tracks
    # it or not; the modules it imports are the run's recorded ones (the ranks check what they import).
    check = validate_resume(
        rd.path,
        cfg,
        plan.train.world_size,
        code_dir,
        deep=False,
        code_files=[script],
        reshard=plan.train.reshard,
    )
    report.add("contract", "; ".join(check.passed))
    note = tree_note(check.code_changes, commit=check.recorded["fields"].get("code.commit") is not None)
    if note:
        report.add("code", note, warning=True)
    return cfg.to_dict(), check.manifest


def run_user_check(check: CheckSpec, cwd: Path, env: dict[str, str], report: PreflightReport) -> None:
    """A user check passes when its command exits 0; otherwise its output is the message."""
    try:
        proc = proctree.run(  # a timeout ends what the check's shell started too
            check.run,
            shell=True,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=check.timeout_s,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        raise PreflightFailed(
            f"preflight check {check.name!r} timed out after {check.timeout_s:.0f}s ({check.run}):\n{_last(out)}",
            hint=f"fix the check, or raise preflight.checks[{check.name}].timeout_s",
        ) from exc
    if proc.returncode != 0:
        raise PreflightFailed(
            f"preflight check {check.name!r} failed with exit code {proc.returncode} ({check.run}); "
            f"its output:\n{_last(proc.stdout)}",
            hint="no training was started; fix what the check reports and launch again",
        )
    report.add(check.name, f"exit 0 ({check.run})")


def _last(text: str) -> str:
    lines = (text or "").rstrip().splitlines()
    shown = lines[-OUTPUT_LINES:]
    prefix = [f"  ... {len(lines) - len(shown)} earlier line(s)"] if len(lines) > len(shown) else []
    return "\n".join(prefix + [f"  | {line}" for line in shown]) if lines else "  (no output)"


def run_preflight(
    plan: Plan, env: dict[str, str], on_result: Callable[[CheckResult], None] = lambda r: None
) -> PreflightReport:
    """Every check in order; the first failure raises PreflightFailed naming it."""
    report = PreflightReport()

    def step(fn: Callable[..., Any], *args: Any) -> Any:
        before = len(report.results)
        out = fn(*args, report)
        for result in report.results[before:]:
            on_result(result)
        return out

    resumed = step(check_contract, plan)
    step(check_disk, plan.run_path, checkpoint_bytes(plan.run), plan.preflight.checkpoints_ahead)
    step(check_node_local, plan.run_path, env, plan.train.nnodes)
    if resumed is not None:
        stored, manifest = resumed
        step(check_manifest, manifest, stored.get("data_root", ""))
        step(check_pins, list(stored.get("pins", [])), plan.train.python)
    elif plan.preflight.manifest:
        step(check_manifest, Path(plan.preflight.manifest), plan.preflight.data_root)
    for check in plan.preflight.checks:
        step(run_user_check, check, plan.work_path, env)
    return report


def process_started() -> float:
    """The unix time this process started (the `--budget` of `torchrelay launch` counts from it)."""
    import psutil

    try:
        return float(psutil.Process().create_time())
    except (psutil.Error, OSError):  # no /proc: the budget counts from now
        return time.time()


def visible_devices() -> int | None:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES applied), or None without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else None
