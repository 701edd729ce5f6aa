"""The loop's Feed in one process: a sample that cannot be read is raised at once as one line (with no peer, there
is no exchange to wait for: run/loop.py, util/collective.py's Ranks.defer). The held failure of a rank with peers
is tested under torchrun (tests/test_rank_failures.py's "data" phase and its uncaught and killed endings)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torchrelay.errors import ConfigError, PathError
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


class _Refusing(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 1:
            raise ConfigError("manifest line 1 (t.bin:1): window 1 ends past the file", hint="write it again")
        return i


def test_a_refusal_raised_in_a_loader_worker_is_its_own_line_not_the_worker_s_traceback() -> None:
    loader = torch.utils.data.DataLoader(_Refusing(), batch_size=None, num_workers=1)
    feed = Feed((([i], b) for i, b in enumerate(loader)), collective.Ranks(None))
    assert feed.next(1) == ([0], 0)
    with pytest.raises(ConfigError) as err:
        feed.next(2)
    assert err.value.message == "update 2: manifest line 1 (t.bin:1): window 1 ends past the file"
    assert err.value.hint == "write it again" and err.value.exit_code == ConfigError.exit_code
    assert "Traceback" not in str(err.value)
