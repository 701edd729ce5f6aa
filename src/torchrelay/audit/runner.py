"""One run of an audit (orchestrator.py runs them): the user's own command launched in a fresh run directory,
stopped by request file after chosen updates."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.config import envvars
from torchrelay.errors import RelayError
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.util.proctree import end_tree
from torchrelay.util.safepath import open_writable

# How long a timed-out launch has to end on SIGTERM (ranks stop at their next boundary) before it is killed.
KILL_GRACE_S = 15.0


class AuditError(RelayError):
    """The audit could not run: a bad spec, or a launch that failed or did not stop where it was asked to."""


# Runs argv with env, output to log; returns the exit code. Injected so tests can run without torchrun.
Launcher = Callable[[Sequence[str], Mapping[str, str], Path, float], int]


def subprocess_launcher(
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    timeout: float,
    *,
    grace_s: float = KILL_GRACE_S,
    timed_out: Callable[[float], bool] | None = None,
) -> int:
    """Run the launch command as a child process, stdout and stderr into `log`; past `timeout` seconds (or once
    `timed_out(seconds)` says so) end it and every process it started, and raise."""
    expired = timed_out or (lambda seconds: seconds > timeout)
    with os.fdopen(open_writable(log, what="a segment's log of the audit", truncate=True), "wb") as out:
        try:
            proc = subprocess.Popen(
                list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            raise AuditError(
                f"cannot start {argv[0]!r}: {exc.strerror}", hint="check the command after --"
            ) from exc
        started = time.monotonic()
        try:
            while proc.poll() is None:
                if expired(time.monotonic() - started):
                    _end(proc, grace_s)
                    raise AuditError(
                        f"the launch ran past {time.monotonic() - started:.0f}s (log: {log})",
                        hint="raise --timeout or lower --updates",
                    )
                time.sleep(0.1)
            return proc.returncode
        except AuditError:
            raise
        except BaseException:
            _end(proc, grace_s)  # Ctrl-C reaches only us: the launch runs in its own session
            raise


def _end(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the launch, then SIGKILL to whatever of it is left after the grace, ranks and workers included
    (torchrun starts each rank in a session of its own, out of reach of a process-group kill)."""
    end_tree(proc.pid, grace_s=grace_s)
    proc.wait()


def choose_stops(updates: int, stops: int, *, rng: random.Random | None = None) -> list[int]:
    """K distinct updates in [1, U-1] after which to stop: drawn from rng, or spread from early to late.

    The last stop is after update U-1 and, with K >= 2, the first after update 1: state restored wrongly at
    a late stop has no updates left to fade in, and an early stop resumes optimizer and schedule state that
    has barely started. The others are evenly spaced in between.
    """
    if updates < 2:
        raise AuditError(f"--updates {updates}: need at least 2 updates to stop in between")
    if not 1 <= stops <= updates - 1:
        raise AuditError(f"--stops {stops}: choose between 1 and {updates - 1} stops for {updates} updates")
    if rng is not None:
        return sorted(rng.sample(range(1, updates), stops))
    if stops == 1:
        return [updates - 1]
    return sorted({round(1 + i * (updates - 2) / (stops - 1)) for i in range(stops)})


def check_stops(updates: int, stop_at: Sequence[int]) -> list[int]:
    """Validate explicit stop updates: distinct, sorted, each in [1, U-1]."""
    chosen = sorted(set(stop_at))
    bad = [a for a in chosen if not 1 <= a < updates]
    if bad or not chosen:
        raise AuditError(f"--stop-at {','.join(map(str, stop_at))}: every stop must lie in 1..{updates - 1}")
    return chosen


@dataclass(slots=True)
class SegmentLaunch:
    """One launch: where it was asked to stop, with which overrides, and how it ended."""

    index: int
    stop_at: int
    overrides: dict[str, Any]
    exit_code: int  # of the launch command (torchrun turns any failing worker into 1)
    seconds: float
    log: Path
    ended: str | None = None  # how history.jsonl says the segment ended


@dataclass(slots=True)
class RunLaunches:
    """A run directory and the launches that wrote it."""

    name: str
    run: RunDir
    segments: list[SegmentLaunch] = field(default_factory=list)

    def checkpoint(self, update: int) -> Path:
        return self.run.checkpoint(update)


def fresh_run(work: Path, name: str) -> RunDir:
    """The run directory the audit launches its run `name` in: `name` inside its work directory, new."""
    return RunDir(work / name)


def overrides_for(segment: int, vary: Mapping[str, Sequence[Any]], base: Mapping[str, Any]) -> dict[str, Any]:
    """The runtime overrides of segment i (0-based): each varied field cycles through its values."""
    out = dict(base)
    for key, values in vary.items():
        out[key] = values[segment % len(values)]
    return out


