"""The bundle's README.md: what it is, the state at the stop, the invariants, the exact steps, the history."""

from __future__ import annotations

import datetime as dt
from typing import Any

from torchrelay.identity.numerics import describe
from torchrelay.paths.layout import checkpoint_name
from torchrelay.util.dotted import flatten

# Contract fields worth a line of their own in the invariants table, in this order.
_INVARIANT_ORDER = (
    "world_size",
    "global_batch",
    "micro_batch",
    "grad_accum",
    "seed",
    "sampler",
    "schedule.total_updates",
    "schedule.warmup_updates",
    "data.fingerprint",
    "data.samples",
    "code.commit",
    "code.tree",
    "versions.python",
    "versions.torch",
)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return "?"
    try:
        return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    except (OverflowError, ValueError, OSError):  # a time no clock shows (a hand-edited history)
        return "?"


def _count(value: Any) -> int:
    """A count from a record that may hold anything: the value if it is a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _get(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in d and d[key] is not None:
            return d[key]
    return default


def render_readme(
    info: dict[str, Any],
    contract: dict[str, Any],
    config: dict[str, Any],
    manifest_info: dict[str, Any],
    progress: dict[str, Any],
    history: list[dict[str, Any]],
) -> str:
    """Markdown that reads like a run card: a stranger can verify, prepare and continue from it alone."""
    fields = contract["fields"]
    update = int(info["update"])
    # The README is informative: a record of the wrong type (a hand-edited run) shows as "?" or 0, never fails a pack.
    total = _count(fields.get("schedule.total_updates", config.get("total_updates", 0)))
    world = fields.get("world_size")
    ledger = progress.get("ledger", {}) if isinstance(progress.get("ledger"), dict) else {}
    last = history[-1] if history else {}
    source = info.get("source", {}) or {}
    name = info["source_run"].rstrip("/").rsplit("/", 1)[-1]
    pct = f" ({100 * update / total:.1f}%)" if total else ""
    out: list[str] = []
    w = out.append

    w(f"# {name} — training state at update {update:,} for continuation elsewhere\n")
    w(
        f"Bundle lineage `{info['lineage']}` (parent lineage `{info.get('parent_lineage')}`), packed "
        f"{info['packed_at']} by {info['packed_by']} from `{info['source_run']}` with torchrelay "
        f"{info['tool_version']}. Training contract `{contract['sha256']}`.\n"
    )
    w(f"## Resume from {info['checkpoint']}/\n")
    w(
        f"Update {update:,} of {total:,}{pct}, stopped at an update boundary "
        f"(last segment ended: `{last.get('ended', '?')}`). It is a complete checkpoint for "
        f"{world} rank(s): model and optimizer tensors (DCP shards), `relay_state.json` (loop and sampler "
        "position), per-rank RNG, and `COMPLETE.json`, the inventory the trainer checks.\n"
    )

    w("## Training state at the stop (data/training_progress.json)\n")
    w("| | |\n|---|---|")
    w(f"| Updates done / left | {update:,} / {max(total - update, 0):,} |")
    if ledger:
        w(f"| Epoch | {_fmt(ledger.get('epoch_fraction'))} |")
        w(
            f"| Samples trained | {_fmt(ledger.get('exposures'))} exposures, {_fmt(ledger.get('distinct'))} distinct, "
            f"{_fmt(ledger.get('repeats'))} repeats; {_fmt(ledger.get('remaining_in_epoch'))} remaining in the epoch |"
        )
    for label, keys in (
        ("LR at the stop", ("lr", "lr_at_stop", "last_lr")),
        ("Loss (mean of the last 100 updates)", ("loss_mean_100", "loss_mean", "mean_loss")),
    ):
        value = _get(progress, *keys)
        if value is not None:
            w(f"| {label} | {_fmt(value)} |")
    objectives = progress.get("objective_loss_mean_100") or {}
    if objectives:
        names, values = " / ".join(objectives), " / ".join(_fmt(v) for v in objectives.values())
        w(f"| {names} (mean of the last 100 updates) | {values} |")
    ooms = progress.get("cuda_ooms")
    if isinstance(ooms, dict):
        w(
            f"| CUDA OOMs | {ooms.get('total', 0)} ({ooms.get('caught', 0)} caught, {ooms.get('fatal', 0)} fatal) |"
        )
    w("")

    w("## Invariants: do not change\n")
    w("The trainer refuses to resume unless every one of these equals what it recomputes at launch.\n")
    w("| Field | Value |\n|---|---|")
    shown = set()
    for key in _INVARIANT_ORDER:
        if key in fields:
            w(f"| {key} | `{fields[key]}` |")
            shown.add(key)
    for key in sorted(fields):
        if key not in shown:
            w(f"| {key} | `{fields[key]}` |")
    w("")
    w("Only these fields are server-specific and may be changed by `torchrelay prepare --set KEY=VALUE`:\n")
    flat = flatten(config)
    for key in info.get("runtime_keys", []):
        w(f"- `{key}` (now `{flat.get(key, '')}`)")
    w("")
    w(
        f"The manifest `data/manifest.jsonl` ({manifest_info['samples']:,} samples, SHA-256 "
        f"`{manifest_info['sha256']}`) names files under the data root `{manifest_info['data_root']}`; its "
        f"path-independent fingerprint is `{manifest_info['fingerprint']}` and must stay so after rebasing.\n"
    )
    ext = sorted(k for k in fields if k.startswith("external."))
    if ext:
        w("External files (not included; bring your own copy, it must hash the same):\n")
        for key in ext:
            label = key.removeprefix("external.").removesuffix(".sha256")
            path = config.get("external_files", {}).get(label, "?")
            w(f"- `{label}`: SHA-256 `{fields[key]}` (was at `{path}`)")
        w("")

    w("## Steps\n")
    w("```bash")
    w("# 0. download and verify every byte")
    w("cd BUNDLE && sha256sum -c --quiet SHA256SUMS && echo ALL_FILES_OK     # or: torchrelay verify .")
    if source.get("archive"):
        w("")
        w("# 1. exact code")
        w(f"mkdir -p $ROOT/src && tar -C $ROOT/src -xzf {source['archive']}")
        if source.get("untracked"):  # the run's files git did not track (a script not yet committed)
            w(f"tar -C $ROOT/src -xzf {source['untracked']}   # files git did not track, beside the commit's")
        w(f"SRC=$ROOT/src/{source.get('archive_prefix')}")
        if source.get("git_bundle"):
            w(f"#    (optional git history: git clone -b {source.get('branch')} {source['git_bundle']} repo)")
    w("")
    w("# 2. prepare the run dir (CPU only; must end with PREPARE_OK)")
    sets = []
    if config.get("data_root"):
        sets.append("--set data_root=/YOUR/DATA_ROOT")
    for label in config.get("external_files", {}):
        sets.append(f"--set external_files.{label}=/YOUR/PATH")
    sets.append(f"--set num_workers={config.get('num_workers', 0)}")
    code_arg = " --code-dir $SRC" if source.get("archive") else ""
    w(f"torchrelay prepare . --run-dir $RUN_DIR {' '.join(sets)}{code_arg} --check-files")
    w("#    --copy-mode hardlink: skip the copy when the run dir is on the same filesystem as the bundle.")
    w("")
    w(f"# 3. resume: the same launch command as the original run, {world} rank(s), in $RUN_DIR")
    w(f"TORCHRELAY_RUN_DIR=$RUN_DIR torchrun --nproc_per_node={world} $SRC/<your training script> ...")
    w("```\n")

    w("## What to expect\n")
    w(
        "- `prepare` prints `PREFLIGHT: PASS` (contract, schedule gate, checkpoint inventory, latest selection, "
    )
    w(
        "  external files, manifest fingerprint), then `PREPARE_OK`. `REBASE_RECORD.json` records every change; "
    )
    w("  originals are kept as `*.orig`.")
    w(
        f"- At launch every rank prints `SCHEDULE_GATE_PASS ({total}, {fields.get('schedule.warmup_updates')})` "
        f"and `TRAINING_CONTRACT {contract['sha256']}`. The first logged update is {update + 1:,}."
    )
    w(
        f"- Checkpoints every {config.get('save_every')} updates; training ends at update {total:,} with "
        f"{checkpoint_name(total)}/."
    )
    w("- Clean stop at any time: `torchrelay stop $RUN_DIR`; to continue, re-run step 3.")
    w(
        "- The source run refuses to continue from this checkpoint (HANDED_OFF.json): it continues here only.\n"
    )

    w("## Contents\n")
    w("| Path | What |\n|---|---|")
    w(f"| {info['checkpoint']}/ | complete training state for {world} rank(s) |")
    w("| config.json, resume_contract.json | the resolved configuration and the contract |")
    w("| data/manifest.jsonl | the exact training manifest (paths under the original data root) |")
    w("| data/manifest_info.json, data/training_progress.json | manifest identity; progress at the stop |")
    if source.get("archive"):
        extra = f", {source['untracked']} (files git did not track)" if source.get("untracked") else ""
        extra += f", {source['git_bundle']}" if source.get("git_bundle") else ""
        w(f"| source/ | {source['archive']} (exact code){extra}, {source.get('manifest')} |")
    w(f"| train/ | per-rank metrics and exposures for updates 1–{update:,}, which the resume needs |")
    w("| history.jsonl | one record per launch segment |")
    w("| bundle.json | lineage, source run, proofs |")
    w("| SHA256SUMS | SHA-256 of every file |\n")

    w("## History\n")
    if not history:
        w("No segments recorded.")
    for seg in history:
        listed = seg.get("hosts")
        hosts = ", ".join(map(str, listed)) if isinstance(listed, list) else str(listed or "")
        hosts = hosts or "?"
        job = seg.get("job")
        first_u, last_u = seg.get("first_update"), seg.get("last_update")
        ran = (
            "no update" if isinstance(first_u, int) and isinstance(last_u, int) and last_u < first_u else None
        )
        w(
            f"- segment `{seg.get('segment')}` ({'job ' + str(job) if job else 'no job id'}, {hosts}, "
            f"{seg.get('world_size')} rank(s)): {ran or f'updates {first_u}–{last_u}'}, "
            f"started {_when(seg.get('started'))}, ended `{seg.get('ended')}`"
            + (f"; numerics {describe(seg['numerics'])}" if isinstance(seg.get("numerics"), dict) else "")
        )
    if any(isinstance(seg.get("numerics"), dict) for seg in history):
        w(
            "\nA continuation ends bit for bit like the uninterrupted run only under the same numerics (processor "
            "and the capability torch dispatches, math libraries, GPU, CUDA libraries, TF32 and determinism); "
            "`prepare` and the launch warn when they differ (docs/NUMERICS.md)."
        )
    for warning in info.get("warnings", []):
        w(f"\n**Warning:** {warning}")
    w("")
    return "\n".join(out)
