"""Name the likely cause of a resumability difference from where and how the two runs part."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchrelay.paths.layout import checkpoint_name

if TYPE_CHECKING:  # only for annotations: keeps `import torchrelay.audit` free of torch for status
    from torchrelay.audit.compare import LogComparison, StreamComparison, TensorComparison

RNG = "RNG not restored"
DATA_ORDER = "data order not restored"
NONDETERMINISM = "non-deterministic kernels"
UNREGISTERED = "state not registered with torchrelay"
RANK_STATE = "state that differs by rank restored from one copy"
NOT_RESTORED = "state saved but not restored by its load_state_dict"
UNSEEDED = "random stream not seeded from the run's seed"
UNKNOWN = "unknown"
CAUSES = (RNG, DATA_ORDER, NONDETERMINISM, UNREGISTERED, RANK_STATE, NOT_RESTORED, UNSEEDED, UNKNOWN)

# Metric keys that a learning-rate schedule writes; a difference here first points at the scheduler.
LR_KEYS = ("lr", "learning_rate")

# Runs the uninterrupted launch a second time and says where it parts from the first (None: bit for bit equal).
Rerun = Callable[[], str | None]


@dataclass(slots=True)
class Cause:
    """A likely cause, why we think so, and what the user should do."""

    name: str
    evidence: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "evidence": self.evidence, "fix": self.fix}


@dataclass(slots=True)
class Evidence:
    """What the comparison found, in the terms the heuristics use."""

    stops: list[int]
    metrics: LogComparison
    ledger: LogComparison
    tensors: TensorComparison
    own_batches: LogComparison | None = None  # the probe's digests of the script's own DataLoaders
    own_samplers: list[str] = field(default_factory=list)
    streams: StreamComparison | None = None  # the probe's random-stream digests where segments began
    tensors_at: int | None = None  # the checkpoint `tensors` compares (the first that differs, else the last)
    final_equal: bool = True  # the last checkpoint's tensors are equal (a difference may have faded by then)
    digests: LogComparison | None = None  # the parameters' per-update digests (records/digests.py)

    @property
    def resumes(self) -> list[int]:
        """The first update of each continued segment."""
        return [stop + 1 for stop in self.stops]


FIXES = {
    RNG: "register every torch.Generator / numpy or python Random you draw from with run.track(name=...), "
    "or draw from the global RNGs torchrelay restores",
    DATA_ORDER: "feed the loop from run.dataloader(dataset) (the torchrelay sampler); do not shuffle in your own "
    "DataLoader or sampler",
    NONDETERMINISM: "call torch.use_deterministic_algorithms(True) and seed everything from the run's seed; "
    "a second uninterrupted run differs from the first",
    UNREGISTERED: "pass every object with state (LR scheduler, EMA, gradient scaler, counters) to run.track(...)",
    RANK_STATE: "let each rank save its own values: track the module or object with run.track(...) and have its "
    "state_dict() return this rank's values (not rank 0's, not a mean over ranks); torchrelay stores what differs "
    "between ranks once per rank (docs/FORMATS.md)",
    NOT_RESTORED: "make the object's load_state_dict(state) set every value its state_dict() returns",
    UNSEEDED: "seed it from the run's seed (torch.Generator().manual_seed(cfg.seed + rank), random.Random(seed)); "
    "do not reseed the global generators from the OS or the clock after Run.open (docs/LOOP.md)",
    UNKNOWN: "compare the first differing values named here; `torchrelay audit --keep` keeps both runs to look",
}


def _names(items: list[str], most: int = 4) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _cause(name: str, evidence: str) -> Cause:
    return Cause(name=name, evidence=evidence, fix=FIXES[name])


def _lost_state(streams: StreamComparison | None, update: int, parted_at: str) -> list[Cause]:
    """Causes from the state tensors (buffers, a tracked object's tensors) that the resumed run starts `update` with
    otherwise than the uninterrupted run; empty when there are none (or no probe)."""
    if streams is None or not streams.lost_tensors(update):
        return []
    lost = streams.lost_tensors(update)
    also_rng = (
        [_cause(RNG, f"and random stream(s) ({', '.join(sorted(set(streams.differing(update))))}) restarted")]
        if streams.differing(update)
        else []
    )
    split = streams.rank_divergent(update)
    if split:
        # The ranks held different values at the stop and the resume gave them others: the checkpoint kept one
        # copy for all ranks (what BatchNorm statistics under DDP suffered before they were stored per rank).
        on = sorted({rank for rank, name in lost if name in split})
        return [
            _cause(
                RANK_STATE,
                f"{parted_at}; {_names(split)} differ between the ranks of the uninterrupted run at the stop "
                f"(state that differs by rank), and the resumed run starts update {update} with other values of "
                f"them on rank(s) {', '.join(map(str, on))}: the checkpoint held one copy for all ranks",
            ),
            *also_rng,
        ]
    names = sorted({name for _, name in lost})
    return [
        _cause(
            UNREGISTERED,
            f"{parted_at}; {_names(names)} start update {update} in another state than in the uninterrupted "
            "run: this state was not restored (not tracked, a buffer with persistent=False, or a state_dict() "
            "that leaves it out)",
        ),
        *also_rng,
    ]


def _not_restored(ev: Evidence, parted_at: str) -> list[Cause]:
    """A registered stateful whose saved values differ at the first checkpoint after a resume while nothing else
    there does: it was saved (the checkpoint holds it) but its load_state_dict left it as the new process made it."""
    at = ev.tensors_at
    if at is None or at not in ev.resumes or ev.tensors.equal:
        return []
    names = [d.name for d in ev.tensors.differing]
    if not all(n.startswith("state/") for n in names):
        return []
    shown = [f"{d.name} ({d.note})" if d.note else d.name for d in ev.tensors.differing]
    holders = sorted({n.removeprefix("state/").split(".", 1)[0].split("@rank")[0] for n in names})
    return [
        _cause(
            NOT_RESTORED,
            f"{parted_at}; in {checkpoint_name(at)}, the first after a resume, only registered state differs: "
            f"{_names(shown)}, while every model and optimizer tensor is equal: the registered "
            f"{', '.join(holders)} saved these values and the resume did not bring them back",
        )
    ]


def _first_values(ev: Evidence) -> str:
    """The first differing values the comparison found, for a cause that the evidence cannot name."""
    shown = [
        f"{d.name} ({d.note})" if d.note else f"{d.name} by {d.max_abs:.3g}" for d in ev.tensors.differing
    ]
    at = f" in {checkpoint_name(ev.tensors_at)}" if ev.tensors_at is not None else ""
    parted = (
        f"; the parameters first part after update {ev.digests.first_update} (per-update digests)"
        if ev.digests is not None and not ev.digests.equal
        else ""
    )
    return parted + (f"; first differing values{at}: {_names(shown, 3)}" if shown else "")


def _lr_first(metrics: LogComparison) -> int | None:
    found = [metrics.first_by_key[k] for k in LR_KEYS if k in metrics.first_by_key]
    return min(found) if found else None


def _confirm_nondeterminism(rerun: Rerun | None, before: str) -> list[Cause] | None:
    """Run the uninterrupted run again when the evidence alone cannot tell; None when no rerun is possible."""
    if rerun is None:
        return None
    again = rerun()
    if again is None:
        return []
    return [
        _cause(
            NONDETERMINISM, f"{before}; a second uninterrupted run already differs from the first: {again}"
        )
    ]


def diagnose(ev: Evidence, rerun: Rerun | None = None) -> list[Cause]:
    """The likely causes, most likely first; empty when the runs are equal."""
    digests_equal = ev.digests is None or ev.digests.equal
    if ev.metrics.equal and ev.ledger.equal and ev.tensors.equal and digests_equal:
        return []  # a differing validation loader, say, does not make training differ
    first_stop = min(ev.stops) if ev.stops else None
    own = ev.own_batches
    parted = [
        c.first_update for c in (ev.metrics, ev.ledger, own) if c is not None and c.first_update is not None
    ]
    first = min(parted) if parted else None
    resumes = ev.resumes

    # 1. Parting before any stop cannot be caused by resuming: the two runs were still the same launch.
    if first is not None and first_stop is not None and first <= first_stop:
        where = f"the runs part at update {first}, before the first stop after update {first_stop}"
        unseeded = ev.streams.unseeded() if ev.streams is not None else []
        if unseeded:
            return [
                _cause(
                    UNSEEDED,
                    f"{where}; {_names(unseeded)} start update 1 in another state in two launches of the same "
                    "script: seeded from the OS's entropy (or the clock), so every launch draws other numbers",
                )
            ]
        if ev.streams is not None and ev.streams.seen(1):
            where += (
                "; every random stream the script holds and the global generators start update 1 in the same "
                "state in both launches"
            )
        confirmed = _confirm_nondeterminism(rerun, where)
        if confirmed:
            return confirmed
        if confirmed == []:
            return [
                _cause(
                    UNREGISTERED,
                    f"{where}, but a second uninterrupted run matches the first: something differs between the "
                    "launches themselves (a stop request read by the script, an environment-dependent setting)",
                )
            ]
        return [_cause(NONDETERMINISM, where)]

    # 2. Different samples: the loader did not resume where it stopped.
    if not ev.ledger.equal:
        at = ev.ledger.first_update
        when = "the first update after a resume" if at in resumes else f"update {at}"
        return [_cause(DATA_ORDER, f"the exposure ledgers part at {when} ({ev.ledger.detail})")]

    # 2b. torchrelay's ledger agrees, but the script trained on batches of its own loader, and those differ.
    if own is not None and not own.equal:
        at = own.first_update
        when = "the first update after a resume" if at in resumes else f"update {at}"
        kinds = ", ".join(ev.own_samplers) or "a sampler"
        return [
            _cause(
                DATA_ORDER,
                f"the batches of the script's own DataLoader ({kinds}) part at {when} ({own.detail}); "
                "torchrelay's ledger cannot see them, so their order was never saved",
            )
        ]

    # 3. Same samples, different learning rate: a schedule started over.
    lr_first = _lr_first(ev.metrics)
    if lr_first is not None and (first is None or lr_first <= first):
        when = "the first update after a resume" if lr_first in resumes else f"update {lr_first}"
        return [
            _cause(
                UNREGISTERED,
                f"the logged learning rate parts at {when} ({lr_first}) with equal ledgers: "
                "the LR scheduler (or what sets the LR) was not restored",
            )
        ]

    # 4. Same samples and LR, parting exactly where a segment began: hidden state started over. The probe's
    #    digests of the script's random streams there tell a restarted stream from non-random state.
    if first is not None and first in resumes:
        keys = ", ".join(ev.metrics.keys) or "metrics"
        parted_at = (
            f"{keys} part at update {first}, the first update after a resume, with equal ledgers and LR"
        )
        streams = ev.streams
        by_tensors = _lost_state(streams, first, parted_at) or _not_restored(ev, parted_at)
        if by_tensors:
            return by_tensors
        if streams is not None and streams.differing(first):
            held = sorted(set(streams.differing(first)))
            return [
                _cause(
                    RNG,
                    f"{parted_at}, and {len(streams.differing(first))} random stream(s) the script holds ({', '.join(held)}) "
                    f"start update {first} in another state than in the uninterrupted run: they restarted "
                    "instead of continuing",
                )
            ]
        if streams is not None and streams.seen(first):
            count = streams.at[first][0]
            same = (
                f"all {count} random stream(s) the script holds start it in the same state as in the "
                "uninterrupted run"
                if count
                else "the script holds no random stream besides the global ones torchrelay restores"
            )
            return [
                _cause(
                    UNREGISTERED,
                    f"{parted_at}, while {same}: non-random state read there (a counter, a running statistic, a cache) "
                    "was not restored",
                ),
                _cause(RNG, "or a random stream held outside the training processes (a DataLoader worker)"),
            ]
        return [
            _cause(
                RNG,
                f"{parted_at}: a random stream (a generator the script holds, an augmentation's) restarted "
                "instead of continuing",
            ),
            _cause(UNREGISTERED, f"or non-random state read at update {first} was not restored"),
        ]

    # 5. Parting later in a segment, or only in the saved tensors: rerun to separate noise from lost state.
    if first is not None:
        where = f"the runs part at update {first}, after a resume but not at one ({ev.metrics.detail})"
    elif ev.tensors.equal and ev.digests is not None and not ev.digests.equal:
        where = (
            f"the logs and the compared checkpoints agree, but {ev.digests.detail} (the per-update digests): "
            "the difference faded before the next compared checkpoint"
        )
    else:
        top = ev.tensors.differing[0]
        in_ckpt = f" in {checkpoint_name(ev.tensors_at)}" if ev.tensors_at is not None else ""
        faded = " (equal again in the last checkpoint: the difference faded)" if ev.final_equal else ""
        where = (
            f"the logs agree but {len(ev.tensors.differing)} tensor(s) differ{in_ckpt}, most {top.name} by "
            f"{top.max_abs:.3g}{faded}"
        )
    # The probe saw state tensors that a resume brought back otherwise (BatchNorm statistics, say, which change no
    # logged value while in training mode): that is the cause, no rerun needed.
    for resume in resumes:
        if first is None or resume <= first:
            by_tensors = _lost_state(ev.streams, resume, where)
            if by_tensors:
                return by_tensors
    by_values = _not_restored(ev, where)
    if by_values:
        return by_values
    confirmed = _confirm_nondeterminism(rerun, where)
    if confirmed:
        return confirmed
    if confirmed is None:  # no second run to tell lost state from a launch that does not repeat itself
        return [_cause(UNKNOWN, where + _first_values(ev))]
    return [_cause(UNREGISTERED, where + ": state that is used only later was not restored")]


def layout_dropout_cause(streams: StreamComparison | None, spread: str) -> dict[str, str] | None:
    """For a move to another world size that is outside its tolerance with the same samples: dropout, named only
    when the processes held a dropout module with p > 0 and an update drew from torch's generator (whose per-rank
    streams a move re-derives); None otherwise."""
    if streams is None or not streams.dropout:
        return None
    if streams.drawn is not None and not any(n == "torch" or n.startswith("cuda") for n in streams.drawn):
        return None
    drew = " and an update draws from torch's generator" if streams.drawn else ""
    return {
        "name": "per-rank random numbers",
        "evidence": f"{spread}; the ledger is the same, the model holds dropout ({_names(streams.dropout, 3)}){drew}: "
        "a rank's torch RNG is re-derived at a move, so dropout draws other masks",
        "fix": "draw dropout per sample with tr.sample_dropout (docs/ELASTIC.md), or set p to 0",
    }


def layout_unknown_cause(
    spread: str, first: list[str], equal: list[str], streams: StreamComparison | None
) -> dict[str, str]:
    """The plain answer when no cause fits the evidence: what differs first, what stayed bit-equal, what was ruled out."""
    ruled = []
    if streams is not None and streams.dropout == []:
        ruled.append("the model holds no dropout")
    if streams is not None and streams.drawn == []:
        ruled.append("no update draws from a global generator")
    return {
        "name": UNKNOWN,
        "evidence": f"{spread}; the ledger is the same; outside first: {_names(first, 3)}"
        + (f"; bit-equal: {_names(equal, 3)}" if equal else "")
        + (f"; {', '.join(ruled)}" if ruled else ""),
        "fix": FIXES[UNKNOWN],
    }
