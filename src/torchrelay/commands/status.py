"""`torchrelay status RUN_DIR [--json | --last-exit]`; `torchrelay status --memory [RUN_DIR] [--json]`."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from torchrelay.audit.verdict import shown_for_run
from torchrelay.commands import memory as memory_tiers
from torchrelay.commands.argtypes import run_directory
from torchrelay.controller.attempts import describe_fallback, latest_fallback
from torchrelay.errors import EXIT_ERROR, ConfigError, RecordError
from torchrelay.identity.numerics import describe as describe_numerics
from torchrelay.identity.numerics import fingerprint
from torchrelay.paths.layout import checkpoint_label, checkpoint_name
from torchrelay.paths.lock import describe, holder
from torchrelay.paths.rundir import RunDir
from torchrelay.records.history import read_history
from torchrelay.records.reshard import describe_change
from torchrelay.records.summary import summarize
from torchrelay.util.shown import shown, visible


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=run_directory, nargs="?")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--memory",
        action="store_true",
        help="this user's memory tiers on this node, every run's (RUN_DIR: that run's): run directory, lineage, "
        "updates held, size, age, and whether it is live, stale (free it: stop --forget-memory --stale) or kept",
    )
    p.add_argument(
        "--ledger",
        action="store_true",
        help="also prove every exposure exactly once, as `torchrelay ledger` does (reads every exposure line)",
    )
    p.add_argument(
        "--last-exit",
        action="store_true",
        help="print how the last segment ended and exit with its code (0, 3 budget, 4 request, 5 signal, ...): "
        "torchrun folds every worker code into 1, a batch script reads the real one here",
    )


def _fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):  # a NaN or infinite update time logged: no ETA
        return "-"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _last_exit(run: RunDir) -> int:
    history = read_history(run)
    if not history:
        raise ConfigError(f"{run.path} has no segment yet", hint="launch the run first")
    last = history[-1]
    code = last.get("exit_code")
    if code is None:  # still running, or killed before it could record its end
        running = holder(run.path, "train") is not None
        print(
            f"segment {visible(last.get('segment'))}: "
            f"{'running' if running else 'ended unrecorded (killed or crashed)'}"
        )
        return EXIT_ERROR
    if code < 0:  # killed by signal -code, as the controller records a segment it found killed: a crash
        print(
            f"segment {visible(last.get('segment'))}: ended {visible(last.get('ended'))} "
            f"(killed by signal {-code}; exit 1)"
        )
        return EXIT_ERROR
    if code > 255:  # no process exits so: sys.exit would take it modulo 256 (256 read as 0, finished)
        raise RecordError(
            str(run.history_path),
            f"the last segment's exit code {code} is no process's exit code (0 to 255)",
            field="exit_code",
            hint="the file is damaged or not what it should be; restore it from a copy",
        )
    if (
        last.get("ended") == "refused"
    ):  # no update ran: say why instead, every line of it (a contract's fields)
        notes = last.get("notes") or []
        why = str(notes[-1]) if notes else ""  # the refusal is the segment's last note
        lines = [visible(line) for line in why.splitlines()] or ["-"]
        print(f"segment {visible(last.get('segment'))}: refused (exit {code}): " + "\n".join(lines))
        return int(code)
    print(
        f"segment {visible(last.get('segment'))}: ended {visible(last.get('ended'))} "
        f"at update {visible(last.get('last_update'))} (exit {code})"
    )
    return int(code)


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float in it replaced by None (JSON has no such number)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


NOTE_CHARS = 100  # of each note in the segments table; `status --json` and history.jsonl hold them whole


def _short(text: str, limit: int = NOTE_CHARS) -> str:
    """The first line of `text`, cut at a word boundary with an ellipsis past `limit` characters."""
    line = text.strip().split("\n", 1)[0]
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0] if " " in line[:limit] else line[:limit]
    return cut.rstrip(",;:") + " …"


def _notes_cell(seg: dict[str, Any]) -> str:
    """A segment's notes as the table shows them: runtime changes as `field old -> new`, each note's first line."""
    parts = []
    tier = seg.get("resumed_tier")
    if isinstance(tier, str) and tier:
        parts.append(f"resumed from the {_short(tier, 20)} tier")
    changes = seg.get("runtime_changes")
    if isinstance(changes, dict) and changes:
        shown_changes = []
        for key, value in changes.items():
            pair = value if isinstance(value, list | tuple) and len(value) == 2 else ("?", value)
            shown_changes.append(f"{key} {_short(str(pair[0]), 30)} -> {_short(str(pair[1]), 30)}")
        parts.append("runtime: " + ", ".join(shown_changes))
    oom = seg.get("ooms") or {}
    if isinstance(oom, dict) and (oom.get("caught") or oom.get("fatal")):
        parts.append(f"OOMs: {oom.get('caught', 0)} caught, {oom.get('fatal', 0)} fatal")
    parts += [_short(str(note)) for note in seg.get("notes") or []]
    return "; ".join(parts)


def _updates(seg: dict[str, object]) -> str:
    first, last = seg.get("first_update"), seg.get("last_update")
    if isinstance(first, int) and isinstance(last, int) and last < first:
        return "-"  # a launch that ran no update (refused)
    return f"{_fmt(first)}–{_fmt(last)}"


def _state(s: dict[str, object]) -> str:
    trained, launched = s["trained_by"], s["launched_by"]
    if isinstance(trained, dict):
        text = f"[green]training[/] ({shown(describe(trained, command=False))})"
    elif s["ended_unrecorded"]:
        text = "[red]not running[/]: the last segment ended unrecorded (killed or crashed); the next launch resumes"
    else:
        text = "not running"
    if isinstance(launched, dict):
        text += f"; controller {shown(describe(launched, command=False))}"
    return text


def run(args: argparse.Namespace) -> int:
    if args.memory:
        if args.last_exit or args.ledger:
            raise ConfigError("status --memory takes no --last-exit or --ledger", hint="drop them")
        return memory_tiers.show(args)
    memory_tiers.check_memory_flags(args, "status")
    run: RunDir = args.run_dir
    if args.last_exit:
        return _last_exit(run)
    s = summarize(run, ledger=args.ledger)
    s["audit"] = shown_for_run(run)  # the summary is the run's; the verdict is the audit's
    s["fallback"] = latest_fallback(run)  # started by `launch` as a plan's fallback
    if args.json:
        # JSON as every parser reads it: a NaN or infinite loss (a diverged run) or metric is null, not `NaN`
        print(json.dumps(_finite(s), indent=1, sort_keys=True, allow_nan=False))
        return 0
    console = Console()
    # Every string below that a file of the run (or its path) holds is `shown`: rich reads `[...]` as markup (a `[/]`
    # in a note, a host or a path was a MarkupError traceback, any other tag restyled the table), and an ESC or other
    # control character in it went to the terminal as it was (a crafted history.jsonl retitled or cleared it).
    t = Table(title=f"torchrelay status — {shown(str(s['run_dir']))}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("state", _state(s))
    t.add_row(
        "updates done / left", f"{s['updates_done']:,} / {s['updates_left']:,} of {s['total_updates']:,}"
    )
    t.add_row("epoch", _fmt(s["epoch"], ".4f"))
    if s["ledger_ok"] is None:
        t.add_row(
            "exposures",
            f"{s['exposures']:,} ({s['updates_done']:,} updates x {s['global_batch']:,}); "
            f"{s['remaining_in_epoch']:,} remaining in the epoch",
        )
        t.add_row(
            "ledger", "not proven here: `torchrelay ledger` (or `status --ledger`) reads every exposure"
        )
    else:
        t.add_row(
            "exposures",
            f"{s['exposures']:,} ({s['distinct']:,} distinct, {s['repeats']} repeats, {s['skipped']} skipped); "
            f"{s['remaining_in_epoch']:,} remaining in the epoch",
        )
        t.add_row(
            "ledger",
            "[green]exactly once, in order[/]"
            if s["ledger_ok"]
            else "[red]NOT clean: run torchrelay ledger[/]",
        )
    t.add_row("LR", _fmt(s["lr"], ".4g"))
    t.add_row(f"loss (mean of last {s['loss_window']})", _fmt(s["loss_mean"], ".4f"))
    if s.get("objective_means"):
        names = shown(" / ".join(s["objective_means"]))  # the metric lines' own names
        values = " / ".join(_fmt(v, ".4g") for v in s["objective_means"].values())
        t.add_row(f"{names} (same updates)", values)
    ooms = s.get("cuda_ooms") or {}
    t.add_row(
        "CUDA OOMs", f"{ooms.get('total', 0)} ({ooms.get('caught', 0)} caught, {ooms.get('fatal', 0)} fatal)"
    )
    t.add_row("update time (mean)", f"{s['update_time_mean']:.3f} s" if s["update_time_mean"] else "-")
    t.add_row("ETA", _duration(s["eta_seconds"]))
    t.add_row("numerics", _numerics(s["segments"]))
    if s.get("audit"):
        a = s["audit"]
        t.add_row("last audit", shown(f"{a.get('verdict', a)}"))
    if s.get("fallback"):
        t.add_row("launched as", shown(describe_fallback(s["fallback"])))
    console.print(t)
    c = Table(title="checkpoints")
    for col in ("update", "state", "size", "kept because"):
        c.add_column(col)
    for ck in s["checkpoints"]:
        state = "complete" if ck["complete"] else f"[red]incomplete[/]: {shown(str(ck['reason']))}"
        if ck["handed_off"]:
            state += " (handed off)"
        c.add_row(
            checkpoint_name(ck["update"]),
            state,
            f"{ck['bytes'] / 1e6:.1f} MB" if ck["complete"] else "-",
            shown(str(ck.get("kept") or "-")),
        )
    memory = s.get("memory_tier") or {}
    if memory.get("refused"):
        c.add_row("-", f"[red]memory tier refused[/]: {shown(str(memory['refused']))}", "-", "-")
    for ck in memory.get("checkpoints") or []:
        state = "complete" if ck["complete"] else f"[red]incomplete[/]: {shown(str(ck['reason']))}"
        c.add_row(
            checkpoint_name(ck["update"]),
            f"{state} (memory tier, this node)",
            f"{ck['bytes'] / 1e6:.1f} MB" if ck["complete"] else "-",
            f"memory_keep (every {memory.get('memory_every')} updates)",
        )
    for ck in memory.get("replicas") or []:
        state = "complete" if ck["complete"] else f"[red]incomplete[/]: {shown(str(ck['reason']))}"
        c.add_row(
            checkpoint_name(ck["update"]),
            f"{state} (replica-node{ck['source']}: node {ck['source']}'s part, held on this node)",
            f"{ck['bytes'] / 1e6:.1f} MB" if ck["complete"] else "-",
            "memory_keep",
        )
    console.print(c)
    _print_validation(console, s["validation"])
    g = Table(title="segments" + (f" — {len(s['lineages'])} lineages" if len(s["lineages"]) > 1 else ""))
    for col in ("#", "segment", "job", "hosts", "world", "updates", "ended", "numerics", "notes"):
        g.add_column(col)
    for i, seg in enumerate(s["segments"], 1):
        notes = shown(_notes_cell(seg))
        g.add_row(
            str(i),
            shown(str(seg["segment"] or "-")),
            shown(str(seg["job"] or "-")),
            shown(",".join(str(h) for h in seg["hosts"] or [])),
            shown(_world(seg)),
            _updates(seg),
            shown(str(seg["ended"] or "-")),
            fingerprint(seg["numerics"]) if isinstance(seg.get("numerics"), dict) else "-",
            notes,
        )
    console.print(g)
    for i, seg in enumerate(s["segments"], 1):
        if seg.get("layout_change"):
            console.print(f"segment #{i}: {shown(describe_change(seg['layout_change']))}")
        change = seg.get("numerics_change")
        if isinstance(change, dict):
            console.print(f"segment #{i}: numerics changed: {shown(str(change.get('line')))}", soft_wrap=True)
    return 0


def _numerics(segments: list[dict[str, Any]]) -> str:
    """The last recorded numerics identity, and how many identities the segments ran with."""
    recorded = [s["numerics"] for s in segments if isinstance(s.get("numerics"), dict)]
    if not recorded:
        return "not recorded (segments written before torchrelay recorded it)"
    kinds = len({fingerprint(n) for n in recorded})
    more = (
        f" [yellow]({kinds} identities across the segments: bit-for-bit comparison holds only within one)[/]"
        if kinds > 1
        else ""
    )
    return shown(describe_numerics(recorded[-1])) + more


def _world(seg: dict[str, Any]) -> str:
    """The segment's world size; after a layout change, the one it came from too ("2->1")."""
    change = seg.get("layout_change")
    old = (change.get("from") or {}).get("world_size") if isinstance(change, dict) else None
    return f"{old}->{seg['world_size']}" if old is not None else str(seg["world_size"])


def _print_validation(console: Console, validation: dict[str, Any]) -> None:
    records, pending = validation["records"], validation["pending"] or {}
    left, missing = pending.get("left") or {}, pending.get("missing") or {}
    if not records and not left and not missing:
        return
    v = Table(title="validation")
    for col in ("checkpoint", "result", "metrics", "took"):
        v.add_column(col)
    for r in records:
        result = {"ok": "[green]ok[/]", "failed": "[red]failed[/]"}.get(
            r["status"], f"[yellow]{shown(r['status'])}[/]"
        )
        if r["reason"]:
            result += f": {shown(r['reason'])}"
        metrics = ", ".join(f"{k}={_metric(x)}" for k, x in (r["metrics"] or {}).items())
        v.add_row(checkpoint_name(r["update"]), result, shown(metrics[:80]) or "-", f"{r['seconds']:.1f} s")
    for update, why in left.items():
        v.add_row(
            shown(checkpoint_label(update)),
            f"[yellow]left for the next launch[/]: {shown(str(why))}",
            "-",
            "-",
        )
    for update, why in missing.items():
        v.add_row(shown(checkpoint_label(update)), f"not available: {shown(str(why))}", "-", "-")
    console.print(v)


def _metric(value: object) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
