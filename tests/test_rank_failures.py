"""One rank fails, in each collective phase, and every rank exits at once with the same one line and the same
exit code (issue 19 defect 2, util/collective.py, docs/FAILURES.md).

One torchrun launch per world size (2 and 4 ranks, gloo) runs tests/dist_rank_failures.py: a failure injected on
one rank in opening, the verified load (`run.track`), the save's staging and its commit, the stop agreement, a data
file missing mid-update, and a validation and an export run on one rank; then, with 2 ranks, the missing data
file again, uncaught, ending every rank through its excepthook, and with 4 ranks one rank SIGKILLed while the
others wait for it.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from helpers import TORCHRUN, clean_env, run_tree, write_config

# every test here starts ranks: the launch tier (tests/conftest.py)
pytestmark = pytest.mark.launch

# phase -> (exit code every rank raises with, what the one line says)
EXPECTED = {
    "open": (
        2,
        "opening the run failed on rank {v}: {base}/open/train/metrics-rank{v}.jsonl: Permission denied",
    ),
    "track": (2, "loading checkpoint-2 failed on rank "),
    "save-staging": (1, "saving checkpoint-4 failed on rank {v}: Cannot allocate memory (injected)"),
    "save-commit": (1, "saving checkpoint-4 failed on rank {v}: OSError: [Errno 5] Input/output error"),
    "stop": (
        2,
        "the stop agreement after update 2 failed on rank {v}: injected: the stop policy could not decide",
    ),
    "data": (2, "training failed on rank {v}: update 4: reading a sample: {base}/data-files/s"),
    "validation": (2, "validating failed on rank 0: {base}/validate/validation"),
    "export": (2, "exporting failed on rank {v}: {base}/export/checkpoint-2/model/.metadata"),
}


def _data(base: Path, n: int = 64) -> tuple[Path, Path]:
    root = base / "data-files"
    root.mkdir(parents=True)
    lines = []
    for i in range(n):
        (root / f"s{i}.bin").write_bytes(bytes((i + k) % 251 for k in range(8)))
        lines.append(json.dumps({"id": f"s{i}", "path": str(root / f"s{i}.bin"), "offset": 0, "length": 8}))
    (base / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return root, base / "manifest.jsonl"


@pytest.mark.parametrize(("world", "ending"), [(2, "uncaught"), (4, "kill")])
def test_a_failure_on_one_rank_ends_every_rank_with_its_line(tmp_path: Path, world: int, ending: str) -> None:
    root, manifest = _data(tmp_path)
    config = write_config(
        tmp_path / "config.yaml", manifest, root, micro_batch=1, grad_accum=2, total_updates=8, save_every=2
    )
    out = run_tree(
        [TORCHRUN, "--standalone", f"--nproc_per_node={world}", "--monitor_interval=0.5"]
        + [str(Path(__file__).with_name("dist_rank_failures.py")), str(tmp_path), str(config), ending],
        timeout=400,  # a rank left waiting would sit out the script's gloo timeout (120 s) in each phase
        env=clean_env(TORCHRELAY_LOCK_WAIT_S="0.3"),
    )
    ended = time.time()
    output = out.stdout + out.stderr
    seen = [json.loads((tmp_path / f"seen-rank{r}.json").read_text()) for r in range(world)]
    v = world - 1
    slowest = {}
    for name, (code, line) in EXPECTED.items():
        got = [s[name] for s in seen]
        assert all(g["raised"] for g in got), (name, got)
        message = got[0]["message"]
        assert message.startswith(line.format(v=v, base=tmp_path)), (name, message)
        assert all(g["message"] == message for g in got), (name, got)  # the same line on every rank
        assert all((g["code"], g["reported"]) == (code, True) for g in got), (name, got)
        assert {g["type"] for g in got} == {got[0]["type"]}, (name, got)
        # said once, by rank 0 (the data file goes missing once more at the end, uncaught)
        said = output.count(f"torchrelay: {message}")
        assert said == (2 if name == "data" and ending == "uncaught" else 1), (name, output[-3000:])
        slowest[name] = max(g["seconds"] for g in got)
        assert slowest[name] < 30, (name, got)
    final = float((tmp_path / "final-start").read_text())
    slowest["final (exit)"] = round(ended - final, 1)
    frames = [ln for ln in output.splitlines() if ln.strip().startswith('File "')]
    assert all("site-packages" in f or "bin/torchrun" in f for f in frames), frames  # no traceback of a rank
    if ending == "uncaught":  # every rank exits 2 through its excepthook, the line said once (above)
        assert output.count("exitcode  : 2") == world, output[-3000:]
    else:  # the killed rank's peers, waiting for it in the micro-batch's exchange, say so and end (or torchrun
        # ends them first)
        assert output.count("exitcode  : -9") == 1, output[-3000:]
        lost = output.count("lost its peers")
        assert lost + output.count("exitcode  : -15") >= world - 1, output[-3000:]
        slowest["ranks that said they lost their peers"] = lost
    assert slowest["final (exit)"] < 30, slowest
    print(f"\n{world} ranks, seconds until the last rank raised (exited): {slowest}")


def test_no_process_group_outlives_the_scripts_destroy_into_finalization(tmp_path: Path) -> None:
    root, manifest = _data(tmp_path)
    config = write_config(
        tmp_path / "config.yaml", manifest, root, micro_batch=1, grad_accum=2, total_updates=4, save_every=2
    )
    out = run_tree(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5"]
        + [str(Path(__file__).with_name("dist_exit.py")), str(tmp_path), str(config)],
        timeout=300,
        env=clean_env(),
    )
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-3000:]
    # the ranks' lines may interleave; the protocol's group and the background save's, on each rank
    assert sorted(re.findall(r"GROUPS_LEFT (\d \d of \d)", output)) == ["0 0 of 2", "1 0 of 2"], output[
        -3000:
    ]
    assert sorted(re.findall(r"DEFAULT_HELD (\d (?:True|False))", output)) == ["0 False", "1 False"], output[
        -3000:
    ]
