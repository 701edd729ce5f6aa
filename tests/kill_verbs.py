"""Kills of the verbs that write: SIGKILL `pack`, `prepare`, `validate` and `export` (each a real process, with
every process it started) at random moments while it writes, then run the same command again and judge it.

    PYTHONPATH=src:tests python benchmarks/bench_kill.py --verbs 20 --seed 1 --out /tmp/bench-kill-verbs

A kill lands a random delay after the verb's first write appears (its temporary output, or the validation folder),
within how long the uninterrupted command wrote for. The next command (the same one, as a batch script repeats
it) must complete, or refuse in one line when the killed one had already finished its work (a pack whose bundle
got its SHA256SUMS: the checkpoint is handed off, and that bundle verifies); what it leaves must pass its own
check (`verify` of a bundle, the prepared directory's trainer validation, the export's SHA256SUMS, every
validation record complete) and no temporary of the killed command may remain. An export killed after its rename
had finished too: the same command refuses to overwrite the folder, whose SHA256SUMS must check.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.util.proctree import Tree

VERBS = ("pack", "prepare", "validate", "export")
ATTEMPTS = 3  # moments tried for each kill until one lands while the command is still writing
# The validation command: a little work, then its metrics (what a user's eval script does, cheaply).
METRICS_CMD = (
    f'{sys.executable} -c "import json, sys, time; time.sleep(0.3); '
    "json.dump({'loss': 1.0}, open(sys.argv[1], 'w'))\" {metrics}"
)


@dataclass(slots=True)
class VerbKill:
    verb: str
    index: int
    delay_s: float  # after the first write appeared
    killed_while_writing: bool = False  # the command was still running when the kill came
    left: list[str] = field(default_factory=list)  # temporaries present after the kill
    next_rc: int | None = None
    next_line: str = ""  # the next command's last line
    output_ok: bool = False  # what the next command left passes its check
    leftovers: list[str] = field(default_factory=list)  # temporaries after the next command
    problem: str = ""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchrelay", *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRELAY_", "SLURM_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), check=False)


def _temporaries(*folders: Path) -> list[str]:
    """Temporaries of the verbs (and of atomic writes) in these folders and one level below."""
    out = []
    for folder in folders:
        for path in [folder, *(p for p in folder.glob("*") if p.is_dir() and not p.is_symlink())]:
            try:
                names = os.listdir(path)
            except OSError:
                continue
            out += [str(path / n) for n in names if "-tmp-" in n or ".tmp-" in n or n.endswith(".partial")]
    return sorted(out)


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP every process the command started, then SIGKILL them all at one moment (a job ended by its
    scheduler); waits until all are gone."""
    tree = Tree(proc.pid)
    for _ in range(5):
        before = len(tree.seen)
        tree.send(signal.SIGSTOP)  # nothing forks or writes any more
        tree.collect()
        if len(tree.seen) == before:
            break
    tree.end()
    proc.wait()


@dataclass(slots=True)
class _Verb:
    """One verb: its command for kill k, where its first write appears, and how to judge what is left."""

    name: str
    command: Callable[[int], list[str]]
    writing: Callable[[int], bool]  # its first write is on disk
    written: Callable[[int], bool]  # its output is whole (what follows is bookkeeping and the process's exit)
    folders: Callable[[int], list[Path]]  # where its temporaries would lie
    judge: Callable[[int, subprocess.CompletedProcess[str]], str]  # "" when fine, else the problem


