"""The benchmarks cannot rot: every name a benchmark takes from torchrelay (or from a sibling benchmark) exists,
every benchmark imports, and every benchmark runs end to end at a toy size on the CPU, its figures checked.

A benchmark that renamed nothing still broke once (`state.save.get_state_dict` was renamed and bench_save.py
crashed at its first save, with nothing in the suite to say so): the names are resolved from each file's syntax,
so a rename fails here in a second, not on the GPU host. The toy runs catch the rest (a changed signature, an
option no longer read, a figure no longer written). Each runs in a fresh process, one rank without torchrun (RANK,
WORLD_SIZE and MASTER_* set). Each costs a few CPU seconds (torch's import in a fresh interpreter), so the fast tier
keeps one per part of the checkpoint core (save, load, persist, plan, verify, ...); the rest are marked `full`,
and those that launch torchrun themselves are marked `launch`. GPU-only scripts
(GPU_ONLY) run the part that needs no GPU."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))
SIBLINGS = {p.stem for p in SCRIPTS}


def _imported(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for, for every import from torchrelay or a sibling benchmark."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root == "torchrelay" or root in SIBLINGS:
                    names[alias.asname or root] = alias.name if alias.asname else root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names if node.module.split(".")[0] in {"torchrelay", *SIBLINGS} else ():
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _references(path: Path) -> list[tuple[str, int]]:
    """Every dotted name the file uses from torchrelay or a sibling: its imports and the attribute chains on them."""
    tree = ast.parse(path.read_text(), str(path))
    names = _imported(tree)
    refs = [(dotted, 0) for dotted in names.values()]

    def dotted(node: ast.expr) -> str | None:
        chain: list[str] = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in names:
            return ".".join([names[node.id], *reversed(chain)])
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := dotted(node)) is not None:
            refs.append((name, node.lineno))
        # (owner, "attribute", ...) as the probes that wrap a function list them, and getattr/setattr(owner, "x")
        pair: list[ast.expr] = []
        if isinstance(node, ast.Tuple):
            pair = node.elts[:2]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr"):
            pair = node.args[:2]
        if len(pair) == 2 and isinstance(pair[1], ast.Constant) and isinstance(pair[1].value, str):
            owner = names.get(pair[0].id) if isinstance(pair[0], ast.Name) else dotted(pair[0])
            if owner is not None:
                refs.append((f"{owner}.{pair[1].value}", node.lineno))
    return refs


def _resolve(dotted: str) -> Any:
    """The object `dotted` names, importing modules along the way; AttributeError where a part is missing."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            raise AttributeError(f"{'.'.join(parts[: i - 1])} has no {part!r}") from None
    return obj


@pytest.fixture(scope="module", autouse=True)
def _benchmarks_importable() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))


def test_every_name_a_benchmark_takes_from_torchrelay_exists() -> None:
    missing = []
    for path in SCRIPTS:
        for dotted, line in _references(path):
            try:
                _resolve(dotted)
            except (AttributeError, ImportError) as exc:
                missing.append(f"{path.name}:{line}: {dotted} ({exc})")
    assert not missing, "\n".join(missing)


def test_a_renamed_name_is_caught(tmp_path: Path) -> None:
    """The check itself: a benchmark naming what torchrelay no longer has fails it, naming the line."""
    fake = tmp_path / "bench_fake.py"
    fake.write_text(
        "from torchrelay.checkpoint.state import save as state_save\n"
        "from torchrelay.checkpoint import hashing_writer\n\n"
        "def f():\n    return hashing_writer.HashingWriter, [(state_save, 'get_state_dict', 'state_dict')]\n"
    )
    refs = dict(_references(fake))
    assert (
        "torchrelay.checkpoint.state.save.get_state_dict" in refs
        and "torchrelay.checkpoint.hashing_writer.HashingWriter" in refs
    )
    with pytest.raises(AttributeError, match="get_state_dict"):
        _resolve("torchrelay.checkpoint.state.save.get_state_dict")
    _resolve("torchrelay.checkpoint.hashing_writer.HashingWriter")


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_benchmark_imports(path: Path) -> None:
    importlib.import_module(
        path.stem
    )  # its imports and module-level code: no command runs (a __main__ guard)


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), str(BENCH)]),
        "OMP_NUM_THREADS": "1",
        # one rank without torchrun: the benchmarks initialize the process group from these
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 2000),
    }


