"""A few SIGKILLs of the whole job (launcher, both ranks, loader workers), as benchmarks/bench_kill.py does hundreds:
inside saves, while the run is being created, between updates. Each next launch resumes from the newest complete
checkpoint, refuses nothing, leaves no temporary behind, and the run ends bit for bit with its ledger proved."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from bench_kill import Campaign  # noqa: E402


def test_whole_job_sigkilled_inside_saves_resumes_exactly(example: dict[str, Path], tmp_path: Path) -> None:
    camp = Campaign(
        tmp_path,
        example["code"],
        example["config"],
        sets={"save_every": 1, "num_workers": 1},
        # (where, n-th event of the launch, delay after it): creating the run, the first and third save's
        # first moments, the update after a commit
        plans=[("create", 1, 0.0), ("save", 1, 0.0), ("save", 3, 0.002), ("update", 2, 0.0)],
    )
    camp.run(kills=4)

    kills, ends = camp.kills, camp.ends
    assert len(kills) == 4 and len(ends) == 1, (kills, ends)
    assert sum(k.inside_save for k in kills) >= 2, kills
    for k in kills:
        assert k.next_outcome == "resumed" and not k.refusal, k
        assert k.resumed_from == k.committed and not k.corrupt_resume, k
        assert not k.leftovers and not k.lock_held_after, k
    assert any(k.left for k in kills), "no kill left a temporary: the cleanup was not exercised"
    end = ends[0]
    assert end.finished and end.kills == 4, end
    assert end.bit_exact and end.tensors_equal > 10 and end.logs_equal, end
    assert end.ledger_ok, end  # every sample exactly once, as many exposures as the uninterrupted run
    assert not end.temporaries_at_end, end
