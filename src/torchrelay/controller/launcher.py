"""One attempt of a plan: preflight → smoke → formal run in the same allocation, budget-aware and supervised.

The outcome comes from the run directory, not from torchrun's exit status (torchrun turns any worker's non-zero
exit into its own 1): the segment this attempt started in history.jsonl says how it ended, and that maps to the
controller's exit code — 0 finished, 3 budget, 4 request, 5 signal, 6 memory, 1 crash or error, 2 refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from torchrelay.checkpoint.node_tiers import at_controller_end
from torchrelay.checkpoint.retention import unpreserved
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.config import envvars
from torchrelay.config.relay import stored_config
from torchrelay.controller.argv import training_argv
from torchrelay.controller.attempts import Attempt, Attempts, Outcome, describe_fallback
from torchrelay.controller.console import LaunchConsole
from torchrelay.controller.memguard import MemoryLimits
from torchrelay.controller.plan import Plan, load_plan
from torchrelay.controller.preflight import PreflightReport, check_disk, run_preflight, visible_devices
from torchrelay.controller.smoke import SmokeFailed, discard, evaluate, smoke_overrides
from torchrelay.controller.supervisor import (
    SignalRelay,
    Supervised,
    Supervisor,
    first_update_done,
    last_logged_update,
    segment_ended,
)
from torchrelay.controller.validation import ValidationSpec, export_options, validate_checkpoints
from torchrelay.errors import (
    EXIT_BUDGET,
    EXIT_ERROR,
    EXIT_FINISHED,
    EXIT_MEMORY,
    EXIT_REFUSED,
    EXIT_SIGNAL,
    RelayError,
)
from torchrelay.paths.layout import checkpoint_name
from torchrelay.paths.lock import RunLock
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.costmodel import CostModel, Measurements, earliest
from torchrelay.policy.stop import write_request
from torchrelay.records.ended import CLEAN_STOPS, exit_code_of
from torchrelay.records.history import read_history, upsert
from torchrelay.records.train import metrics_path
from torchrelay.util.safepath import open_writable
from torchrelay.util.shown import shown

# Variables the controller sets itself for each stage; inherited values must not leak into a stage.
STAGE_VARS = ("TORCHRELAY_RUN_DIR", "TORCHRELAY_OVERRIDES", "TORCHRELAY_DEADLINE", "TORCHRELAY_BUDGET_S")
FORMAL_GRACE_S = 15.0
_TORCHRUN_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")


@dataclass(kw_only=True, slots=True)
class LaunchRequest:
    """A `torchrelay launch`: the plan file, its `--set` overrides and the time limits."""

    plan_path: Path
    sets: dict[str, Any] = field(default_factory=dict)
    deadline: float | None = None  # unix seconds
    budget_s: float | None = None  # seconds from `started`
    started: float | None = (
        None  # unix time the command started (None: now); `torchrelay launch` passes its own
    )
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    clock: Callable[[], float] = time.time
    time_left: Callable[[str], float | None] | None = None  # job id -> end time; default asks squeue
    # devices per node this allocation has (`--devices`); None: the GPUs CUDA sees (none: the primary plan runs)
    devices: int | None = None
    # `--reshard`: the formal run may continue the run on another world size (the plan's train.reshard)
    reshard: bool = False


class Controller:
    """Runs one attempt; `run()` returns its Outcome (also written to outcome.json)."""

    def __init__(
        self, request: LaunchRequest, console: Console | None = None, plan: Plan | None = None
    ) -> None:
        self.req = request
        self.show = LaunchConsole(console)
        self.plan: Plan = plan or load_plan(request.plan_path, request.sets)
        self.attempts = Attempts(self.plan.run)
        self.job = request.env.get("SLURM_JOB_ID") or None
        self.relay = SignalRelay()

    # ------------------------------------------------------------------------------------------ the stages
    def run(self) -> Outcome:
        started = self.req.clock()
        # A budget counts from the command's start: the seconds of importing and loading the plan are the user's.
        deadline = self._deadline(started if self.req.started is None else min(started, self.req.started))
        attempt, diff = self.attempts.start(self.plan.to_dict(), self.req.sets)
        left_s = deadline - self.req.clock() if deadline is not None else None
        self.show.attempt(self.plan.name, attempt.number, attempt.path, diff, left_s)
        fallback = self.plan.fallback_of
        if fallback:
            attempt.write_json("fallback.json", fallback)
            attempt.note(describe_fallback(fallback))
            self.show.fallback(describe_fallback(fallback))
        before = _saved_update(self.plan.run)
        outcome = Outcome(
            exit_code=EXIT_ERROR,
            ended="error",
            stage="preflight",
            started=started,
            job=self.job,
            fallback=dict(fallback),
        )
        outcome.updates_before = outcome.updates_after = before
        with self.relay:
            try:
                outcome = self._stages(attempt, outcome, deadline)
            except RelayError as exc:
                outcome.exit_code = exc.exit_code
                outcome.ended = "refused" if exc.exit_code == EXIT_REFUSED else "error"
                outcome.message = str(exc)
        if not self.plan.train.uses_srun:  # one node: its memory tier is here (several: the epilog's, docs)
            with contextlib.suppress(RelayError, OSError):
                for line in at_controller_end(self.plan.run_path):
                    outcome.notes.append(line)
                    self.show.warning(shown(line))
        outcome.stopped = self.req.clock()
        outcome.updates_after = max(outcome.updates_after, _saved_update(self.plan.run))
        attempt = self.attempts.settle(attempt) or attempt
        attempt.finish(outcome)
        self.show.outcome(attempt, outcome)
        return outcome

    def _stages(self, attempt: Attempt, outcome: Outcome, deadline: float | None) -> Outcome:
        plan = self.plan
        report = run_preflight(plan, self._env({}), on_result=self.show.check)
        attempt.write_json("preflight.json", report.to_list())
        if self._interrupted(outcome, "before the smoke run"):
            return outcome
        total = _total_updates(plan.run)
        if total is not None and _saved_update(plan.run) >= total:
            # Nothing to train: a launch of a complete run only does what is left after training (validation).
            self.show.complete(total)
            attempt.note(f"the run was complete ({checkpoint_name(total)}) before this attempt")
            outcome.exit_code, outcome.ended, outcome.stage = EXIT_FINISHED, "finished", "done"
            return self._validate(outcome, deadline)
        self._warn_unpreserved(attempt)

        outcome.stage = "smoke"
        measurements = self._measurements(attempt)
        if measurements is None:
            measurements = self._smoke(attempt, outcome)
            if measurements is None:
                return outcome
            check_disk(
                plan.run_path,
                measurements.checkpoint_bytes,
                plan.preflight.checkpoints_ahead,
                PreflightReport(),
            )
        if self._interrupted(outcome, "after the smoke run"):
            return outcome

        outcome.stage = "formal"
        cost = CostModel(measurements=measurements, margin_s=plan.budget.margin_s)
        decision = cost.decide(deadline, self.req.clock())
        self.show.cost(decision.why)
        if not decision.go:
            outcome.exit_code, outcome.ended = EXIT_REFUSED, "refused"
            outcome.message = f"not enough time to start the formal run: {decision.why}"
            return outcome
        return self._validate(self._formal(attempt, outcome, cost, deadline), deadline)

    def _validate(self, outcome: Outcome, deadline: float | None) -> Outcome:
        """The validation stage: after a formal run that finished or stopped cleanly, in the time that is left."""
        plan, spec = self.plan, self.plan.validate
        if not spec.run or outcome.ended not in ("finished", "budget", "request"):
            return outcome
        # After a stop signal nothing starts, but what is left is still recorded (and requeued for).
        outcome.stage = "validate"
        self.show.validation_start(spec.run)
        request = ValidationSpec(
            command=spec.run,
            updates=spec.update_list,
            cwd=plan.work_path,
            env=self._env(spec.env),
            timeout_s=spec.timeout_s,
            estimate_s=spec.estimate_s,
            export=export_options(spec.export, plan.work_path),
        )
        try:
            report = validate_checkpoints(
                plan.run_path,
                request,
                deadline=deadline,
                margin_s=plan.budget.margin_s,
                should_stop=lambda: self.relay.stopped,
                on_event=self.show.validation,
                clock=self.req.clock,
            )
        except RelayError as exc:  # the training's outcome stands; the checkpoints stay to validate
            outcome.notes.append(f"validation could not run: {exc.message}")
            self.show.validation_failed_to_run(exc)
            return outcome
        outcome.validation = report.to_dict()
        for update, why in sorted(report.missing.items()):
            self.show.validation_missing(update, why)
        if report.failed:
            outcome.notes.append(
                f"validation failed for checkpoint(s) {report.failed} (see RUN_DIR/validation/)"
            )
        if report.left:
            left = ", ".join(checkpoint_name(u) for u in sorted(report.left))
            why = next(iter(report.left.values()))
            outcome.notes.append(f"validation left for the next launch: {left} ({why})")
            self.show.validation_left(left, why)
            if outcome.ended == "finished":  # the work is not done: a batch script requeues on 3 and 5
                outcome.exit_code = EXIT_SIGNAL if self.relay.stopped else EXIT_BUDGET
                outcome.message = f"training finished; validation of {left} left for the next launch ({why})"
        elif outcome.ended == "finished":
            outcome.stage = "done"
        return outcome

    def _warn_unpreserved(self, attempt: Attempt) -> None:
        """Updates the plan validates that the run's retention will not keep until the validation stage."""
        spec = self.plan.validate
        if not spec.run or spec.update_list is None:
            return
        try:
            cfg = stored_config(self.plan.run).with_overrides(self.plan.train.overrides)
        except RelayError:
            return  # a new run: its configuration is the training script's until it starts
        unsure = unpreserved(cfg, spec.update_list)
        if unsure:
            note = (
                f"validate.updates {unsure} are not in the run's keep_updates or keep_every: retention may delete "
                "them before the validation stage (add them to keep_updates, a runtime field)"
            )
            attempt.note(note)
            self.show.warning(note)

    def _measurements(self, attempt: Attempt) -> Measurements | None:
        """Measurements to use without a smoke run, or None: run the smoke."""
        smoke, budget = self.plan.smoke, self.plan.budget
        if smoke.when == "first":
            previous = self.attempts.latest_measurements()
            if previous is None:
                return None
            m = Measurements.from_dict(previous)
            self.show.smoke_skipped(f"(when: first); using the {m.source} measurements of an earlier attempt")
        elif smoke.when == "never":
            m = Measurements(update_s=budget.update_s, save_s=budget.save_s, startup_s=budget.startup_s)
            self.show.smoke_skipped("(when: never); using the plan's budget estimates")
        else:
            return None
        attempt.write_json("measurements.json", m.to_dict())
        return m

    def _smoke(self, attempt: Attempt, outcome: Outcome) -> Measurements | None:
        plan, smoke = self.plan, self.plan.smoke
        smoke_dir = attempt.smoke_dir
        smoke_run = RunDir(smoke_dir)
        overrides = smoke_overrides(plan.train.overrides, smoke.overrides, smoke.save_every)
        env = self._env({"TORCHRELAY_RUN_DIR": str(smoke_dir), "TORCHRELAY_OVERRIDES": json.dumps(overrides)})
        self.show.smoke_start(smoke.updates, plan.train.world_size, smoke_dir)
        requested = False

        def stop_at_updates() -> None:
            nonlocal requested
            if not requested and smoke_run.exists():
                write_request(smoke_dir, at_update=smoke.updates, reason="smoke")
                requested = True

        launched = self.req.clock()
        sup = self._supervisor(
            env, smoke_run, launched, on_poll=stop_at_updates, kill_at=launched + smoke.timeout_s
        )
        # A stop signal during the smoke is only recorded: the smoke ends by itself within a few updates, and its
        # measurements let the next attempt (e.g. the requeued job) skip it and spend its time on the formal run.
        # Its output (torchrun reports the planned stop as a failure) goes to a log; a failure quotes its tail.
        smoke_log = open_writable(attempt.path / "smoke.log", what="the smoke run's log", truncate=True)
        with os.fdopen(smoke_log, "w") as log:
            sup.output = log
            result = sup.run()
        if self._memory(outcome, result, attempt, "smoke"):
            return None
        try:
            measured = evaluate(smoke_run, launched, smoke.updates, result.returncode, result.tail)
        except SmokeFailed as exc:
            outcome.exit_code, outcome.ended, outcome.message = EXIT_ERROR, "smoke-failed", str(exc)
            return None
        finally:
            discard(smoke_run)
        m = measured.measurements
        attempt.write_json("measurements.json", m.to_dict())
        self.show.smoke_done(measured, m)
        return m

    def _formal(self, attempt: Attempt, outcome: Outcome, cost: CostModel, deadline: float | None) -> Outcome:
        plan = self.plan
        extra = {"TORCHRELAY_RUN_DIR": str(plan.run_path)}
        if plan.train.overrides:
            extra["TORCHRELAY_OVERRIDES"] = json.dumps(plan.train.overrides)
        training_deadline = cost.training_deadline(deadline)
        if training_deadline is not None:
            extra["TORCHRELAY_DEADLINE"] = f"{training_deadline:.3f}"
        if cost.measurements.save_s:
            extra["TORCHRELAY_SAVE_ESTIMATE_S"] = f"{cost.measurements.save_s:.3f}"
        if plan.train.reshard:
            extra[envvars.RESHARD.name] = "1"
            extra[envvars.RESHARD_BY.name] = f"{self._reshard_asker()}, attempt {attempt.number}"
            attempt.note(
                f"asked for a layout change: the run may continue on {plan.train.world_size} rank(s) with the same "
                f"global batch ({self._reshard_asker()})"
            )
        self.show.formal_start(plan.run_path, plan.train.world_size)
        launched = self.req.clock()
        # The training stops itself before the deadline; past it (plus a grace for the save) it is stopped.
        kill_at = None if deadline is None else deadline + FORMAL_GRACE_S
        sup = self._supervisor(self._env(extra), plan.run, launched, kill_at=kill_at)
        result = self._supervise(sup)
        attempt = self.attempts.settle(attempt) or attempt
        if result.signals:
            attempt.note(f"forwarded {', '.join(result.signals)} to the ranks")
        if self._memory(outcome, result, attempt, "formal"):
            if outcome.ended != "memory-killed":
                outcome.ended = self._ended_since(launched, result) or "memory"
                outcome.exit_code = exit_code_of(outcome.ended)
            self._note_history(launched, outcome.message, killed=outcome.ended == "memory-killed")
            return outcome
        outcome.ended = self._ended_since(launched, result)
        total = _total_updates(plan.run)
        if outcome.ended in CLEAN_STOPS and total is not None and _saved_update(plan.run) >= total:
            # A stop agreed at the last boundary: the run is complete; another job would only record that.
            attempt.note(f"stopped ({outcome.ended}) at its last update {total}: the run is complete")
            outcome.ended = "finished"
        outcome.exit_code = exit_code_of(outcome.ended)
        if outcome.ended == "finished":
            outcome.stage = "done"
        if result.killed:
            attempt.note(f"killed: {result.killed}")
        return outcome

    # ------------------------------------------------------------------------------------------ helpers
    def _reshard_asker(self) -> str:
        """Who allowed this attempt to move the run to another world size (the move's `asked_by`)."""
        if self.req.reshard:
            return "launch --reshard"
        if self.plan.fallback_of.get("in_place"):
            return f"launch fallback {self.plan.fallback_of.get('fallback')!r} (in place)"
        return "plan train.reshard"

    def _deadline(self, now: float) -> float | None:
        slurm_end = None
        if self.job:
            from torchrelay.controller import slurm

            ask = self.req.time_left or (lambda job: slurm.job_end_time(job))
            try:
                slurm_end = ask(self.job)
            except slurm.SlurmError as exc:
                # The warning signal still stops the run cleanly; say why the budget is not known.
                self.show.time_unknown(self.job, exc)
        budget_end = now + self.req.budget_s if self.req.budget_s is not None else None
        return earliest(self.req.deadline, budget_end, slurm_end)

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in self.req.env.items() if k not in STAGE_VARS}
        env.update(self.plan.train.env)
        env.update(extra)
        return env

    def _supervisor(
        self,
        env: dict[str, str],
        run: RunDir,
        launched: float,
        on_poll: Callable[[], None] = lambda: None,
        kill_at: float | None = None,
    ) -> Supervisor:
        run_dir = run.path
        plan = self.plan
        multi = plan.train.uses_srun
        limits = MemoryLimits.resolve(plan.memory, env=self.req.env)
        return Supervisor(
            argv=training_argv(plan, run_dir, limits, env),
            cwd=plan.work_path,
            env=env,
            run_directory=run,
            limits=None if multi else limits,  # on several nodes each node's agent guards its own memory
            poll_s=min(plan.memory.poll_s, 0.5),
            ranks_ready=first_update_done(run, launched),
            segment_ended=segment_ended(run, launched),
            on_poll=on_poll,
            forward_to="self" if multi else "children",
            kill_at=kill_at,
            job=self.job,
        )

    def _supervise(self, sup: Supervisor) -> Supervised:
        self.relay.current = sup
        try:
            return sup.run()
        finally:
            self.relay.current = None

    def _interrupted(self, outcome: Outcome, when: str) -> bool:
        if not self.relay.stopped:
            return False
        outcome.exit_code, outcome.ended = EXIT_SIGNAL, "signal"
        outcome.message = f"{', '.join(self.relay.received)} received {when}; the formal run was not started"
        return True

    def _memory(self, outcome: Outcome, result: Supervised, attempt: Attempt, stage: str) -> bool:
        if not result.memory:
            return False
        limits = MemoryLimits.resolve(self.plan.memory, env=self.req.env)
        peak = f"peak {result.peak_rss / 2**30:.2f} GiB ({limits.describe()})"
        if result.memory == "hard":
            outcome.exit_code, outcome.ended = EXIT_MEMORY, "memory-killed"
            outcome.message = f"memory guard killed the {stage} run: {result.killed}; {peak}"
        else:
            outcome.exit_code, outcome.ended = EXIT_MEMORY, "memory"
            outcome.message = f"memory guard asked the {stage} run to stop cleanly; {peak}"
        attempt.note(outcome.message)
        return True

    def _note_history(self, launched: float, note: str, *, killed: bool) -> None:
        """Add the guard's note to this attempt's history segment; a killed segment is closed as a crash."""
        mine = [s for s in read_history(self.plan.run_path) if float(s.get("started") or 0) >= launched - 1]
        if not mine:
            return  # killed before the run opened: the attempt's outcome is the record
        seg = mine[-1]
        seg["notes"] = [*seg.get("notes", []), f"host-memory guard: {note}"]
        if killed and seg.get("ended") == "running":
            # The ranks died without closing it; what they logged last is where the run stands.
            seg.update(ended="crash", exit_code=-9, stopped=self.req.clock())
            seg["last_update"] = last_logged_update(metrics_path(self.plan.run_path / "train", 0))
        upsert(self.plan.run, seg)

    def _ended_since(self, launched: float, result: Supervised) -> str:
        """How the segment this attempt started ended; 'finished', 'crash' or 'refused' when it wrote none."""
        mine = [s for s in read_history(self.plan.run_path) if float(s.get("started") or 0) >= launched - 1]
        if mine:
            ended = str(mine[-1].get("ended"))
            return "crash" if ended == "running" else ended
        codes = [int(c) for c in _TORCHRUN_EXIT.findall("\n".join(result.tail))]
        total = _total_updates(self.plan.run)
        if result.returncode == 0 and total is not None and _saved_update(self.plan.run) >= total:
            return "finished"  # a relaunch of a finished run records no segment
        if result.returncode == EXIT_REFUSED or EXIT_REFUSED in codes:
            return "refused"
        return "crash"


