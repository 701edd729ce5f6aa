"""Token streams (issue 51): windows of a uint16 token file as nanoGPT's get_batch draws them (with replacement) or
each once per epoch (without), a pure function of the seed and the draw's place in the stream; a 2-rank nanoGPT-
shaped run stopped and resumed with another worker count ends bit for bit as the uninterrupted one, reading the
windows the proven order derives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import assert_same_final_state, clean_env, launch, make_code_repo, metrics, segments
from torchrelay.cli import main
from torchrelay.data.sample import SampleContext
from torchrelay.data.tokens import TokenWindows, token_manifest, window_offset, window_offsets
from torchrelay.errors import ConfigError
from torchrelay.ledger.exposure import order_for, prove
from torchrelay.paths.rundir import RunDir


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_windows_with_and_without_replacement(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    manifest = token_manifest([tmp_path / "train.bin"], tmp_path / "m.jsonl", block_size=10)
    recs = _records(manifest)
    assert len(recs) == 99 and recs[3] == {
        "id": "train.bin:3", "path": str(tmp_path / "train.bin"), "tokens": 1000, "window": 3,
    }  # fmt: skip
    once = TokenWindows(recs, block_size=10, replacement=False)
    x, y, start = once[SampleContext(3, 5, 9, 1234)]
    assert start == 30 and x.tolist() == list(range(30, 40)) and y.tolist() == list(range(31, 41))
    drawn = TokenWindows(recs, block_size=10, replacement=True)
    offsets = [drawn[SampleContext(i, e, 1, 7)][2] for e in range(3) for i in range(99)]
    assert (
        all(0 <= o <= 1000 - 11 for o in offsets) and len(set(offsets)) > 200
    )  # spread, with repeats allowed
    assert offsets[:5] == [
        drawn.offset(SampleContext(i, 0, 99, 7)) for i in range(5)
    ]  # not the update: the place
    assert window_offset(7, 0, 0, 990) == offsets[0] != window_offset(8, 0, 0, 990)
    x, y, start = drawn[SampleContext(0, 0, 1, 7)]
    assert torch.equal(x, torch.arange(start, start + 10)) and torch.equal(y, x + 1)
    # the dataset pickles as paths: a loader worker maps the file itself
    assert "_maps" not in {k for k, v in drawn.__getstate__().items() if v}


def test_token_files_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ConfigError, match=r"odd\.bin: 7 bytes is no whole number of uint16 tokens"):
        token_manifest([tmp_path / "odd.bin"], tmp_path / "m.jsonl", block_size=2)
    (tmp_path / "short.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ConfigError, match=r"short\.bin: 4 tokens hold no window of block_size 4"):
        token_manifest([tmp_path / "short.bin"], tmp_path / "m.jsonl", block_size=4)
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    recs = _records(token_manifest([tmp_path / "t.bin"], tmp_path / "m.jsonl", block_size=4))
    np.arange(90, dtype=np.uint16).tofile(tmp_path / "t.bin")  # another file under the same name
    with pytest.raises(OSError, match=r"t\.bin: 90 uint16 tokens, the manifest says 100"):
        TokenWindows(recs, block_size=4, replacement=True)[SampleContext(0, 0, 1, 1)]


@pytest.mark.launch
def test_a_token_stream_run_resumes_bit_for_bit_with_another_worker_count(tmp_path: Path) -> None:
    code = make_code_repo(tmp_path / "code", scripts=("train_tokens.py",))
    data = tmp_path / "data"
    made = subprocess.run(
        [sys.executable, str(code / "train_tokens.py"), "--make-data", str(data)],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    sets = {"total_updates": 16, "params.eval_interval": 4}
    args = ("--data", str(data))
    whole = tmp_path / "whole"
    out = launch(code, whole, sets=sets, script="train_tokens.py", args=args)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    stopped = tmp_path / "stopped"
    assert main(["stop", str(stopped), "--before-start", "--at-update", "7"]) == 0
    out = launch(code, stopped, sets=sets, script="train_tokens.py", args=args)
    seg = segments(stopped)[-1]  # (torchrun's own exit is 1: the ranks' 4 is the segment's)
    assert (seg["ended"], seg["exit_code"], seg["last_update"]) == ("request", 4, 7), out.stderr[-3000:]
    out = launch(code, stopped, sets={"num_workers": 2}, script="train_tokens.py")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert segments(stopped)[-1]["runtime_changes"] == {"num_workers": [0, 2]}
    assert assert_same_final_state(whole, stopped, 16) > 0
    for rank in (0, 1):
        assert metrics(whole, rank) == metrics(stopped, rank)
    # every sample once, in order; and the windows each rank read are those the proven order derives
    report = prove(stopped)
    assert report.prefix_ok and report.repeats == 0 and report.skipped == 0
    order, manifest = order_for(RunDir(stopped))
    per_micro = 2 * 4  # world size x micro_batch
    for rank in (0, 1):
        for row in metrics(stopped, rank):
            offsets = [o for _, o in window_offsets(order, manifest.records, row["update"], block_size=64,
                                                    replacement=True)]  # fmt: skip
            mine = [
                o for m in range(2) for o in offsets[m * per_micro + rank * 4 : m * per_micro + rank * 4 + 4]
            ]
            assert row["window_sum"] == sum(mine), (rank, row)


def test_a_window_past_its_file_or_a_wrong_dtype_is_refused_naming_the_line(tmp_path: Path) -> None:
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "t.bin")
    # slots= beyond the 12 windows that fit: with replacement each slot is a draw; without, a short window
    recs = _records(token_manifest([tmp_path / "t.bin"], tmp_path / "m.jsonl", block_size=8, slots=14))
    assert TokenWindows(recs, block_size=8, replacement=True)[SampleContext(13, 0, 1, 1)][0].shape == (8,)
    once = TokenWindows(recs, block_size=8, replacement=False)
    assert once[SampleContext(11, 0, 1, 1)][2] == 88  # the last window that fits: tokens 88..96
    for line in (12, 13):
        with pytest.raises(ConfigError, match=rf"manifest line {line} \(t\.bin:{line}\): window {line} of "):
            once[SampleContext(line, 0, 1, 1)]
    wide = TokenWindows(
        _records(tmp_path / "m.jsonl")[:12], block_size=16, replacement=False
    )  # not the manifest's
    with pytest.raises(ConfigError, match=r"block_size 16 ends past the file's 100 tokens"):
        wide[SampleContext(6, 0, 1, 1)]
    # a uint32 file read as uint16 (TokenWindows' default): the dtype named, not "another file"
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "w.bin")
    recs = _records(token_manifest([tmp_path / "w.bin"], tmp_path / "w.jsonl", block_size=8, dtype="uint32"))
    with pytest.raises(
        ConfigError, match=r"w\.bin: 100 uint32 tokens as the manifest says, read as uint16"
    ) as err:
        TokenWindows(recs, block_size=8, replacement=True)[SampleContext(0, 0, 1, 1)]
    assert "dtype='uint32'" in str(err.value.hint)


def test_a_token_file_named_through_a_linked_data_root_stays_under_it(tmp_path: Path) -> None:
    storage = tmp_path / "storage" / "owt"
    storage.mkdir(parents=True)
    np.arange(100, dtype=np.uint16).tofile(storage / "train.bin")
    (tmp_path / "data").symlink_to(storage)  # data_root is the link, as on a cluster's /data -> /mnt/...
    recs = _records(token_manifest([tmp_path / "data" / "train.bin"], tmp_path / "m.jsonl", block_size=8))
    assert recs[0]["path"] == str(tmp_path / "data" / "train.bin")  # under data_root: prepare can re-point it
    rel = Path("data") / "train.bin"
    recs = _records(
        token_manifest([tmp_path / "data" / ".." / "data" / "train.bin"], tmp_path / "n.jsonl", block_size=8)
    )
    assert recs[0]["path"] == str(tmp_path / rel)