# Scripts that are not benchmarks of their own, and what runs them.
HELPERS = {
    "benchlib": "shared code of the benchmarks",
    "trainer_resume_script": "the script bench_trainer_resume.py --workers launches (run by its toy test)",
}
# Scripts that need a GPU for what they measure: each runs here only the part that needs none.
GPU_ONLY = {
    "bench_pin": "page-locks host memory beside a GPU loop (cudaHostRegister); refuses in a line without CUDA",
    "gpu_exactness": "NCCL and CUDA kernels; --setup-only writes its code, data and config",
    "gpu_rank_state": "NCCL and SyncBatchNorm; --setup-only writes its code, data and config",
    "gpu_trainer_fsdp2": "runs tests/trainer_fsdp2.py, whose gloo path is tests/test_trainer_fsdp2.py's",
}


def _bench(script: str, *args: object, timeout: int = 600, ok: bool = True) -> str:
    """Run benchmarks/`script` with `args` in a fresh process (one rank, no torchrun); its stdout. It must exit 0
    (`ok`), else its last output is the failure."""
    cmd = [sys.executable, str(BENCH / script), *map(str, args)]
    done = subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert done.returncode == 0, (
            f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
        )
    return done.stdout if ok else done.stdout + done.stderr


def _last_json(text: str) -> Any:
    """The last JSON object the output holds whole (indented or on one line)."""
    decoder = json.JSONDecoder()
    found = None
    for line_start in [0, *(i + 1 for i, c in enumerate(text) if c == "\n")]:
        if text.startswith("{", line_start):
            try:
                found = decoder.raw_decode(text, line_start)[0]
            except json.JSONDecodeError:
                continue
    assert found is not None, f"no JSON object in the output:\n{text[-2000:]}"
    return found


def _positive(*values: Any) -> bool:
    return all(isinstance(v, int | float) and v > 0 for v in values)


def test_every_benchmark_runs_at_a_toy_size_in_the_suite() -> None:
    """A new benchmark needs a toy run: here (its file name, quoted, in a test that runs it), or in a test file of
    its own that names benchmarks/its_name.py; GPU_ONLY and HELPERS say why a script runs only in part."""
    here = Path(__file__).read_text()
    others = "".join(
        t.read_text() for t in Path(__file__).parent.glob("test_*.py") if t.name != Path(__file__).name
    )
    missing = [
        stem
        for stem in sorted(SIBLINGS - set(HELPERS))
        if f'"{stem}.py"' not in here
        and f"benchmarks/{stem}.py" not in others
        and f'"{stem}.py"' not in others
    ]
    assert not missing, f"benchmarks without a toy run in the suite: {missing}"
    assert set(GPU_ONLY) | set(HELPERS) <= SIBLINGS, "GPU_ONLY or HELPERS names a script that is gone"


# ------------------------------------------------------------------------- one rank, no torchrun: the fast tier