class VerbCampaign:
    """Kill each verb `kills` times on copies of one finished run (`run`, trained by `code`), judge every kill."""

    def __init__(
        self,
        out: Path,
        run: Path,
        code: Path,
        *,
        seed: int = 1,
        log: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.out, self.source_run, self.rng, self.log = out, run, random.Random(seed), log
        self.kills: list[VerbKill] = []
        self.writing_s: dict[str, float] = {}
        out.mkdir(parents=True, exist_ok=True)
        self.bundle = out / "bundle"  # a whole bundle for prepare, packed from a copy of the run
        source = out / "bundle-source"
        shutil.copytree(run, source)
        self.code = code
        made = _run(_cli("pack", str(source), str(self.bundle), "--code-dir", str(code)))
        if made.returncode != 0:
            raise RuntimeError(f"pack of {source} failed: {made.stderr[-2000:]}")

    def _verbs(self) -> dict[str, _Verb]:
        o = self.out

        def copy_run(k: int, verb: str) -> Path:
            path = o / f"{verb}-{k}" / "run"
            if not path.exists():
                shutil.copytree(self.source_run, path)
            return path

        def pack_judge(k: int, done: subprocess.CompletedProcess[str]) -> str:
            bundle = o / f"pack-{k}" / "bundle"
            if done.returncode != 0 and "already handed off" not in done.stderr:
                return f"pack again: exit {done.returncode}: {done.stderr.strip()[-300:]}"
            verified = _run(_cli("verify", str(bundle)))
            return "" if verified.returncode == 0 else f"verify of the bundle: {verified.stdout[-300:]}"

        def prepare_judge(k: int, done: subprocess.CompletedProcess[str]) -> str:
            if done.returncode != 0 or "PREPARE_OK" not in done.stdout:
                return f"prepare again: exit {done.returncode}: {done.stderr.strip()[-300:]}"
            # a prepare the kill had let finish re-checks the directory with the trainer's own validation
            return ""

        def validate_judge(k: int, done: subprocess.CompletedProcess[str]) -> str:
            if done.returncode != 0:
                return f"validate again: exit {done.returncode}: {done.stderr.strip()[-300:]}"
            run = o / f"validate-{k}" / "run"
            records = sorted((run / "validation").glob("*/record.json"))
            checkpoints = [p for p in run.glob("checkpoint-*") if (p / "COMPLETE.json").is_file()]
            if len(records) != len(checkpoints):
                return f"{len(records)} records for {len(checkpoints)} checkpoints"
            for path in records:
                doc = json.loads(path.read_text())
                metrics = json.loads((path.parent / "metrics.json").read_text())
                if doc.get("status") != "ok" or doc.get("metrics") != metrics:
                    return f"{path}: status {doc.get('status')!r}, metrics {doc.get('metrics')!r}"
            shown = _run(_cli("status", str(run)))
            return "" if shown.returncode == 0 else f"status: {shown.stderr[-300:]}"

        def export_judge(k: int, done: subprocess.CompletedProcess[str]) -> str:
            # killed after its rename, the export had finished: the same command refuses to overwrite it
            if done.returncode != 0 and "already exists and is not empty" not in done.stderr:
                return f"export again: exit {done.returncode}: {done.stderr.strip()[-300:]}"
            sums = subprocess.run(
                ["sha256sum", "-c", "--quiet", "SHA256SUMS"],
                cwd=o / f"export-{k}" / "weights",
                capture_output=True,
                text=True,
                check=False,
            )
            return "" if sums.returncode == 0 else f"sha256sum -c: {sums.stdout[-300:]}"

        def some(folder: Path, pattern: str) -> bool:
            return any(folder.glob(pattern))

        return {
            "pack": _Verb(
                "pack",
                lambda k: _cli(
                    "pack",
                    str(copy_run(k, "pack")),
                    str(o / f"pack-{k}" / "bundle"),
                    "--code-dir",
                    str(self.code),
                ),
                lambda k: (
                    some(o / f"pack-{k}", ".bundle.pack-tmp-*") or (o / f"pack-{k}" / "bundle").exists()
                ),
                lambda k: (o / f"pack-{k}" / "bundle" / "SHA256SUMS").exists(),
                lambda k: [o / f"pack-{k}", o / f"pack-{k}" / "run"],
                pack_judge,
            ),
            "prepare": _Verb(
                "prepare",
                lambda k: _cli("prepare", str(self.bundle), "--run-dir", str(o / f"prepare-{k}" / "dir")),
                lambda k: (
                    some(o / f"prepare-{k}", ".dir.prepare-tmp-*") or (o / f"prepare-{k}" / "dir").exists()
                ),
                lambda k: (o / f"prepare-{k}" / "dir" / "REBASE_RECORD.json").exists(),
                lambda k: [o / f"prepare-{k}"],
                prepare_judge,
            ),
            "validate": _Verb(
                "validate",
                lambda k: _cli("validate", str(copy_run(k, "validate")), "--cmd", METRICS_CMD),
                lambda k: (o / f"validate-{k}" / "run" / "validation").exists(),
                lambda k: (o / f"validate-{k}" / "run" / "validation" / "pending.json").exists(),
                lambda k: [o / f"validate-{k}" / "run", o / f"validate-{k}" / "run" / "validation"],
                validate_judge,
            ),
            "export": _Verb(
                "export",
                lambda k: _cli("export", str(self.source_run), str(o / f"export-{k}" / "weights")),
                lambda k: (
                    some(o / f"export-{k}", ".weights.export-tmp-*")
                    or (o / f"export-{k}" / "weights").exists()
                ),
                lambda k: (o / f"export-{k}" / "weights").exists(),
                lambda k: [o / f"export-{k}"],
                export_judge,
            ),
        }

    def _one(self, verb: _Verb, k: int, *, kill: bool, within: float = 1.0) -> tuple[float, VerbKill]:
        """Start the command, kill it a random moment into its writing, within `within` of how long the
        reference wrote for (kill=False: let it finish and time the writing); returns (seconds it wrote for, the
        kill)."""
        (self.out / f"{verb.name}-{k}").mkdir(parents=True, exist_ok=True)
        cmd = verb.command(k)
        delay = self.rng.uniform(0.0, within * self.writing_s.get(verb.name, 0.0)) if kill else 0.0
        record = VerbKill(verb.name, k, round(delay, 4))
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
        started_writing = written = None
        while proc.poll() is None:
            if started_writing is None and verb.writing(k):
                started_writing = time.perf_counter()
            if written is None and started_writing is not None and verb.written(k):
                written = time.perf_counter()
            if kill and started_writing is not None and time.perf_counter() - started_writing >= delay:
                record.killed_while_writing = proc.poll() is None
                _kill_tree(proc)
                break
            time.sleep(0.001)
        if not kill:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            if proc.wait() != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {err[-2000:]}")
        if proc.stderr:
            proc.stderr.close()
        end = written or time.perf_counter()
        return end - (started_writing or end), record

    def run(self, kills_per_verb: int, verbs: tuple[str, ...] = VERBS) -> None:
        table = self._verbs()
        for name in verbs:
            verb = table[name]
            # the uninterrupted command, once: how long it writes (kill -1 is that reference run)
            self.writing_s[name], _ = self._one(verb, -1, kill=False)
            for k in range(kills_per_verb):
                # A kill that came after the command had ended (a busy machine runs the reference slower or
                # this one faster) tests nothing of a kill: another moment, earlier, on a fresh copy (index k +
                # 1000 a), up to ATTEMPTS times; the last attempt is judged either way.
                for attempt in range(ATTEMPTS):
                    index = k + 1000 * attempt
                    _, record = self._one(verb, index, kill=True, within=0.6**attempt)
                    if record.killed_while_writing:
                        break
                record.left = _temporaries(*verb.folders(index))
                done = _run(verb.command(index))
                record.next_rc = done.returncode
                lines = (done.stdout + done.stderr).strip().splitlines()
                record.next_line = lines[-1][-200:] if lines else ""
                record.problem = verb.judge(index, done)
                record.output_ok = not record.problem
                record.leftovers = _temporaries(*verb.folders(index))
                if record.leftovers and not record.problem:
                    record.problem = f"temporaries left after the next command: {record.leftovers}"
                self.kills.append(record)
                self.log(
                    f"{name} kill {index}: {record.delay_s:.3f} s into its writing "
                    f"({'running' if record.killed_while_writing else 'had ended'}), left {len(record.left)}, "
                    f"next exit {record.next_rc}, {'ok' if not record.problem else record.problem}"
                )

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in sorted({k.verb for k in self.kills}):
            ks = [k for k in self.kills if k.verb == name]
            out[name] = {
                "kills": len(ks),
                "while_writing": sum(k.killed_while_writing for k in ks),
                "left_temporaries": sum(bool(k.left) for k in ks),
                "next_completed": sum(k.next_rc == 0 for k in ks),
                "next_refused_in_one_line": sum(k.next_rc == 2 for k in ks),
                "problems": sum(bool(k.problem) for k in ks),
                "writing_s": round(self.writing_s.get(name, 0.0), 3),
            }
        return out


def table(summary: dict[str, Any]) -> str:
    head = "| verb | kills | while writing | left temporaries | next completed | next refused (1 line) | problems — goal 0 | writes for (s) |"
    rows = [head, "|" + "---|" * 8]
    for name, s in summary.items():
        rows.append(
            f"| {name} | {s['kills']} | {s['while_writing']} | {s['left_temporaries']} | {s['next_completed']} | "
            f"{s['next_refused_in_one_line']} | {s['problems']} | {s['writing_s']} |"
        )
    return "\n".join(rows)
