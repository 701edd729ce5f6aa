"""A run's state at a glance: what `torchrelay status` shows and what `pack` writes as training_progress.json."""

from __future__ import annotations

import os
from typing import Any

from torchrelay.checkpoint.retention import decide, policy_for
from torchrelay.checkpoint.select import CheckpointInfo, list_checkpoints
from torchrelay.checkpoint.storage import LocalStorage
from torchrelay.checkpoint.tiers import held_replicas, memory_root, root_problem
from torchrelay.config.relay import RelayConfig, stored_config
from torchrelay.ledger.exposure import prove
from torchrelay.paths.lock import holder
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import load_contract
from torchrelay.records.history import read_history
from torchrelay.records.train import (
    count_ooms,
    is_objective,
    last_records,
    metric_float,
    metrics_path,
    read_ooms,
)
from torchrelay.records.validation import read_pending, read_records


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    run_dir: str | os.PathLike[str] | RunDir, window: int = 100, *, ledger: bool = False
) -> dict[str, Any]:
    """Updates done/left, epoch fraction, exposures, LR, recent loss and speed, ETA, checkpoints, segments.

    What it reads does not grow with the run: the tail of rank 0's metrics, the contract, the history and the
    checkpoints' records. Exposures are the schedule's (updates done x global batch); `ledger=True` proves them
    from every exposure line instead (`torchrelay ledger`: seconds and hundreds of MB at 20 M exposures).
    """
    rd = RunDir.of(run_dir)
    cfg = stored_config(rd)
    records = last_records(metrics_path(rd.train_dir, 0), window)
    done = records[-1]["update"] if records else 0
    recent = records
    losses = [metric_float(r["loss"]) for r in recent if isinstance(r.get("loss"), int | float)]
    objectives = sorted({k for r in recent for k in r if is_objective(k)})
    times = [metric_float(r["update_time"]) for r in recent if isinstance(r.get("update_time"), int | float)]
    left = cfg.total_updates - done
    mean_time = _mean(times)
    fields = load_contract(rd)["fields"]
    batch, samples = int(fields["global_batch"]), int(fields["data.samples"])
    per_epoch = max(samples // batch, 1)
    epoch = (done - 1) // per_epoch if done else 0
    proof = prove(rd) if ledger else None
    ckpts = list_checkpoints(rd)
    kept = _kept_because(cfg, ckpts)
    history = read_history(rd)
    lineages = sorted({str(s["lineage"]) for s in history if s.get("lineage")})
    out: dict[str, Any] = {
        "run_dir": str(rd.path),
        "updates_done": done,
        "updates_left": left,
        "total_updates": cfg.total_updates,
        "epoch": round(done / per_epoch, 4),
        "global_batch": batch,
        "exposures": proof.exposures if proof else done * batch,
        "remaining_in_epoch": (per_epoch - (done - epoch * per_epoch)) * batch,
        # proven from every exposure line only on request (None: not looked at)
        "distinct": proof.distinct if proof else None,
        "repeats": proof.repeats if proof else None,
        "skipped": proof.skipped if proof else None,
        "ledger_ok": proof.ok if proof else None,
        "lr": metric_float(records[-1].get("lr")) if records and "lr" in records[-1] else None,
        "loss_mean": _mean(losses),
        "loss_window": len(losses),
        # each objective's loss (`loss_<name>` a script logs), mean of the same last updates
        "objective_means": {
            k: _mean([metric_float(r[k]) for r in recent if isinstance(r.get(k), int | float)])
            for k in objectives
        },
        "update_time_mean": mean_time,
        "eta_seconds": left * mean_time if mean_time is not None else None,
        "checkpoints": [
            {
                "update": c.update,
                "complete": c.complete,
                "reason": c.reason,
                "bytes": c.size,
                "handed_off": c.handed_off,
                "kept": kept.get(c.update),
            }
            for c in ckpts
        ],
        "segments": [
            {
                k: s.get(k)
                for k in (
                    "segment",
                    "parent",
                    "lineage",
                    "parent_lineage",
                    "job",
                    "hosts",
                    "world_size",
                    "first_update",
                    "last_update",
                    "ended",
                    "exit_code",
                    "runtime_changes",
                    "layout_change",
                    "numerics",
                    "numerics_change",
                    "resumed_tier",
                    "notes",
                )
            }
            for s in history
        ],
        "lineages": lineages,
        # Live holders of the run's locks (torchrelay.paths.lock): who trains it and which controller launched it.
        "trained_by": holder(rd.path, "train"),
        "launched_by": holder(rd.path, "launch"),
    }
    ooms = count_ooms(read_ooms(rd.train_dir))
    out["cuda_ooms"] = ooms
    for seg in out["segments"]:
        seg["ooms"] = ooms["by_segment"].get(str(seg["segment"]), {"caught": 0, "fatal": 0})
    out["running"] = out["trained_by"] is not None
    # A last segment still marked running with nobody holding the run ended without a word: a crash or a kill.
    out["ended_unrecorded"] = bool(history) and history[-1].get("ended") == "running" and not out["running"]
    out["validation"] = _validation(rd)
    # the newest segment's lineage: the one the next save writes under (`lineages` is sorted, not in order)
    current = next((s["lineage"] for s in reversed(history) if isinstance(s.get("lineage"), str)), None)
    out["memory_tier"] = _memory_tier(rd, cfg.memory_every, current)
    return out


def _memory_tier(run: RunDir, every: int, lineage: str | None) -> dict[str, Any]:
    """The memory tier as this node holds it (checkpoint/tiers.py): where, how often, its checkpoints, and the
    replicas of other nodes' parts it holds (checkpoint/replica.py); nothing listed from a folder not the user's
    alone (`refused`: the line saying why)."""
    root = memory_root(lineage, run) if lineage else None
    refused = root_problem(root, make=False) if root is not None else None
    if refused is not None:
        return {
            "memory_every": every,
            "root": str(root),
            "checkpoints": [],
            "replicas": [],
            "refused": refused,
        }
    held = LocalStorage(root, spare=False).list_complete() if root is not None and root.is_dir() else []
    replicas = [
        {"source": source, **_held(c)}
        for source, folder in (held_replicas(root) if root is not None else [])
        for c in LocalStorage(folder, spare=False).list_complete()
    ]
    return {
        "memory_every": every,
        "root": str(root) if root is not None else None,
        "checkpoints": [_held(c) for c in held],
        "replicas": replicas,
    }


def _held(c: CheckpointInfo) -> dict[str, Any]:
    return {"update": c.update, "complete": c.complete, "reason": c.reason, "bytes": c.size}


def _validation(run: RunDir) -> dict[str, Any]:
    """Each checkpoint's recorded validation (status, metrics, when, how long) and what is left to validate."""
    records = [
        {
            k: r.to_dict()[k]
            for k in ("update", "status", "reason", "metrics", "seconds", "started", "attempt")
        }
        for r in read_records(run).values()
    ]
    return {"records": records, "pending": read_pending(run)}


def _kept_because(cfg: RelayConfig, ckpts: list[CheckpointInfo]) -> dict[int, str]:
    """Why retention keeps each checkpoint (the policy of the stored configuration), or what happens to it."""
    eligible = [c.update for c in ckpts if c.complete and not c.handed_off]
    verdict = decide(policy_for(cfg, [c.update for c in ckpts if c.saved_now]), eligible)
    out = dict(verdict.kept)
    out.update({u: "deleted at the next save" for u in verdict.deleted})
    for c in ckpts:
        if c.saved_now and c.update in verdict.kept and c.saved_now != "save_now":  # the script's reason too
            out[c.update] = out[c.update].replace("save_now", f"save_now ({c.saved_now})", 1)
        if c.handed_off:
            out[c.update] = "handed off (the fork guard keeps it)"
        elif c.damaged:
            out[c.update] = "inventory damaged (a resume refuses: restore it or remove the checkpoint)"
        elif not c.complete:
            out[c.update] = "incomplete (never chosen, never deleted by retention)"
    return out
