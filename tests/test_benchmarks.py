"""The benchmarks cannot rot: every name a benchmark takes from torchrelay (or from a sibling benchmark) exists,
every benchmark imports, and the save/load benchmark runs end to end at a toy size on the CPU.

A benchmark that renamed nothing still broke once (`state.save.get_state_dict` was renamed and bench_save.py
crashed at its first save, with nothing in the suite to say so): the names are resolved from each file's syntax,
so a rename fails here in a second, not on the GPU host."""

from __future__ import annotations

import ast
import importlib
import json
import os
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
        "from torchrelay.checkpoint import persist\n\n"
        "def f():\n    return persist.HashingWriter, [(state_save, 'get_state_dict', 'state_dict')]\n"
    )
    refs = dict(_references(fake))
    assert (
        "torchrelay.checkpoint.state.save.get_state_dict" in refs
        and "torchrelay.checkpoint.persist.HashingWriter" in refs
    )
    with pytest.raises(AttributeError, match="get_state_dict"):
        _resolve("torchrelay.checkpoint.state.save.get_state_dict")
    _resolve("torchrelay.checkpoint.persist.HashingWriter")


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


def test_the_save_and_load_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    """bench_save.py's loads (`--only load`): a torchrelay save, the cold-read floor, DCP's load and the verified
    resume of a state of a few kilobytes, every figure written to its JSON."""
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(BENCH / "bench_save.py"), "--device", "cpu", "--layers", "2", "--width", "32"]
    cmd += ["--files", "2", "--dir", str(tmp_path), "--only", "load", "--json", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert any(name.startswith("torchrelay resume") for name in got["loads"]), got["loads"]


@pytest.mark.full  # eight processes of train_lm.py, two of them SIGKILLed: 80 s on a busy machine
def test_the_memory_tier_benchmark_runs_at_a_toy_size(tmp_path: Path) -> None:
    """bench_memory_tier.py at a toy size: a plain loop, memory and durable saves every update, and the restarts
    from each tier after a SIGKILL, every figure in its JSON (the restarts assert the tier they came from)."""
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(BENCH / "bench_memory_tier.py"), "--d-model", "32", "--layers", "1"]
    cmd += ["--updates", "8", "--dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["state_bytes"] > 0 and got["restart_to_first_update_memory_s"] > 0, got
    assert {
        "blocked_per_memory_save_s",
        "blocked_per_durable_save_s",
        "restart_to_first_update_disk_s",
    } <= set(got)