def test_bench_save_runs_at_a_toy_size_and_its_goals_are_judged(tmp_path: Path) -> None:
    """bench_save.py's whole run (floors, DCP's saves, a torchrelay launch with a save, the loads) on a state of a
    few kilobytes; issue22_goals.py then judges its JSON (a verdict per goal, whatever it is at this size)."""
    out = tmp_path / "save.json"
    _bench("bench_save.py", "--device", "cpu", "--layers", "2", "--width", "32", "--files", "2", "--saves", "1",
           "--save-every", "3", "--dir", tmp_path, "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert got["sync_and_async_files_identical"] is True
    assert _positive(got["bytes"], got["checkpoint_bytes"], got["disk_write_streams_s"])
    assert any(name.startswith("torchrelay resume") for name in got["loads"]), got["loads"]
    judged = _bench("issue22_goals.py", "--save", out)
    for goal in (1, 2, 3):
        section = judged.split(f"**Goal {goal}:")[1].split("**Goal")[0]
        assert re.search(r"^\| save, main \|.*\| (met|\*\*not met\*\*) \|$", section, re.M), section


@pytest.mark.full
def test_the_save_and_load_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    """bench_save.py's loads (`--only load`): a torchrelay save, the cold-read floor, DCP's load and the verified
    resume of a state of a few kilobytes, every figure written to its JSON."""
    out = tmp_path / "load.json"
    _bench("bench_save.py", "--device", "cpu", "--layers", "2", "--width", "32", "--files", "2", "--dir", tmp_path,
           "--only", "load", "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert any(name.startswith("torchrelay resume") for name in got["loads"]), got["loads"]


@pytest.mark.full  # eight processes of train_lm.py, two of them SIGKILLed: 22 s idle, about 80 s on a busy machine
def test_bench_memory_tier_runs_at_a_toy_size(tmp_path: Path) -> None:
    """bench_memory_tier.py: a plain loop, memory and durable saves every update, and the restarts from each tier
    after a SIGKILL (each asserts the tier it resumed from), every figure in its JSON."""
    out = tmp_path / "memory.json"
    _bench("bench_memory_tier.py", "--d-model", "32", "--layers", "1", "--updates", "8", "--every", "2",
           "--dir", tmp_path, "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert _positive(got["state_bytes"], got["restart_to_first_update_memory_s"]), got
    assert _positive(got["restart_to_first_update_disk_s"]), got
    assert {"blocked_per_memory_save_s", "blocked_per_durable_save_s", "lost_per_memory_save_s"} <= set(
        got
    ), got
    assert got["loops"]["memory"]["updates_timed"] > 0 and 0 <= got["loops"]["memory"]["slow_share"] <= 1, got
    assert got["loops"]["memory"]["saves_timed"] >= 1 and _positive(got["copy_floor_s"]), got


def test_bench_load_runs_at_a_toy_size_and_its_goal_is_judged(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    _bench("bench_load.py", "--device", "cpu", "--layers", "2", "--width", "32", "--dir", tmp_path,
           "--variants", "default", "--variant", "one file:load_buffer=1", "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert set(got["rows"]) == {"default", "one file"}, got["rows"].keys()
    assert all(row["equal"] is True and _positive(row["s"]) for row in got["rows"].values()), got["rows"]
    assert _positive(got["cold_read_s"], got["dcp_load_s"], got["save_s"])
    judged = _bench("issue22_goals.py", "--load", out)
    assert "| load, default |" in judged and "| load, one file |" in judged, judged


def test_issue22_goals_verdicts_hold_at_and_around_each_threshold() -> None:
    assert "self-check: every verdict as expected" in _bench("issue22_goals.py", "--self-check")


def test_bench_load_ranks_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    _bench("bench_load_ranks.py", "--layers", "2", "--width", "32", "--streams", "2", "--repeat", "1", "--dir",
           tmp_path, "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    (one,) = got["rounds"]
    assert one["resume"]["equal"] is True and one["resume"]["ranks"][0]["bytes_read"] > 0, one
    assert _positive(one["floor"]["s"], one["resume"]["s"], one["control"]["s"]), one


def test_bench_checkpoint_runs_at_a_toy_size(tmp_path: Path) -> None:
    got = _last_json(_bench("bench_checkpoint.py", "--sizes", "1", "--dir", tmp_path))
    (row,) = got["results"]
    assert row["params_million"] > 1 and row["bytes"] > 4e6, row
    assert _positive(row["save_s"], row["load_s"], row["peer_torch_save_fsync_s"]), row


def test_bench_step_overhead_runs_at_a_toy_size() -> None:
    got = _last_json(_bench("bench_step_overhead.py", "--updates", "30", "--repeats", "1"))
    assert got["updates"] == 30 and got["world_size"] == 1, got
    assert _positive(
        got["boundary_us_per_update"], got["plain_loop_us_per_update"], got["torchrelay_loop_us_per_update"]
    )


@pytest.mark.full
def test_bench_loader_start_runs_at_a_toy_size() -> None:
    got = _last_json(
        _bench("bench_loader_start.py", "--context", "forkserver", "--workers", "1", "--records", "100")
    )
    assert got["context"] == "forkserver" and got["workers"] == 1, got
    assert _positive(got["first_batch_s"], got["all_workers_s"]), got


def test_bench_plan_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    text = _bench("bench_plan.py", "--layers", "2", "--saves", "1", "--check-caching", "--json", out)
    got = json.loads(out.read_text())
    assert got["items"] == 16 and len(got["rows"]) == 4, got  # 2 layers: 4 parameters, 8 moments, 4 steps
    assert all(_positive(*seconds) for seconds in got["rows"].values()), got["rows"]
    assert "a save after one whose global plan failed" in text, text


def test_bench_persist_gc_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "gc.json"
    _bench("bench_persist_gc.py", "--layers", "2", "--width", "16", "--saves", "1", "--save-every", "3", "--tail",
           "2", "--rounds", "1", "--no-transformers", "--dir", tmp_path, "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert [r["variant"] for r in got["rows"]] == ["off", "freeze"], got["rows"]
    assert all(r["updates"] >= 4 and r["updates_during_persist"] >= 0 for r in got["rows"]), got["rows"]
    assert _positive(got["full_collection"]["objects"]), got["full_collection"]


def test_bench_persist_process_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "persist.json"
    _bench("bench_persist_process.py", "--layers", "2", "--width", "16", "--saves", "2", "--save-every", "3",
           "--tail", "2", "--rounds", "1", "--dir", tmp_path, "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert [(r["variant"], r["writer_process"]) for r in got["rows"]] == [
        ("thread", False),
        ("process", True),
    ]
    for r in got["rows"]:  # the saves at updates 3 and 6, each persist timed or still in flight at the next
        assert len(r["stall_x"]) == len(r["persist_s"]) + r["persists_untimed"] == 2, r
        assert r["updates"] == 7 and _positive(*r["stall_x"], *r["persist_s"], r["update_median_ms"]), r


def test_bench_disk_rounds_runs_at_a_toy_size(tmp_path: Path) -> None:
    steps = "new:A,over:A,recycle:A:B,del:B,new:C,rm:C,fall:D,kick:E,drop"
    out = tmp_path / "rounds.json"
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "kept").write_text("not the benchmark's")
    _bench("bench_disk_rounds.py", "--dir", tmp_path / "disk", "--gb", "0.004", "--files", "2", "--steps", steps,
           "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    timed = [s for s in steps.split(",") if s.split(":")[0] in ("new", "over", "recycle", "fall", "kick")]
    assert [r["step"] for r in got["rounds"]] == timed, got["rounds"]
    assert all(_positive(r["s"], r["GBps"]) for r in got["rounds"]), got["rounds"]
    assert [p.name for p in (tmp_path / "disk").iterdir()] == ["kept"]  # its sets removed, nothing else


def test_bench_read_patterns_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "patterns.json"
    _bench("bench_read_patterns.py", "--dir", tmp_path, "--gb", "0.004", "--count", "2", "--rounds", "1", "--json",
           out)  # fmt: skip
    got = json.loads(out.read_text())
    assert got["bytes"] >= 4_000_000 - 64 and len(got["times"]) >= 5, got
    assert all(_positive(*times) for times in got["times"].values()), got["times"]


def test_bench_touch_lock_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "touch.json"
    _bench("bench_touch_lock.py", "--gb", "0.0625", "--floor-seconds", "0.3", "--json", out)
    got = json.loads(out.read_text())
    assert [r["mode"] for r in got] == ["none", "private", "memfd-touch", "memfd-fallocate"], got
    assert all(r["calls"] > 0 and _positive(r["median_ms"]) for r in got), got
    assert all(r["buffers"] == 1 and _positive(r["obtain_s"]) for r in got[1:]), got


def test_bench_verify_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "verify.json"
    _bench("bench_verify.py", "--dir", tmp_path / "v", "--gb", "0.004", "--files", "2", "--trials", "1",
           "--quiet-wait", "0", "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    (trial,) = got["trials"]
    assert _positive(trial["verify_Bps"], trial["limit_Bps"], *got["cli_s"], *got["sha256sum_c_s"]), got
    assert not (tmp_path / "v").exists()  # the synthetic bundle is deleted


def test_bench_hash_scaling_runs_at_a_toy_size(tmp_path: Path) -> None:
    got = _last_json(_bench("bench_hash_scaling.py", "--dir", tmp_path / "h", "--gb", "0.004", "--files", "2",
                            "--trials", "1", "--seconds", "0.1"))  # fmt: skip
    assert set(got["verify_Bps"]) == {"verify_bundle", "mapped", "populate", "read"}, got
    assert all(_positive(*bps) for bps in got["verify_Bps"].values()), got["verify_Bps"]
    assert _positive(got["hash_one_Bps"], got["read_Bps"])


@pytest.mark.full
def test_bench_pack_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "pack.json"
    _bench("bench_pack.py", "--dir", tmp_path / "p", "--gb", "0.004", "--files", "2", "--trials", "1",
           "--cold-trials", "0", "--quiet-wait", "0", "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    for name in ("cp", "pack", "cp+sha256sum", "pack-link"):
        assert len(got[name]) == 1 and _positive(*got[name]), (name, got)
    assert _positive(*got["prepare"]["copy"], *got["prepare"]["hardlink"]), got["prepare"]


@pytest.mark.full
def test_bench_export_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "export.json"
    _bench("bench_export.py", "--dir", tmp_path / "e", "--gb", "0.004", "--hidden", "64", "--vocab", "100",
           "--quiet-wait", "0", "--json", out)  # fmt: skip
    got = json.loads(out.read_text())
    assert got["check_ok"] is True and got["checkpoint_bytes"] > 4e6, got
    for name in ("import", "export_fp32", "export_bf16", "load_whole"):
        assert got[name]["rc"] == 0 and _positive(got[name]["peak_rss"], got[name]["seconds"]), (name, got)


def test_bench_config_layer_runs_at_a_toy_size() -> None:
    """Ours and pydantic (msgspec is not installed here: a peer left out is not measured)."""
    text = _bench("bench_config_layer.py", "--runs", "1", "--peers", "pydantic")
    rows = re.findall(r"^  (.+?)\s+([\d.]+) ms\s+([\d.]+)x", text, re.M)
    assert [r[0] for r in rows][2:] == ["torchrelay.util.schema", "torchrelay.controller.plan (all sections)",
                                        "pydantic 2"], rows  # fmt: skip
    assert all(float(ms) > 0 for _, ms, _ in rows), rows
    assert "messages of torchrelay.util.schema:" in text and "messages of pydantic 2:" in text, text
    assert "msgspec" not in text, text


@pytest.mark.full
def test_bench_scale_runs_at_a_toy_size(tmp_path: Path) -> None:
    got = _last_json(_bench("bench_scale.py", "--samples", "2000", "--updates", "40", "--save-every", "10",
                            "--ranks", "2", "--big-samples", "0", "--out", tmp_path / "s"))  # fmt: skip
    assert got["trimmed_from"] == 30 and got["exposures"] > 0, got
    measured = {k: v for k, v in got.items() if isinstance(v, dict) and "rc" in v}
    assert {"open", "open_cold", "import_only", "open_rank", "status", "ledger", "ledger_full"} <= set(
        measured
    )
    assert all(m["rc"] == 0 and _positive(m["wall_s"]) for m in measured.values()), measured


@pytest.mark.full
def test_bench_scale_create_runs_at_a_toy_size(tmp_path: Path) -> None:
    """`--only create` on a manifest just big enough for reader processes, and with one core (so none)."""
    got = _last_json(_bench("bench_scale.py", "--only", "create", "--big-samples", "300000", "--one-process",
                            "--out", tmp_path / "s"))  # fmt: skip
    assert got["scan"]["rc"] == got["scan_one_process"]["rc"] == got["create"]["rc"] == 0, got
    assert got["scan_one_process"]["readers"] == 0, got["scan_one_process"]
    cores = got["cores"]
    assert got["scan"]["readers"] == (min(cores, 16) if cores > 1 else 0), (cores, got["scan"])


@pytest.mark.full
def test_bench_trainer_resume_runs_at_a_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "trainer.json"
    _bench("bench_trainer_resume.py", "--samples", "200", "--at", "10", "--repeats", "1", "--json", out)
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["at"] == 10 and row["relay"]["global_step"] == row["hf"]["global_step"] == 10, row
    assert _positive(row["relay"]["first_update"], row["hf"]["first_update"]), row


@pytest.mark.full
def test_bench_trainer_resume_workers_runs_at_a_toy_size(tmp_path: Path) -> None:
    """--workers: trainer_resume_script.py launched for each side, resumed from its checkpoint."""
    out = tmp_path / "workers.json"
    _bench(
        "bench_trainer_resume.py", "--workers", "0", "--repeats", "1", "--sides", "relay,hf", "--json", out
    )
    got = json.loads(out.read_text())
    (row,) = got["workers"]
    for side in ("relay", "hf"):  # each resumed from checkpoint-1 and ran one update
        times = row[side]
        assert row["workers"] == 0 and times["global_step"] == 2, row
        assert 0 < times["imported"] < times["train"] < times["first_update_done"], row


def test_bench_zero_reshard_runs_at_a_toy_size() -> None:
    """A ZeRO-2 state of 20,000 elements cut for 4 ranks, resharded for 2 and proven."""
    (row,) = [json.loads(x) for x in _bench("bench_zero_reshard.py", "--elements", "2e4").splitlines() if x]
    assert (row["elements"], row["old"], row["new"]) == (20000, 4, 2), row
    assert _positive(row["state_MiB"], row["reshard_s_slowest_rank"], row["MiB_per_s"]), row


@pytest.mark.full
def test_bench_s3_runs_at_a_toy_size() -> None:
    """8 MiB through the benchmark's own SeaweedFS (tests/s3_server.py): each of the four transfers reports a speed."""
    got = _last_json(_bench("bench_s3.py", "--mib", "8", "--jobs", "2", "--rounds", "1"))
    for key in ("upload_relay", "upload_plain", "download_relay", "download_plain"):
        assert _positive(got[f"{key}_s"], got[f"{key}_gbps"]), got


# ----------------------------------------------------- torchrun launches: in the full suite only (the launch tier)


@pytest.mark.launch
def test_bench_exact_reduce_runs_at_a_toy_size() -> None:
    text = _bench("bench_exact_reduce.py", "--nproc", "1", "--updates", "3", "--repeats", "1", "--width", "32",
                  "--accum", "2", "--micro-batch", "2")  # fmt: skip
    ratio = re.search(r"exact / default: update time ([\d.]+)x, peak RSS ([\d.]+)x", text)
    assert ratio and float(ratio[1]) > 0 and float(ratio[2]) > 0, text
    assert re.search(r"^  exact +update +[\d.]+ ms", text, re.M), text


@pytest.mark.launch
def test_bench_micro_collective_runs_at_a_toy_size() -> None:
    """This checkout against itself (--before the same src/), 12 updates: the medians of the last 2."""
    got = _last_json(_bench("bench_micro_collective.py", "--before", REPO / "src", "--updates", "12",
                            "--repeats", "1"))  # fmt: skip
    for key in ("median", "cpu", "wall"):
        (before,), (after,) = got[key]["before_ms"], got[key]["after_ms"]
        assert _positive(before, after, got[key]["ratio_after_to_before"]), got


@pytest.mark.launch
def test_bench_launch_end_runs_at_a_toy_size() -> None:
    text = _bench("bench_launch_end.py", "--before-src", REPO / "src", "--rounds", "1")
    for name in ("unchanged", "ranks", "ranks+agent"):
        row = re.search(
            rf"^{re.escape(name)} +launch ([\d.]+) s +end ([\d.]+) s .* CPU ([\d.]+) s$", text, re.M
        )
        assert row and float(row[1]) > float(row[2]) > 0, (name, text)


@pytest.mark.launch
def test_bench_kill_runs_at_a_toy_size(tmp_path: Path) -> None:
    """One kill of a 6-update run, its resume, the run finished and compared with an uninterrupted one."""
    _bench("bench_kill.py", "--kills", "1", "--updates", "6", "--seed", "3", "--out", tmp_path / "k")
    got = json.loads((tmp_path / "k" / "kills.json").read_text())
    s = got["summary"]
    assert s["kills"] == 1 and s["runs"] == s["runs_finished"] == s["runs_bit_exact"] == 1, s
    assert s["corrupt_resumes"] == s["refusals"] == s["leftovers"] == 0, s


@pytest.mark.launch
def test_bench_zoo_runs_at_a_toy_size(tmp_path: Path) -> None:
    """One member audited with one stop."""
    out = tmp_path / "zoo.json"
    _bench(
        "bench_zoo.py",
        "--members",
        "dropout",
        "--combined",
        "",
        "--updates",
        "4",
        "--stops",
        "1",
        "--json",
        out,
    )
    (row,) = json.loads(out.read_text())
    assert row["member"] == "dropout" and row["equal"] is True and len(row["stops"]) == 1, row
    assert row["tensors"] > 0 and _positive(row["seconds"]), row


@pytest.mark.launch
def test_bench_certify_runs_at_a_toy_size() -> None:
    """A 4-update run on 2 ranks, one and two of its updates replayed from its checkpoint at update 2."""
    rows = [json.loads(x) for x in _bench("bench_certify.py", "--updates", "4", "--replay", "1,2").splitlines()
            if x.startswith("{")]  # fmt: skip
    replays = [r for r in rows if "replayed" in r]
    assert [(r["replayed"], r["certified"]) for r in replays] == [(1, True), (2, True)], rows
    # the per-update figure is a difference of two timings: at this size it may come out either side of 0
    assert _positive(*(r["seconds"] for r in replays)) and isinstance(rows[-1]["per_update_s"], float), rows


@pytest.mark.launch
def test_bench_durable_kills_runs_at_a_toy_size() -> None:
    """One kill of an 8-update run while its sync uploads, the local checkpoints then lost, the run finished from
    the store and compared bit for bit with an uninterrupted one."""
    got = _last_json(_bench("bench_durable_kills.py", "--kills", "1", "--lose-after", "1", "--updates", "8",
                            "--pace", "0.3"))  # fmt: skip
    assert got["kills"] == 1 and got["launches"] == 2 and got["logs_equal"] is True, got
    assert got["bit_exact_tensors"] > 0 and got["committed_in_store"][-1] == 8, got


@pytest.mark.full
def test_bench_memory_kills_runs_at_a_toy_size() -> None:
    """Three random kills of a 2-node job saving to memory every update (tests/memory_campaign.py), each relaunch
    judged, the end compared bit for bit with an uninterrupted run."""
    got = _last_json(_bench("bench_memory_kills.py", "--kills", "3", "--updates", "16", "--save-every", "8",
                            "--pace", "0.3"))  # fmt: skip
    assert got["kills"] == 3 and got["launches"] == 4 and got["unusable_states"] == 0, got
    assert got["lost_max"] <= 1 and got["bit_exact_tensors"] > 0 and got["ledger_proved"] is True, got
    tiers = {"memory", "replica", "durable"}
    assert sum(got["landed"].values()) == 3 and set(got["resumed_tiers"]) <= tiers, got


# --------------------------------------------------------------------- GPU-only: the part that needs no GPU


@pytest.mark.full
def test_bench_pin_refuses_in_a_line_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: bench_pin.py measures, not refuses")
    text = _bench("bench_pin.py", "--layers", "1", "--width", "8", ok=False)
    assert text.strip().splitlines()[-1] == (
        "bench_pin.py: needs a CUDA GPU (it page-locks host memory beside a GPU loop); run it on a GPU host"
    ), text


@pytest.mark.full
@pytest.mark.parametrize("script", ["gpu_exactness.py", "gpu_rank_state.py"])
def test_a_gpu_exactness_script_sets_up_its_run_on_the_cpu(script: str, tmp_path: Path) -> None:
    got = _last_json(_bench(script, "--out", tmp_path / "o", "--setup-only"))
    config = Path(got["config"]).read_text()
    assert Path(got["manifest"]).is_file() and (Path(got["code"]) / "train_lm.py").is_file(), got
    assert "total_updates" in config, config


@pytest.mark.full
def test_gpu_trainer_fsdp2_runs_the_tests_worker() -> None:
    """Its argument parsing: the worker it runs (tests/trainer_fsdp2.py; its gloo path is test_trainer_fsdp2's)."""
    text = _bench("gpu_trainer_fsdp2.py", "--help")
    assert "--device {cuda,cpu}" in text and "--precisions" in text, text
