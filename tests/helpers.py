"""Shared test helpers: a code repo holding the example, its data, and real torchrun launches."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from torchrelay.util import proctree

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
PYTHON = sys.executable


def _torchrun() -> str:
    """torchrun, as its console script runs it (torch.distributed.run.main), with its heap frozen at exit.

    The agent imports torch, and an interpreter that did spends its end collecting torch's objects: 2.5-3 s between
    the ranks' exit and torchrun's on the shared 2-core VM at load 4-6, 0.7-0.9 s frozen (benchmarks/RESULTS.md "The
    suite's length"), in every launch of the suite. The agent is otherwise the one the console script starts (same
    function, arguments, signals, exit code); its path still ends in "torchrun", which the fast tier looks for."""
    text = (
        f"#!{sys.executable}\n"
        "import atexit, gc, sys\n"
        "from torch.distributed.run import main\n"
        "atexit.register(gc.freeze)  # as torchrelay's ranks do (src/torchrelay/util/finalize.py)\n"
        "sys.exit(main())\n"
    )
    # One file per text, never removed: a launch may start after the process that wrote it has ended.
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    script = Path(tempfile.gettempdir()) / f"torchrelay-tests-{os.getuid()}" / digest / "bin" / "torchrun"
    if not script.exists():
        script.parent.mkdir(parents=True, exist_ok=True)
        part = script.with_name(f"torchrun.{os.getpid()}")
        part.write_text(text)
        part.chmod(0o755)
        os.replace(part, script)  # whole or absent, for the test processes that race to write it
    return str(script)


TORCHRUN = _torchrun()
TIMING_KEYS = ("update_time", "time", "samples_per_s")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(cwd), *args],
        check=True,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
        },
    ).stdout.strip()


def make_code_repo(
    dest: Path, scripts: tuple[str, ...] = ("train_lm.py",), wrappers: tuple[str, ...] = ()
) -> Path:
    """A git repo holding the example script(s), and `wrappers` from tests/ beside them (trainer_paced.py, ...):
    its commit is the run's code identity."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, src in [(n, EXAMPLES / n) for n in scripts] + [(n, REPO / "tests" / n) for n in wrappers]:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "example")
    return dest


