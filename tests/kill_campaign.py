"""The kill campaign: SIGKILL a whole 2-rank torchrun job (launcher, ranks, loader workers) at chosen moments,
resume each time, and judge every resume and every finished run against an uninterrupted one.

Shared by tests/test_kill_faults.py (a few kills) and benchmarks/bench_kill.py (hundreds; its docstring says where
the kills land and what each is judged on). Test support, not product code: it drives torchrun like a user's job.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import (
    clean_env,
    dump_stacks,
    exposures,
    metrics,
    segments,
    torchrun_cmd,
)
from torchrelay.checkpoint.commit import TMP_PREFIX
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.paths.layout import LOCK_FILES
from torchrelay.paths.lock import holder
from torchrelay.records.history import read_history
from torchrelay.util.proctree import Tree

CKPT = re.compile(r"^checkpoint-(\d+)$")
# Exit-2 errors of the library: a launch whose output names one of these was refused.
REFUSALS = (
    "ConfigError",
    "ContractMismatch",
    "IntegrityError",
    "UnsafeInput",
    "ForkRefused",
    "RunBusy",
    "refused",
)
PLANS = (("save", 0.72), ("update", 0.14), ("startup", 0.14))


# ---------------------------------------------------------------------------------------- watching a directory
class DirWatch:
    """Names added to / removed from one directory, from inotify (a polling diff where inotify is missing)."""

    _ADD, _REMOVE = 0x100 | 0x80, 0x200 | 0x40  # IN_CREATE|IN_MOVED_TO, IN_DELETE|IN_MOVED_FROM

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(path), self._ADD | self._REMOVE) >= 0:
                self.fd = fd
        except (OSError, AttributeError):
            pass
        self._names = set(os.listdir(path))

    def events(self, timeout: float) -> list[tuple[str, str]]:
        """[('add'|'remove', name)] seen within `timeout` seconds (returns early on the first events)."""
        if self.fd < 0:
            time.sleep(min(timeout, 0.002))
            now = set(os.listdir(self.path))
            out = [("add", n) for n in now - self._names] + [("remove", n) for n in self._names - now]
            self._names = now
            return out
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return []
        data = os.read(self.fd, 1 << 16)
        out, off = [], 0
        while off + 16 <= len(data):
            _wd, mask, _cookie, length = struct.unpack_from("iIII", data, off)
            name = data[off + 16 : off + 16 + length].rstrip(b"\0").decode(errors="replace")
            off += 16 + length
            out.append(("add" if mask & self._ADD else "remove", name))
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------------------------------- killing the job
def kill_job(tree: Tree, proc: subprocess.Popen[bytes]) -> list[str]:
    """SIGKILL the launcher and every rank with its loader workers at one moment; wait until all are gone.

    torchrun starts each rank in a session of its own, so a group kill would miss the ranks: every process the
    tree has seen is frozen first (SIGSTOP: nothing forks or writes any more), the tree collected again, then all
    are killed. Returns the /dev/shm files the frozen job had mapped (multiprocessing's named semaphores).
    """
    for _ in range(5):
        before = len(tree.seen)
        tree.send(signal.SIGSTOP)
        tree.collect()
        if len(tree.seen) == before:
            break
    shm: set[str] = set()
    for member in tree.alive():
        with contextlib.suppress(OSError):
            maps = Path(f"/proc/{member.pid}/maps").read_text()
            shm |= {line.split()[-1] for line in maps.splitlines() if " /dev/shm/" in line}
    tree.end()
    proc.wait()
    if survivors := tree.alive():
        raise RuntimeError(f"processes {[p.pid for p in survivors]} survived SIGKILL")
    return sorted(shm)


# ---------------------------------------------------------------------------------------- what a kill leaves
def temporaries(run_dir: Path) -> list[str]:
    """Every temporary in the run directory (two levels deep): what a crash leaves and a resume must clean."""
    out = []
    for base in [run_dir, run_dir / "train", run_dir / "data", *run_dir.glob("checkpoint-*")]:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            if name in LOCK_FILES:
                continue
            if name.startswith(".") or ".tmp" in name or name.endswith((".trim", ".partial")):
                out.append(str((base / name).relative_to(run_dir)))
    return sorted(out)


def _opened(run_dir: Path, before: int) -> bool:
    """The launch opened the run: it recorded a segment of its own (a refused launch records one that ended)."""
    history = read_history(run_dir)
    return len(history) > before and history[-1].get("ended") != "refused"


def newest_complete(run_dir: Path) -> int | None:
    done = [c.update for c in list_checkpoints(run_dir) if c.complete and not c.handed_off]
    return max(done) if done else None


@dataclass(slots=True)
class Kill:
    index: int
    run: str
    launch: int
    plan: str
    delay_s: float  # after the plan's trigger
    at_s: float  # since the launch started
    late_s: float = 0.0  # how late the freeze came after the planned moment (this loop's latency)
    inside_save: bool = False
    save_update: int | None = None  # the update whose save was interrupted
    save_phase: str = ""  # 'writing' (no inventory yet) or 'inventory written' (before the rename)
    committed: int | None = None  # newest complete checkpoint once all processes were dead
    run_created: bool = True  # the run's contract (written last when creating it) existed
    opened_before_kill: bool = False  # the killed launch had opened the run (its segment was recorded)
    left: list[str] = field(default_factory=list)  # temporaries present after the kill
    lock_held_after: bool = False
    shm_mapped: int = 0  # /dev/shm files the frozen job had mapped (multiprocessing's named semaphores)
    shm_left: int = 0  # ... that nobody removed: a host-level leak outside the run directory
    # judged on the next launch that opened the run
    resumed_from: int | None = None
    next_outcome: str = ""  # 'resumed', 'refused', 'failed'
    corrupt_resume: bool = False
    refusal: bool = False
    leftovers: list[str] = field(default_factory=list)
    # judged when the run ends
    bit_exact_end: bool | None = None


@dataclass(slots=True)
class RunEnd:
    run: str
    kills: int
    launches: int
    finished: bool
    tensors_equal: int = 0
    bit_exact: bool = False
    logs_equal: bool = False
    ledger_ok: bool = False
    ledger_exposures: int = 0
    temporaries_at_end: list[str] = field(default_factory=list)
    problem: str = ""


# ---------------------------------------------------------------------------------------- the campaign
class Campaign:
    """Kill launches of one config until `kills` kills are done and the last run has finished; judge everything."""

    def __init__(
        self,
        out: Path,
        code: Path,
        config: Path,
        *,
        sets: dict[str, Any] | None = None,
        seed: int = 0,
        plans: list[tuple[str, int, float]] | None = None,
        log: Any = print,
        launch_timeout: float = 300.0,
        baseline: Path | None = None,
    ) -> None:
        """`baseline`: an uninterrupted run of `config` to judge against; the kills' `sets` may differ from it only in
        runtime fields (save_every, num_workers: no bit changes). Without it the first `run` trains one."""
        self.out, self.code, self.config, self.sets = out, code, config, dict(sets or {})
        self.rng = random.Random(seed)
        self.fixed_plans = list(plans) if plans is not None else None  # (kind, nth, delay_s), for tests
        self.log = log
        self.launch_timeout = launch_timeout
        self.kills: list[Kill] = []
        self.ends: list[RunEnd] = []
        self.launches = 0
        self.save_s: list[float] = [0.15]
        self.startup_s: list[float] = [8.0]
        self.update_s: list[float] = [0.1]
        self.create_s: list[float] = [0.02]  # from data/ to resume_contract.json of a new run
        self.baseline = baseline
        self.total = int(segments(baseline)[-1]["last_update"]) if baseline is not None else 0
        self._pending: list[Kill] = []  # kills whose next opening launch has not come yet
        self._stale: set[str] = set()  # temporaries left by earlier kills, not yet cleaned

    # ------------------------------------------------------------------ plans
    def _plan(self, first_of_run: bool) -> tuple[str, int, float] | None:
        if self.fixed_plans is not None:
            return self.fixed_plans.pop(0) if self.fixed_plans else None
        if first_of_run and self.rng.random() < 0.4:
            return ("create", 1, self.rng.uniform(0.0, 1.1 * statistics.median(self.create_s)))
        kind = self.rng.choices([k for k, _ in PLANS], [w for _, w in PLANS])[0]
        nth = self.rng.choice((1, 1, 2, 3, 4))
        if kind == "save":
            return (kind, nth, self.rng.uniform(0.0, 1.1 * statistics.median(self.save_s)))
        if kind == "update":
            return (kind, nth, self.rng.uniform(0.0, statistics.median(self.update_s)))
        return (kind, 1, self.rng.uniform(0.0, 1.1 * statistics.median(self.startup_s)))

    # ------------------------------------------------------------------ one launch
    def _launch(self, run: Path, plan: tuple[str, int, float] | None) -> tuple[int | None, Kill | None]:
        """Start the launch, kill it as planned; (exit code or None when killed, the kill)."""
        self.launches += 1
        n = self.launches
        logfile = self.out / "logs" / f"launch-{n:04d}.txt"
        logfile.parent.mkdir(parents=True, exist_ok=True)
        before = len(read_history(run))
        watch = DirWatch(run)
        tmp_seen: dict[str, float] = {}
        n_tmp = n_commit = 0
        opened = False
        last_commit_t: float | None = None
        data_t: float | None = None
        target: float | None = None
        t0 = time.monotonic()
        if plan and plan[0] == "startup":
            target = t0 + plan[2]
        with open(logfile, "wb") as logf:
            proc = subprocess.Popen(
                torchrun_cmd(self.code, run, config=self.config, sets=self.sets),
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=clean_env(),
                cwd=self.code,
                start_new_session=True,
            )
            killed = False
            late = 0.0
            tree = Tree(proc.pid)
            collected = t0
            shm: list[str] = []
            try:
                while True:
                    now = time.monotonic()
                    if target is not None and now >= target:
                        late = now - target
                        shm = kill_job(tree, proc)
                        killed = True
                        break
                    if proc.poll() is not None:
                        break
                    if now - t0 > self.launch_timeout:
                        logf.write(dump_stacks(tree).encode())
                        logf.flush()
                        kill_job(tree, proc)
                        tail = logfile.read_text(errors="replace")[-20000:]
                        raise RuntimeError(f"launch {n} ran past {self.launch_timeout} s; {logfile}:\n{tail}")
                    if now - collected > 1.0:  # known members are frozen at once when the kill comes
                        tree.collect()
                        collected = now
                    wait = 0.05 if target is None else min(0.05, target - now)
                    for kind, name in watch.events(wait):
                        now = time.monotonic()
                        if kind == "add" and name.startswith(TMP_PREFIX):
                            tmp_seen[name] = now
                            n_tmp += 1
                            if n_tmp == 1:
                                self.startup_s.append(now - t0)
                            if plan and plan[0] == "save" and n_tmp == plan[1] and target is None:
                                target = now + plan[2]
                        elif kind == "add" and (m := CKPT.match(name)):
                            started = [t for k, t in tmp_seen.items() if k.startswith(f"{TMP_PREFIX}{m[1]}-")]
                            if started:
                                self.save_s.append(now - started[-1])
                            if last_commit_t is not None:
                                self.update_s.append(now - last_commit_t)
                            last_commit_t = now
                            n_commit += 1
                            if plan and plan[0] == "update" and n_commit == plan[1] and target is None:
                                target = now + plan[2]
                        elif kind == "add" and name == "data":
                            data_t = now
                            if plan and plan[0] == "create":
                                target = now + plan[2]
                        elif kind == "add" and name == "resume_contract.json" and data_t is not None:
                            self.create_s.append(now - data_t)
                            data_t = None
                        elif (
                            kind == "add" and name == "history.jsonl" and not opened and _opened(run, before)
                        ):
                            opened = True
                            self._judge_open(run)
            finally:
                watch.close()
                if proc.poll() is None:
                    kill_job(tree, proc)
        if not opened and _opened(run, before):
            opened = True
            self._judge_open(run)
        if not killed:
            return proc.returncode, None
        assert plan is not None
        kill = Kill(
            index=len(self.kills),
            run=run.name,
            launch=n,
            plan=plan[0],
            delay_s=round(plan[2], 4),
            at_s=round(time.monotonic() - t0, 3),
            opened_before_kill=opened,
        )
        left = temporaries(run)
        fresh = [x for x in left if x.startswith(TMP_PREFIX) and x not in self._stale]
        if fresh:
            kill.inside_save = True
            kill.save_update = int(fresh[0][len(TMP_PREFIX) :].split("-")[0])
            kill.save_phase = (
                "inventory written" if (run / fresh[0] / "COMPLETE.json").exists() else "writing"
            )
        kill.committed = newest_complete(run)
        kill.run_created = (run / "resume_contract.json").exists()
        kill.left = left
        kill.lock_held_after = holder(run, "train") is not None
        kill.late_s = round(late, 4)
        kill.shm_mapped = len(shm)
        kill.shm_left = sum(1 for x in shm if os.path.exists(x))
        self._stale |= set(left)
        self.kills.append(kill)
        self._pending.append(kill)
        logfile.unlink()
        return None, kill

    def _judge_open(self, run: Path) -> None:
        """A launch opened the run: judge the pending kills against what it did."""
        seg = read_history(run)[-1]
        still = set(temporaries(run))
        for kill in self._pending:
            kill.resumed_from = seg.get("resumed_from")
            kill.next_outcome = "resumed"
            kill.corrupt_resume = kill.resumed_from != kill.committed
            kill.leftovers = sorted(x for x in kill.left if x in still)
            if kill.lock_held_after:
                kill.leftovers.append("lock held after every process died")
        self._pending = []
        self._stale &= still

    def _fail_pending(self, run: Path, code: int | None, n: int) -> str:
        text = (self.out / "logs" / f"launch-{n:04d}.txt").read_text(errors="replace")
        # A rank's exit 2 is a refusal; torchrun reports it as its own exit 1, naming the rank's code.
        refused = (
            code == 2 or bool(re.search(r"exitcode\s*:\s*2\b", text)) or any(w in text for w in REFUSALS)
        )
        for kill in self._pending:
            kill.next_outcome = "refused" if refused else "failed"
            kill.refusal = refused
            kill.corrupt_resume = not refused
        self._pending = []
        return f"launch {n} of {run.name} exited {code} ({'refused' if refused else 'failed'}); log kept"

    # ------------------------------------------------------------------ runs
    def make_baseline(self) -> Path:
        base = self.out / "baseline"
        if base.exists():
            shutil.rmtree(base)
        out = subprocess.run(
            torchrun_cmd(self.code, base, config=self.config, sets=self.sets),
            capture_output=True,
            text=True,
            env=clean_env(),
            cwd=self.code,
            timeout=self.launch_timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"the uninterrupted run failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        self.baseline = base
        self.total = int(segments(base)[-1]["last_update"])
        return base

    def run(self, kills: int) -> None:
        """Kill until `kills` kills are recorded, then let the last run finish."""
        if self.baseline is None:
            self.make_baseline()
        number = 0
        while len(self.kills) < kills and (self.fixed_plans is None or self.fixed_plans):
            number += 1
            run = self.out / f"run-{number:03d}"
            if run.exists():
                shutil.rmtree(run)
            run.mkdir(parents=True)
            self._one_run(run, kills)

    def _one_run(self, run: Path, kills: int) -> None:
        first_launch, first_kill = self.launches + 1, len(self.kills)
        while True:
            want_kill = len(self.kills) < kills
            plan = self._plan(first_of_run=self.launches + 1 == first_launch) if want_kill else None
            code, kill = self._launch(run, plan)
            if kill is not None:
                self.log(
                    f"kill {kill.index + 1:>3}/{kills} {run.name} launch {kill.launch} {kill.plan:<7} "
                    f"+{kill.delay_s:.3f}s at {kill.at_s:6.2f}s "
                    + (
                        f"inside save {kill.save_update} ({kill.save_phase})"
                        if kill.inside_save
                        else "outside a save"
                    )
                    + f", newest complete {kill.committed}"
                )
                continue
            mine = self.kills[first_kill:]
            end = RunEnd(run.name, len(mine), self.launches - first_launch + 1, finished=code == 0)
            if code != 0:
                end.problem = self._fail_pending(run, code, self.launches)
            else:
                (self.out / "logs" / f"launch-{self.launches:04d}.txt").unlink()
                self._judge_end(run, end)
            for k in mine:
                k.bit_exact_end = end.bit_exact
            self.ends.append(end)
            self.log(
                f"run {run.name}: {end.kills} kills over {end.launches} launches, "
                + (
                    f"bit-exact {end.bit_exact} ({end.tensors_equal} tensors), ledger {end.ledger_ok}"
                    if end.finished
                    else end.problem
                )
            )
            return

    def _judge_end(self, run: Path, end: RunEnd) -> None:
        from torch import equal

        from torchrelay.checkpoint.reader import load_tensors
        from torchrelay.ledger.exposure import prove

        assert self.baseline is not None
        total = self.total
        a = load_tensors(self.baseline / f"checkpoint-{total}")
        b = load_tensors(run / f"checkpoint-{total}")
        same = a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        end.tensors_equal = sum(1 for k in a if k in b and equal(a[k], b[k]))
        end.bit_exact = bool(same)
        end.logs_equal = all(
            metrics(self.baseline, r) == metrics(run, r) and exposures(self.baseline, r) == exposures(run, r)
            for r in (0, 1)
        )
        rep = prove(run)
        base_rep = prove(self.baseline)
        end.ledger_exposures = rep.exposures
        end.ledger_ok = rep.ok and rep.updates == total and rep.exposures == base_rep.exposures
        end.temporaries_at_end = temporaries(run)
        if holder(run, "train") is not None:
            end.temporaries_at_end.append("lock held")
        if not (end.bit_exact and end.logs_equal and end.ledger_ok):
            end.problem = f"not exact: tensors {same}, logs {end.logs_equal}, ledger {rep.to_dict()}"

    # ------------------------------------------------------------------ figures
    def summary(self) -> dict[str, Any]:
        k = self.kills
        return {
            "kills": len(k),
            "inside_save": sum(x.inside_save for x in k),
            "inside_save_phase": dict(Counter(x.save_phase for x in k if x.inside_save)),
            "plans": dict(Counter(x.plan for x in k)),
            "before_open": sum(not x.opened_before_kill for x in k),
            "creation_interrupted": sum(not x.run_created for x in k),
            "resumed_from_newest_complete": sum(
                x.next_outcome == "resumed" and not x.corrupt_resume for x in k
            ),
            "resumed_behind_interrupted_save": sum(
                x.inside_save and x.resumed_from is not None and x.resumed_from == (x.save_update or 0) - 1
                for x in k
            ),
            "corrupt_resumes": sum(x.corrupt_resume for x in k)
            + sum(not e.bit_exact for e in self.ends if e.finished),
            "refusals": sum(x.refusal for x in k),
            "leftovers": sum(bool(x.leftovers) for x in k)
            + sum(bool(e.temporaries_at_end) for e in self.ends),
            "temporaries_cleaned": sum(len(x.left) - len(x.leftovers) for x in k),
            "shm_left": sum(x.shm_left for x in k),
            "median_save_s": round(statistics.median(self.save_s), 4),
            "median_late_ms": round(1000 * statistics.median([x.late_s for x in k] or [0.0]), 2),
            "runs": len(self.ends),
            "runs_finished": sum(e.finished for e in self.ends),
            "runs_bit_exact": sum(e.bit_exact and e.logs_equal for e in self.ends),
            "runs_ledger_ok": sum(e.ledger_ok for e in self.ends),
            "launches": self.launches,
        }
