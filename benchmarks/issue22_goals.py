"""Issue 22's goals, judged from the JSON that bench_save.py and bench_load.py write (`--json`): one table per goal,
every figure a ratio to a floor measured in the same run, and a verdict against the issue's threshold.

    python benchmarks/issue22_goals.py --save save.json [--save more.json] [--load load.json]
    python benchmarks/issue22_goals.py --self-check     # the verdicts at and around each threshold

Goal 1: no update over 1.1x the launch's median but the ones holding a save, and the time the loop lost within
1.1x of N x the copy floor. Goal 2: every persist at 0.9 or more of the write floor (before and after the launches,
both shown). Goal 3: the worst update during each persist at 1.1x or less. Goal 4: each verified cold resume at
0.95 or more of its round's cold read (the mean of the two when the run was bracketed).

The verdicts read the figures bench_save.py computes itself (`over_1_1x_not_saving`, `lost_vs_saves_x_copy`,
`max_during_persist`); this only puts them side by side, so a change of their definition there shows here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

UPDATE_LIMIT = 1.1  # goals 1 and 3: an update's time over the launch's median
LOST_LIMIT = 1.1  # goal 1: the loop's lost time over N x the copy floor
PERSIST_FLOOR = 0.9  # goal 2: the write floor's time over the persist's
RESUME_FLOOR = 0.95  # goal 4: the cold read's time over the verified resume's


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _header(*columns: str) -> list[str]:
    """A markdown table's first two lines."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _launches(save: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The launches of one bench_save run, the extra ones (`--launch`) first, in the order they ran."""
    out = [(name, report) for name, report in (save.get("launches") or {}).items()]
    if save.get("launch"):
        out.append(("main", save["launch"]))
    return out


