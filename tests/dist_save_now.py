"""Run under torchrun (2 ranks, gloo) by test_save_now_agreement.py: what step.save_now agrees when the ranks
ask differently. Prints one `CHECK name ok|FAIL detail` line per property; the test reads them."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from torchrelay.errors import RelayError
from torchrelay.run import Step
from torchrelay.util import collective

failures = 0


def check(name: str, ok: bool, detail: str = "") -> None:
    global failures
    failures += not ok
    print(f"CHECK {name}@{dist.get_rank()} {'ok' if ok else 'FAIL ' + detail}", flush=True)


def step(update: int) -> Step:
    return Step(update, iter([([0], torch.zeros(1))]), 1)


def alone() -> None:
    """Only rank 0 calls step.save_now (rank 1 goes on, to its next update's collectives): rank 0 waits out
    TORCHRELAY_COLLECTIVE_TIMEOUT_S and says what to check first."""
    dist.init_process_group("gloo")
    collective.ranks()  # the protocol's group, made by every rank (a collective itself)
    if dist.get_rank() == 1:
        time.sleep(8)
        sys.exit(0)
    try:
        step(5).save_now(True, "only rank 0")
        check("one_rank_alone_is_refused", False, "it returned")
    except RelayError as err:
        check(
            "one_rank_alone_is_refused",
            "step.save_now in update 5: rank 0 lost its peers" in err.message
            and "call it on every rank in the same update" in str(err.hint),
            str(err),
        )
    sys.exit(1 if failures else 0)


def main() -> None:
    if sys.argv[1:] == ["alone"]:
        return alone()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    s = step(1)  # only rank 1 asks; each rank names its own value: rank 1's reason is the one recorded
    agreed = s.save_now(rank == 1, f"best loss on rank {rank}")
    check("reason_of_the_asking_rank", agreed and s.saving == "best loss on rank 1", repr(s.saving))

    s = step(2)  # a 0-d tensor and a numpy bool as `wanted`
    a = s.save_now(torch.tensor(rank == 0), "tensor")
    b = s.save_now(np.bool_(False), "numpy")
    check("tensor_and_numpy_bool", a and b and s.saving == "tensor", repr(s.saving))

    s = step(3)  # asked twice in one update: the first agreed reason stays
    s.save_now(rank == 0, "first")
    s.save_now(rank == 1, "second")
    check("twice_keeps_the_first", s.saving == "first", repr(s.saving))

    s = step(4)  # nobody asks
    check("nobody_asks", s.save_now(False, f"r{rank}") is False and s.saving is None, repr(s.saving))
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
