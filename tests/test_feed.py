"""The loop's Feed in one process: a sample that cannot be read is raised at once as one line (with no peer, there
is no exchange to wait for: run/loop.py, util/collective.py's Ranks.defer). The held failure of a rank with peers
is tested under torchrun (tests/test_rank_failures.py's "data" phase and its uncaught and killed endings)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from torchrelay.errors import PathError
from torchrelay.run.loop import Feed
from torchrelay.util import collective


def _batches() -> Iterator[tuple[list[int], Any]]:
    yield [0], "first"
    raise FileNotFoundError(2, "No such file or directory", "/data/s1.bin")


def test_a_sample_that_cannot_be_read_is_raised_at_once_by_a_process_alone() -> None:
    feed = Feed(_batches(), collective.Ranks(None))
    assert feed.next(1) == ([0], "first")
    with pytest.raises(PathError, match=r"^update 2: reading a sample: /data/s1.bin: No such file"):
        feed.next(2)
    assert not feed.failed and collective.take_deferred() is None  # nothing held for an exchange
