"""Second copies routed through their owners: a write that must survive a crash goes through util/durable.py (the
file and its folder fsynced), a file from elsewhere is opened by util/safepath.open_regular (a pipe refused, never
read), git is run with a deadline; and importing or configuring torchrelay changes nothing process-wide."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchrelay.checkpoint.inventory import INVENTORY_FORMAT
from torchrelay.errors import ConfigError, UnsafeInput
from torchrelay.util import durable
from torchrelay.util.hashing import sha256_file

REPO = Path(__file__).resolve().parents[1]


def _synced_dirs(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The folders fsynced from now on (the owner's fsync_dir, observed: a folder's fsync has no other trace)."""
    seen: list[Path] = []
    real = durable.fsync_dir

    def spy(path: Any) -> None:
        seen.append(Path(path))
        real(path)

    monkeypatch.setattr(durable, "fsync_dir", spy)
    return seen


def test_sha256sums_is_written_with_its_folder_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrelay.util.sums import SumEntry, read_sums, write_sums

    seen = _synced_dirs(monkeypatch)
    write_sums(tmp_path / "SHA256SUMS", [SumEntry("a.txt", "0" * 64)])
    assert read_sums(tmp_path / "SHA256SUMS") == [SumEntry("a.txt", "0" * 64)]
    assert tmp_path in seen and sorted(p.name for p in tmp_path.iterdir()) == ["SHA256SUMS"]


def test_an_audit_verdict_is_written_with_its_folder_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrelay.audit import verdict

    seen = _synced_dirs(monkeypatch)
    target = tmp_path / "AUDIT.json"
    verdict._write_json(target, {"b": 1, "a": [2]})
    assert target.read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert tmp_path in seen


def _one_tensor_checkpoint(tmp_path: Path) -> tuple[Path, Any, Path]:
    from torchrelay.checkpoint.dcp_metadata import read_metadata

    model = tmp_path / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: the point here
        dcp.save({"w": torch.arange(6.0)}, storage_writer=dcp.FileSystemWriter(str(model)), no_dist=True)
    (shard,) = model.glob("*.distcp")
    entry = {"path": f"model/{shard.name}", "sha256": sha256_file(shard)[0], "size": shard.stat().st_size}
    (tmp_path / "COMPLETE.json").write_text(json.dumps({"format": INVENTORY_FORMAT, "files": [entry]}))
    return model, read_metadata(model), shard


def _in_time(fn: Any, seconds: float = 20.0) -> BaseException | None:
    """Run `fn` on a thread; what it raised (None if it returned), failing the test if it is still running."""
    caught: list[BaseException | None] = []

    def call() -> None:
        try:
            fn()
            caught.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            caught.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert caught, "still blocked: a pipe in a checkpoint's place was opened for reading"
    return caught[0]


def test_a_pipe_in_place_of_a_tensor_file_is_refused_not_read(tmp_path: Path) -> None:
    """read_tensor (export's reader) and the verified load: a FIFO named as a DCP file is refused in one line; an
    open() of it would wait for a writer forever."""
    from torchrelay.checkpoint import dcp_io

    model, metadata, shard = _one_tensor_checkpoint(tmp_path)
    shard.unlink()
    os.mkfifo(shard)
    try:
        err = _in_time(lambda: dcp_io.read_tensor(model, metadata, "w"))
        assert isinstance(err, UnsafeInput) and "not a regular file" in str(err), err
        target = {"w": torch.zeros(6)}
        err = _in_time(lambda: dcp_io.load(target, model, no_dist=True, metadata=metadata))
        assert isinstance(err, UnsafeInput) and "not a regular file" in str(err), err
    finally:  # a reader left blocked on it (before the fix) is let go: a writer's open ends its wait
        with contextlib.suppress(OSError):
            os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))


def test_git_that_never_answers_is_given_up_on_naming_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrelay.handoff import source

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "git"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(source, "GIT_TIMEOUT_S", 0.5)
    with pytest.raises(ConfigError, match=r"`git cat-file` did not finish in 0\.5 s") as caught:
        source._git(tmp_path, "cat-file", "-e", "HEAD")
    assert str(tmp_path) in str(caught.value)


def test_the_global_quiet_flag_survives_verify_and_verify_has_its_own() -> None:
    from torchrelay.cli import build_parser

    parser = build_parser("verify")
    both = parser.parse_args(["-q", "verify", "bundle", "--quiet"])
    assert both.quiet and both.verify_quiet
    global_only = parser.parse_args(["-q", "verify", "bundle"])
    assert global_only.quiet and not global_only.verify_quiet
    own_only = parser.parse_args(["verify", "bundle", "--quiet"])
    assert not own_only.quiet and own_only.verify_quiet


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MPLBACKEND": ""}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_valid_configuration_installs_no_excepthook_and_a_refusal_is_still_one_line() -> None:
    ok = _python(
        "import sys\nhook = sys.excepthook\nimport torchrelay as tr\n"
        "tr.RelayConfig(seed=1, micro_batch=1, total_updates=2, manifest='m')\n"
        "tr.RelayConfig.from_dict({'seed': 1, 'micro_batch': 1, 'total_updates': 2, 'manifest': 'm'})\n"
        "assert sys.excepthook is hook, 'a valid RelayConfig changed sys.excepthook'\n"
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _python(
        "import torchrelay as tr\ntr.RelayConfig(seed=-1, micro_batch=1, total_updates=2, manifest='m')\n"
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert bad.stderr.startswith("torchrelay: config.seed: must be >= 0"), bad.stderr


def test_importing_the_report_chooses_no_matplotlib_backend() -> None:
    done = _python(
        "import matplotlib\nbefore = matplotlib.rcParams._get_backend_or_none()\n"
        "import torchrelay.report.plots\n"
        "assert matplotlib.rcParams._get_backend_or_none() == before, matplotlib.get_backend()\n"
        "import sys\nassert 'matplotlib.pyplot' not in sys.modules\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]