def make_data(dest: Path, files: int = 6, max_bytes: int = 128) -> tuple[Path, Path]:
    """The example's data (Python stdlib source) under dest/root, and dest/manifest.jsonl."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import prepare_data  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    root, manifest = prepare_data.build(dest, files, max_bytes)
    return root, manifest


def write_config(path: Path, manifest: Path, data_root: Path, **changes: Any) -> Path:
    """examples/lm.yaml with the data paths filled in and small-run changes (params.<k> reaches params)."""
    cfg = yaml.safe_load((EXAMPLES / "lm.yaml").read_text())
    cfg["manifest"], cfg["data_root"] = str(manifest), str(data_root)
    cfg.update({"total_updates": 16, "warmup_updates": 2, "save_every": 8})
    cfg["params"].update({"d_model": 32, "layers": 1, "heads": 2, "seq_len": 64})
    for key, value in changes.items():
        if key.startswith("params."):
            cfg["params"][key.removeprefix("params.")] = value
        else:
            cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def torchrun_cmd(
    code: Path,
    run_dir: Path,
    nproc: int = 2,
    config: Path | None = None,
    sets: dict[str, Any] | None = None,
    script: str = "train_lm.py",
    args: tuple[str, ...] = (),
) -> list[str]:
    """torchrun running the example on `nproc` ranks; `args`: more of the script's own (`--kill-at`)."""
    cmd = [
        TORCHRUN,
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--monitor_interval=0.5",
        str(code / script),
        "--run-dir",
        str(run_dir),
    ]
    if config is not None:
        cmd += ["--config", str(config)]
    for k, v in (sets or {}).items():
        cmd += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return [*cmd, *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRELAY_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def dump_stacks(tree: proctree.Tree) -> str:
    """The Python and native stacks of each process of `tree` alive now (py-spy, when installed beside this
    interpreter or on PATH): what a test writes where a launch hung, before it kills the tree. Empty when py-spy is
    missing."""
    spy = shutil.which(
        "py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    )
    if spy is None:
        return ""
    tree.collect()
    out = []
    for pid in [p.pid for p in tree.alive()]:
        try:
            done = subprocess.run(
                [spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True, timeout=60
            )
            # a process that is not Python (a shell, sleep): py-spy's one line of why
            said = done.stdout if done.returncode == 0 else done.stderr.split("\n", 1)[0]
            out.append(f"== py-spy dump {pid}\n{said}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.append(f"== py-spy dump {pid}: {exc}")
    return "\n".join(out)


def launch(
    code: Path,
    run_dir: Path,
    *,
    nproc: int = 2,
    config: Path | None = None,
    sets: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    script: str = "train_lm.py",
    args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """One real torchrun launch of the example, to completion (or its clean stop, or its crash)."""
    return run_tree(
        torchrun_cmd(code, run_dir, nproc, config, sets, script, args),
        timeout=timeout,
        env=clean_env(**(env or {})),
        cwd=code,
    )


def run_tree(
    cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd, capture_output=True, text=True) for a torchrun launch: past `timeout` the whole tree
    ends, ranks and their workers too (torchrun starts each rank in a session of its own, and subprocess.run
    kills only torchrun), so none is left behind to disturb the next test."""
    stacks: list[str] = []

    try:
        return proctree.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            on_timeout=lambda tree: stacks.append(dump_stacks(tree)),
        )
    except subprocess.TimeoutExpired as exc:
        # what it printed last and where each process was, in the failure
        said = f"{exc.output or ''}{exc.stderr or ''}"[-6000:]
        raise AssertionError(
            f"{' '.join(map(str, cmd))[:300]} ran past {timeout} s; its output's end:\n{said}\n{''.join(stacks)}"
        ) from exc


def launch_bg(code: Path, run_dir: Path, **kw: Any) -> subprocess.Popen[str]:
    env = clean_env(**kw.pop("env", {}) or {})
    return subprocess.Popen(
        torchrun_cmd(code, run_dir, **kw),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=code,
        start_new_session=True,
    )


def wait_for_update(run_dir: Path, update: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Block until rank 0 has logged `update` (or the process ended)."""
    path = run_dir / "train" / "metrics-rank0.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if lines and json.loads(lines[-1])["update"] >= update:
                return
        time.sleep(0.02)
    raise AssertionError(f"run did not reach update {update} (exit {proc.poll()})")


def sigterm(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGTERM)


def last_segment(run_dir: Path) -> dict[str, Any]:
    return [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines() if x.strip()][-1]


def segments(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines() if x.strip()]


def metrics(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    lines = (run_dir / "train" / f"metrics-rank{rank}.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS} for x in lines if x.strip()]


def last_logged(run: Path) -> int:
    """The last update rank 0 logged (0 before the first, or while its log cannot be read)."""
    try:
        rows = metrics(run, 0)
    except (OSError, ValueError):
        return 0
    return int(rows[-1]["update"]) if rows else 0


def exposures(run_dir: Path, rank: int) -> list[str]:
    return (run_dir / "train" / f"exposures-rank{rank}.jsonl").read_text().splitlines()


def assert_same_final_state(a: Path, b: Path, update: int) -> int:
    """Every model and optimizer tensor torch.equal; returns how many were compared."""
    from torchrelay.checkpoint.reader import load_tensors

    ta, tb = load_tensors(a / f"checkpoint-{update}"), load_tensors(b / f"checkpoint-{update}")
    assert ta.keys() == tb.keys()
    differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"
    return len(ta)


def assert_same_logs(a: Path, b: Path, ranks: int = 2) -> None:
    for r in range(ranks):
        assert metrics(a, r) == metrics(b, r), f"metrics of rank {r} differ"
        assert exposures(a, r) == exposures(b, r), f"exposures of rank {r} differ"