def _total_updates(run: RunDir) -> int | None:
    try:
        return stored_config(run).total_updates
    except RelayError:
        return None


def _saved_update(run: RunDir) -> int:
    """The update of the newest complete checkpoint: the progress that survives."""
    run_dir = run.path
    complete = [c.update for c in list_checkpoints(run_dir) if c.complete]
    return complete[-1] if complete else 0


def launch(request: LaunchRequest, console: Console | None = None) -> Outcome:
    """Run one attempt of the plan and return its outcome (exit code in `outcome.exit_code`).

    With fewer devices per node than the plan's train.nproc_per_node, the attempt runs the plan's first fallback
    that fits (a run of its own in its own run directory, or the same run continued in place), recorded in the
    attempt's fallback.json. `request.reshard` (or the plan's train.reshard) lets the formal run continue the run
    on another world size with the same global batch.
    One controller per run: a second launch of the same run directory is refused (RunBusy, exit 2) before it
    records an attempt or starts anything; so is a plan whose memory limits or run directory cannot be used.
    """
    plan = load_plan(request.plan_path, request.sets)
    if request.reshard:
        plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, reshard=True))
    devices = request.devices if request.devices is not None else visible_devices()
    plan = plan.for_devices(devices)
    # Everything that can refuse the plan before the lock and the attempt are written beside its run directory.
    MemoryLimits.resolve(plan.memory, env=request.env)
    plan.check_run_dir()
    with RunLock(plan.run_path, "launch"):
        return Controller(request, console, plan).run()
