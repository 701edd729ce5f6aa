"""tests/xdist_order.py: the suite's long modules go to the two workers first."""

from __future__ import annotations

from collections import OrderedDict

from helpers import REPO
from xdist_order import HEAVY, heavy_first_order


def test_the_long_modules_go_first_in_their_order_and_the_rest_keep_theirs() -> None:
    queue = OrderedDict((name, {}) for name in ("tests/test_a.py", HEAVY[2], "tests/test_b.py", HEAVY[0]))
    heavy_first_order(queue)
    assert list(queue) == [HEAVY[0], HEAVY[2], "tests/test_a.py", "tests/test_b.py"]


def test_every_long_module_named_exists() -> None:
    """A module renamed or split would silently lose its place at the front."""
    assert [name for name in HEAVY if not (REPO / name).is_file()] == []
