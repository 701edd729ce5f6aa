"""The stop agreement: at a boundary each rank proposes a stop code from the policies (request file, signal,
budget/deadline, memory: see policy/stop.py) and one all-reduce agrees on it, so that every rank stops after the same
update. Boundaries are spaced adaptively so that agreeing costs under 0.1 % of update time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from torchrelay.config import envvars
from torchrelay.log import logger
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.stop import SignalFlag, StopContext, StopRequest, decide, is_stale
from torchrelay.util import collective


class StopAgreement:
    """One rank's side of the agreement; created on every rank at the same point (it creates a process group)."""

    def __init__(
        self,
        run: RunDir,
        *,
        rank: int,
        world_size: int,
        total_updates: int,
        deadline: float | None,
        save_estimate: Callable[[], float],
        notes: list[str],
    ) -> None:
        self._run = run
        self._rank = rank
        self._distributed = world_size > 1
        self._total = total_updates
        self._deadline = deadline
        self._save_estimate = save_estimate  # the saver's: a stop must leave time to commit what it saves
        self._notes = notes  # the segment's notes, shared with the Run
        self._margin = float(envvars.MARGIN_S.get())
        self._max_interval = int(envvars.CHECK_EVERY.get())
        self.job = os.environ.get("SLURM_JOB_ID")
        self.why = ""  # the policy's reason for the agreed stop, when this rank proposed it
        self._request_cache: tuple[tuple[int, int], StopRequest | None] | None = None
        self._stale_reported = False
        self._seconds = 0.0  # what one agreement costs (moving average)
        self._signals = SignalFlag()
        self._signals.install()
        # The training thread's gloo group of the failure protocol: CPU-only, so that a CUDA run never
        # synchronizes its stream to agree, and a rank whose proposal failed joins this very all-reduce.
        self._ranks = collective.ranks()

    def at(self, done: int, recent: Sequence[float]) -> tuple[int, int]:
        """The stop code agreed after update `done` (0: go on) and the number of updates to the next boundary;
        a rank that could not propose (its request file refused, say) fails the agreement on every rank."""
        if not self._distributed:
            return self._propose(done, recent)
        t0 = time.perf_counter()

        def propose() -> tuple[int, int]:
            code, interval = self._propose(done, recent)
            return code, -interval

        code, neg_interval = self._ranks.agree_max(f"the stop agreement after update {done}", propose)
        spent = time.perf_counter() - t0
        self._seconds = spent if not self._seconds else 0.8 * self._seconds + 0.2 * spent
        return code, -neg_interval

    def _propose(self, done: int, recent: Sequence[float]) -> tuple[int, int]:
        """This rank's stop code and the number of updates until the next agreement.

        Agreeing costs one small all-reduce; when updates are short the ranks agree every few updates, so
        that agreement stays under 0.1 % of update time and a stop lands within about a second.
        """
        update_s = max(recent) if recent else 0.0
        interval = 1
        if update_s > 0 and self._seconds > 0:
            interval = math.ceil(self._seconds / (0.001 * update_s))
            interval = max(1, min(interval, int(1.0 / update_s) or 1, self._max_interval))
        request = self._read_request() if self._rank == 0 else None
        if (
            request is not None
            and request.at_update is not None
            and request.at_update > done
            and not is_stale(request, self.job)
        ):
            interval = min(interval, request.at_update - done)  # land exactly on the requested update
        interval = min(interval, max(1, self._total - done))
        return self._local_stop_code(done, update_s, interval, request), interval

    def _local_stop_code(self, done: int, update_s: float, interval: int, request: StopRequest | None) -> int:
        """This rank's stop proposal at an agreement boundary; only rank 0 reads the request file."""
        if request is not None and request.note and request.note not in self._notes:
            logger.warning(f"[torchrelay] {request.note}")
            self._notes.append(request.note)
        if request is not None and is_stale(request, self.job):
            if not self._stale_reported:
                note = f"ignored stale stop request for job {request.job} (this job: {self.job})"
                logger.warning(f"[torchrelay] {note}")
                self._notes.append(note)
                self._stale_reported = True
            request = None
        ctx = StopContext(
            updates_done=done,
            now=time.time(),
            job=self.job,
            request=request,
            signal_name=self._signals.received,
            deadline=self._deadline,
            update_seconds=update_s,
            save_seconds=self._save_estimate(),
            margin_seconds=self._margin,
            updates_to_next_check=interval,
        )
        verdict = decide(ctx)
        if verdict is None:
            return 0
        self.why = verdict.why
        return verdict.code

    def _read_request(self) -> StopRequest | None:
        path = self._run.request_stop_path
        try:
            st = os.lstat(path)  # a link is a request StopRequest.read refuses to follow, not its target
        except FileNotFoundError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        if self._request_cache is None or self._request_cache[0] != key:
            self._request_cache = (key, StopRequest.read(path))
        return self._request_cache[1]

    def consume_request(self, archive: Path) -> None:
        """Rank 0, after a stop the request asked for: move the request file into `archive`, so that the next
        launch does not stop at once."""
        src = self._run.request_stop_path
        if os.path.lexists(src):
            archive.mkdir(parents=True, exist_ok=True)
            os.replace(src, archive / f"REQUEST_STOP-{int(time.time() * 1000)}.json")

    def close(self) -> None:
        """Put back the signal handlers this agreement chained."""
        self._signals.restore()
