"""Fixtures shared by the suite: the example's code repo and data, made once per session."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from handoff_fixtures import packed_fixture  # noqa: F401 - `packed`: here, so the session builds it once, not per module
from helpers import launch, make_code_repo, make_data, write_config
from s3_server import S3Server


@pytest.fixture(scope="session")
def example(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{'code': git repo with train_lm.py, 'root': data root, 'manifest': manifest, 'config': small config}."""
    base = tmp_path_factory.mktemp("example")
    code = make_code_repo(base / "code")
    root, manifest = make_data(base / "data")
    config = write_config(base / "lm.yaml", manifest, root)
    return {"base": base, "code": code, "root": root, "manifest": manifest, "config": config}


@pytest.fixture(scope="session")
def baseline(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's config trained uninterrupted on 2 ranks: the reference several modules compare against.
    Read it, never change it (copy it first)."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    out = launch(example["code"], run, config=example["config"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SCHEDULE_GATE_PASS (16, 2)" in out.stdout and "TRAINING_CONTRACT" in out.stdout
    return run


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real S3-compatible server (SeaweedFS, tests/s3_server.py) on 127.0.0.1 for the session; stopped at its end."""
    import s3_server as server_module

    server = server_module.start(tmp_path_factory.mktemp("s3-server"))
    try:
        yield server
    finally:
        server_module.stop(server)


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new bucket on the session's server, with this process's environment pointed at it (the AWS chain)."""
    import uuid

    import boto3

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    name = f"relay-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint).create_bucket(Bucket=name)
    return name


# Two tiers, each test's declared by its markers. The fast tier (`bash scripts/test.sh --fast`) runs the unmarked
# tests: they start no ranks. `launch` declares a test that starts ranks (torchrun or `python -m
# torch.distributed.run`, the demo, ranks of torch.multiprocessing.spawn, a script that launches them); `slurm` a test
# that launches a Slurm job (its fixture first starts the daemons: 10-12 s); `full` a test that launches no rank but
# starts heavy real processes of its own (a rank's loader workers taking signals: 35 s; a fresh interpreter importing
# transformers or DeepSpeed's op: 20-90 s); `s3` a test that needs the session's S3 server (tests/s3_server.py:
# SeaweedFS, 4-15 s to start). The fast tier deselects all four before they start; the full suite runs everything
# and stays the proof. The declaration is checked in both: an unmarked test that launches ranks fails, naming the
# marker it needs, so no test lands in the wrong tier unnoticed.
_LAUNCHERS = ("torchrun", "torch.distributed.run", "sbatch", "srun", "demo.sh", "demo.py")


# The suite runs on two pytest-xdist workers, a file per worker at a time (`-n 2 --dist loadfile`: a file's tests,
# its module fixtures' launches and Slurm's jobs stay on one worker), then the tests marked `alone` with nothing
# beside them (scripts/test.sh): test_controller's deadlines (the memory guard's 60 s kill, the budget's stop) failed
# under `-n 2` on a 2-core machine at load 14. `--dist loadgroup` would group nothing on pytest 9.2
# (pytest-xdist#1386). The files go out longest first (tests/xdist_order.py).


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist_order import heavy_first

    return heavy_first(config, log)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="the fast tier: only the tests with no tier marker (launch, slurm, full, s3)",
    )


def _launches(args: Any) -> bool:
    words = [os.fsdecode(w) for w in ([args] if isinstance(args, str | bytes | os.PathLike) else list(args))]
    if any(name in w for w in words for name in _LAUNCHERS):
        return True
    # a torchrelay process that launches one itself: `python -m torchrelay launch|audit ...`
    return "torchrelay" in words and bool({"launch", "audit"} & set(words))


def pytest_configure(config: pytest.Config) -> None:
    # Tests that keep an audit's verdicts out of the real ~/.cache point XDG_CACHE_HOME at a temporary directory, and
    # torch looks for compiled extensions under it too: the ranks of such a test (the zoo's cpu_adam member) would
    # compile DeepSpeed's CPU Adam again, from scratch (76 s on an idle 2-core VM), instead of loading the op
    # scripts/env.sh built. Pinned here, before any test changes XDG_CACHE_HOME, to where the build went (torch's
    # own answer, its per-Python and accelerator folder included: the name "" is the folder itself).
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        from torch.utils.cpp_extension import _get_build_directory

        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.normpath(_get_build_directory("", verbose=False))
    config.addinivalue_line("markers", "full: starts heavy real processes (no rank): in the full suite only")
    config.addinivalue_line(
        "markers", "s3: needs the session's real S3 server (tests/s3_server.py): full suite only"
    )
    config.addinivalue_line(
        "markers", "xdist_group(name): the tests pytest-xdist runs on one worker, in order"
    )
    config.addinivalue_line("markers", "launch: starts ranks (torchrun, spawn, the demo): the launch tier")
    config.addinivalue_line(
        "markers",
        "alone: timing-sensitive: scripts/test.sh runs it after the two workers, with nothing beside it",
    )
    real_popen = subprocess.Popen.__init__

    def checked_popen(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
        if _launches(args):
            _require_launch_mark("launches torchrun")
        real_popen(self, args, *a, **kw)

    # for the whole session, so a session fixture's launch (the shared baseline run) is its first user's
    subprocess.Popen.__init__ = checked_popen  # type: ignore[method-assign]
    import torch.multiprocessing

    real_spawn = torch.multiprocessing.spawn

    def checked_spawn(*a: Any, **kw: Any) -> Any:
        _require_launch_mark("spawns ranks")
        return real_spawn(*a, **kw)

    torch.multiprocessing.spawn = checked_spawn  # type: ignore[assignment]


_TIER_MARKS = ("launch", "slurm", "full", "s3")
_running: list[pytest.Item] = []  # the test being run (its setup, call and teardown)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()


def _require_launch_mark(what: str) -> None:
    """Fail the running test if it starts ranks without declaring it (outside a test: nothing to check)."""
    if _running and not any(_running[-1].get_closest_marker(m) for m in _TIER_MARKS):
        pytest.fail(
            f"{_running[-1].nodeid} {what} but is not marked: add @pytest.mark.launch (or a module-level "
            "`pytestmark = pytest.mark.launch`), so the fast tier leaves it out (tests/conftest.py)",
            pytrace=False,
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--fast"):
        return
    for item in items:
        if item.get_closest_marker("launch"):
            item.add_marker(pytest.mark.skip(reason="fast tier: this test starts ranks (marked launch)"))
        elif item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.skip(reason="fast tier: this test launches a Slurm job"))
        elif item.get_closest_marker("s3"):
            item.add_marker(pytest.mark.skip(reason="fast tier: this test needs the S3 server (marked s3)"))
        elif item.get_closest_marker("full"):
            item.add_marker(
                pytest.mark.skip(reason="fast tier: this test starts heavy processes (marked full)")
            )