def _tail(log: Path, lines: int = 25) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:])


_SAID = re.compile(r"^torchrelay(?: \[rank \d+\])?: ")


def said(log: Path) -> tuple[str, str | None] | None:
    """The first one-line message a rank printed in a segment's log (`torchrelay: ...`) and its hint, or None:
    what a refused or failed segment says, far above the tail that torchrun's own failure report fills."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        if _SAID.match(line):
            hint, details = None, []  # its indented lines: the fields a refusal names, then the hint
            for more in lines[i + 1 :]:
                if not more.startswith("  "):
                    break
                if more.startswith("  hint: "):
                    hint = more.removeprefix("  hint: ").strip()
                else:
                    details.append(more.strip())
            message = line.split(": ", 1)[1].strip()
            return " ".join([message, "; ".join(details[:4])]).strip(), hint
    return None


def _last_segment(run: RunDir) -> tuple[str | None, int | None]:
    """How the newest segment in history.jsonl ended, and its last update."""
    from torchrelay.records.history import read_history

    segments = read_history(run)
    if not segments:
        return None, None
    return segments[-1].get("ended"), segments[-1].get("last_update")


def run_segments(
    name: str,
    launch: Sequence[str],
    run: RunDir,
    log_dir: Path,
    stop_after: Sequence[int],
    *,
    vary: Mapping[str, Sequence[Any]] | None = None,
    launcher: Launcher = subprocess_launcher,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    on_segment: Callable[[str, SegmentLaunch], None] | None = None,
    extra_overrides: Mapping[str, Any] | None = None,
    argv_for: Callable[[int], Sequence[str]] | None = None,
) -> RunLaunches:
    """Launch once per entry of stop_after, each a fresh process asked (by request file) to stop after that update.

    Every segment gets TORCHRELAY_OVERRIDES = the environment's, then `extra_overrides`, then the varied fields.
    argv_for(i): segment i's own command (0-based), e.g. on another number of ranks; else `launch` for every one.
    """
    from torchrelay.policy.stop import write_request

    base_env = dict(os.environ if env is None else env)
    try:
        base_overrides = json.loads(envvars.OVERRIDES.text(base_env) or "{}")
    except json.JSONDecodeError as exc:
        raise AuditError(f"TORCHRELAY_OVERRIDES is not JSON ({exc.msg})", hint="unset it or fix it") from exc
    base_overrides.update(extra_overrides or {})
    run.path.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    result = RunLaunches(name=name, run=run)
    for index, stop in enumerate(stop_after):
        overrides = overrides_for(index, vary or {}, base_overrides)
        # Written before the launch: Run.open accepts a fresh directory holding only the request.
        write_request(run, at_update=stop, reason="audit")
        seg_env = base_env | {
            "TORCHRELAY_RUN_DIR": str(run.path),
            "TORCHRELAY_OVERRIDES": json.dumps(overrides),
        }
        log = log_dir / f"{name}-segment{index + 1}.log"
        started = time.monotonic()
        code = launcher(argv_for(index) if argv_for else launch, seg_env, log, timeout_s)
        # torchrun reports any failing worker as exit 1, so how the segment ended is read from history.jsonl.
        ended, last_update = _last_segment(run)
        seg = SegmentLaunch(index + 1, stop, overrides, code, time.monotonic() - started, log, ended)
        result.segments.append(seg)
        if on_segment is not None:
            on_segment(name, seg)
        last = index == len(stop_after) - 1
        stopped = ended == "request" or (last and ended == "finished")
        if not stopped or last_update != stop:
            what = f"{name} run, segment {index + 1}: asked to stop after update {stop}, the launch exited {code}"
            found = said(log) if ended in ("refused", "error") else None
            if found is not None:  # the rank's own line, not the tail of torchrun's report
                raise AuditError(f"{what}: {found[0]} (log {log})", hint=found[1])
            raise AuditError(
                f"{what} and history.jsonl says it ended {ended!r} at update {last_update}; log {log}:\n{_tail(log)}",
                hint="run the command by hand with TORCHRELAY_RUN_DIR set; it must use torchrelay.Run, reach "
                "--updates before its total_updates, and reach run.steps() before its first update boundary",
            )
        if not (result.checkpoint(stop) / INVENTORY).is_file():
            raise AuditError(
                f"{name} run, segment {index + 1}: no complete {checkpoint_name(stop)} in {run.path} after the stop",
                hint="the script must save and stop at the update boundary the request names",
            )
    return result