def goal1(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = _header(
        "run, launch", "updates", "ready after", "over 1.1x, not holding a save (update: x)",
        "lost / (N x copy)", "vs the plain loop", "verdict",
    )  # fmt: skip
    for run, save in runs:
        for name, launch in _launches(save):
            slow = launch.get("over_1_1x_not_saving") or []
            lost = launch.get("lost_vs_saves_x_copy")
            plain = launch.get("lost_vs_plain_x_copy")
            shown = ", ".join(f"{u}: {x:.3f}" for u, x in slow[:6]) + (
                f" (+{len(slow) - 6})" if len(slow) > 6 else ""
            )
            ok = not slow and lost is not None and lost <= LOST_LIMIT
            lines.append(
                f"| {run}, {name} | {launch.get('updates', '')} | {launch.get('reserve_ready_update', '')} "
                f"| {shown or 'none'} (max {launch.get('max_not_saving', 0):.3f}) | {_num(lost)} | {_num(plain)} "
                f"| {_verdict(ok)} |"
            )
    return lines


def goal2(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = _header(
        "run, launch", "persists: committed s, floor before / after", "worst",
        "verdict (each >= 0.9 of the floor before)",
    )  # fmt: skip
    for run, save in runs:
        before = save.get("disk_write_streams_s")
        after = save.get("disk_write_streams_after_s")
        for name, launch in _launches(save):
            saves = launch.get("saves") or []
            cells, ratios = [], []
            for s in saves:
                committed = s.get("committed_s")
                if not committed:
                    cells.append("?")
                    continue
                r_before = before / committed if before else None
                r_after = after / committed if after else None
                ratios.append(r_before if r_before is not None else 0.0)
                cells.append(f"{committed:.3f}: {_num(r_before)} / {_num(r_after)}")
            worst = min(ratios) if ratios else None
            ok = bool(ratios) and len(ratios) == len(saves) and min(ratios) >= PERSIST_FLOOR
            lines.append(f"| {run}, {name} | {'; '.join(cells)} | {_num(worst)} | {_verdict(ok)} |")
    return lines


def goal3(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = _header(
        "run, launch", "worst update during each persist (x median)", "updates during the persists", "verdict"
    )
    for run, save in runs:
        for name, launch in _launches(save):
            saves = launch.get("saves") or []
            worst = [s.get("max_during_persist") for s in saves]
            during = sum(int(s.get("updates_during_persist") or 0) for s in saves)
            known = [w for w in worst if w is not None]
            ok = bool(known) and max(known) <= UPDATE_LIMIT
            lines.append(
                f"| {run}, {name} | {', '.join(_num(w, 3) for w in worst)} | {during} | {_verdict(ok)} |"
            )
    return lines


def goal4(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = _header(
        "run, variant", "verified resume s", "its CPU s", "its round's cold read s (first / again)",
        "cold read / resume", "equal", "verdict",
    )  # fmt: skip
    spread: dict[str, list[float]] = {}  # each variant's ratios over its rounds
    for run, load in runs:
        for label, row in (load.get("rows") or {}).items():
            seconds = row.get("s")
            first, mean = row.get("round_floor_s"), row.get("round_mean_floor_s")  # bench_load's, per row
            floors = [first, 2 * mean - first] if first and mean else [first] if first else []
            if not floors:  # a run without rounds: its one cold read before the resumes
                floors = [load["cold_read_s"]] if load.get("cold_read_s") else []
            floor = sum(floors) / len(floors) if floors else None
            ratio = floor / seconds if floor and seconds else None
            ok = ratio is not None and ratio >= RESUME_FLOOR and bool(row.get("equal"))
            if ratio is not None:
                spread.setdefault(f"{run}, {label.split(' #')[0]}", []).append(ratio)
            shown = " / ".join(f"{f:.3f}" for f in floors)
            lines.append(
                f"| {run}, {label} | {_num(seconds, 3)} | {_num(row.get('cpu_s'))} | {shown} | {_num(ratio)} "
                f"| {row.get('equal')} "
                f"| {_verdict(ok)} |"
            )
    # per variant over its rounds: the disk's own drift (bench_load --control-floor's `cold-read` row, a cold read
    # in a variant's place) says how often a load at exactly the disk's speed would reach the threshold
    lines += ["", *_header("run, variant", "rounds", "median", "min–max", f"rounds at >= {RESUME_FLOOR}")]
    for name, ratios in spread.items():
        at = sum(r >= RESUME_FLOOR for r in ratios)
        lines.append(
            f"| {name} | {len(ratios)} | {statistics.median(ratios):.2f} | {min(ratios):.2f}–{max(ratios):.2f} "
            f"| {at} of {len(ratios)} |"
        )
    return lines


def _num(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _read(paths: list[str], flag: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for text in paths:
        path = Path(text)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(
                f"{flag} {path}: not a readable JSON file ({exc}); give the file a bench wrote with --json"
            ) from None
        if not isinstance(data, dict):
            raise SystemExit(f"{flag} {path}: not the JSON object bench_save.py or bench_load.py writes")
        out.append((path.stem, data))
    return out


def self_check() -> None:
    """The verdicts at and around each threshold, from hand-built figures (`--self-check`; the suite's tests import
    no benchmark: tests/test_layers.py)."""

    def launch(slow: list[list[float]], lost: float, persists: list[tuple[float, float]]) -> dict[str, Any]:
        saves = [
            {"committed_s": c, "max_during_persist": w, "updates_during_persist": 5} for c, w in persists
        ]
        return {
            "over_1_1x_not_saving": slow,
            "max_not_saving": 1.0,
            "lost_vs_saves_x_copy": lost,
            "saves": saves,
        }

    def verdicts(lines: list[str]) -> list[str]:
        # goal 4's summary follows its table after a blank line
        table = lines[2 : lines.index("")] if "" in lines else lines[2:]
        return [line.rsplit("|", 2)[-2].strip() for line in table]

    met, miss = "met", _verdict(False)
    runs = {"a": launch([], 1.1, []), "b": launch([], 1.1001, []), "c": launch([[12, 1.12]], 1.0, [])}
    assert verdicts(goal1([("r", {"launches": runs})])) == [met, miss, miss]
    floor = {"disk_write_streams_s": 10.0, "disk_write_streams_after_s": 5.0}
    assert verdicts(goal2([("r", {**floor, "launch": launch([], 1, [(10.0, 1), (11.1, 1)])})])) == [met]
    assert verdicts(goal2([("r", {**floor, "launch": launch([], 1, [(10.0, 1), (11.2, 1)])})])) == [miss]
    unfinished = launch([], 1, [(10.0, 1)])
    unfinished["saves"].append({"committed_s": None})
    assert verdicts(goal2([("r", {**floor, "launch": unfinished})])) == [miss]
    assert verdicts(goal3([("r", {"launch": launch([], 1, [(1, 1.02), (1, 1.1)])})])) == [met]
    assert verdicts(goal3([("r", {"launch": launch([], 1, [(1, 1.02), (1, 1.1001)])})])) == [miss]
    rows = {
        "d #1": {"s": 10.0, "equal": True, "round_floor_s": 10.0, "round_mean_floor_s": 9.5},
        "d #2": {"s": 8.5, "equal": True, "round_floor_s": 8.0, "round_mean_floor_s": 8.0},
        "e #2": {"s": 7.0, "equal": False, "round_floor_s": 8.0, "round_mean_floor_s": 8.0},
    }
    load = {"rows": rows}
    assert verdicts(goal4([("r", load)])) == [met, miss, miss]  # 9.5 / 10; 8 / 8.5; tensors unequal
    summary = goal4([("r", load)])[-2:]  # d: 0.95 and 0.94, median 0.9456, 1 of 2 at the threshold; e: 1.14
    assert summary[0].split(" | ")[1:] == ["2", "0.95", "0.94–0.95", "1 of 2 |"], summary
    print("self-check: every verdict as expected")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", action="append", default=[], help="a bench_save.py --json file (repeatable)")
    ap.add_argument("--load", action="append", default=[], help="a bench_load.py --json file (repeatable)")
    ap.add_argument(
        "--self-check", action="store_true", help="check the verdicts at each threshold, then stop"
    )
    args = ap.parse_args(argv)
    if args.self_check:
        self_check()
        return 0
    if not args.save and not args.load:
        ap.error("give at least one --save or --load file")
    saves, loads = _read(args.save, "--save"), _read(args.load, "--load")
    for _, data in saves:
        if "launch" not in data and "launches" not in data:
            raise SystemExit(
                "--save: a file without launches; was it written by bench_load.py? give it as --load"
            )
    machines = sorted(
        {f"{d.get('device')}, torch {d.get('torch')}, {d.get('cores')} cores" for _, d in saves + loads}
    )
    print("machines: " + "; ".join(machines))
    sections = []
    if saves:
        sections += [
            ("Goal 1: no update over 1.1x but the save's; lost within 1.1x of N x copy", goal1(saves))
        ]
        sections += [("Goal 2: each persist at >= 0.9 of the write floor", goal2(saves))]
        sections += [("Goal 3: the worst update during a persist at <= 1.1x", goal3(saves))]
    if loads:
        sections += [("Goal 4: verified resume at >= 0.95 of the cold read", goal4(loads))]
    for title, lines in sections:
        print(f"\n**{title}**\n")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
