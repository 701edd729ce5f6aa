"""The configuration layer's choice, measured: import time and the messages for the same bad inputs, for our typed
dataclasses (torchrelay.util.schema), pydantic 2 and msgspec.

Each import is timed inside a fresh interpreter (process CPU time around the import and the model definitions, so the
interpreter's own start is not counted), `--runs` times interleaved, median; the floor is `import dataclasses, typing` in the
same interpreter. The light CLI verbs (status, stop, sbatch) import the configuration layer, so its cost is paid on
every call. pydantic and msgspec need not be installed here: `--python` names an interpreter that has them.

    python benchmarks/bench_config_layer.py --runs 21 --python /tmp/msv/bin/python
    python benchmarks/bench_config_layer.py --runs 21 --deps build/bench-deps   # pydantic, msgspec copied there
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# The same three sections in each library: train (an int >= 1, a bool), smoke (a choice), the plan holding both.
MODELS = {
    "floor (dataclasses, typing)": "import dataclasses, typing",
    "torchrelay.errors (every verb imports it)": "import torchrelay.errors",
    "torchrelay.util.schema": "import torchrelay.util.schema",
    "torchrelay.controller.plan (all sections)": "import torchrelay.controller.plan",
    "pydantic 2": textwrap.dedent(
        """
        from typing import Literal
        import pydantic
        from pydantic import BaseModel, ConfigDict, Field

        class TrainSpec(BaseModel):
            model_config = ConfigDict(extra="forbid", strict=True)
            script: str
            nproc_per_node: int = Field(default=1, ge=1)
            srun: bool = False

        class SmokeSpec(BaseModel):
            model_config = ConfigDict(extra="forbid", strict=True)
            when: Literal["always", "first", "never"] = "always"
            updates: int = 3
            save_every: int = 2

        class Plan(BaseModel):
            model_config = ConfigDict(extra="forbid", strict=True)
            run_dir: str
            train: TrainSpec
            smoke: SmokeSpec = SmokeSpec()
        """
    ),
    "msgspec": textwrap.dedent(
        """
        from typing import Annotated, Literal
        import msgspec

        class TrainSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
            script: str
            nproc_per_node: Annotated[int, msgspec.Meta(ge=1)] = 1
            srun: bool = False

        class SmokeSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
            when: Literal["always", "first", "never"] = "always"
            updates: int = 3
            save_every: int = 2

        class Plan(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
            run_dir: str
            train: TrainSpec
            smoke: SmokeSpec = msgspec.field(default_factory=SmokeSpec)
        """
    ),
}

BAD = {
    "a string for an int": {"run_dir": "r", "train": {"script": "t.py", "nproc_per_node": "two"}},
    "a misspelt field": {"run_dir": "r", "train": {"script": "t.py"}, "smoke": {"updatez": 3}},
    "a bool for an int": {"run_dir": "r", "train": {"script": "t.py"}, "smoke": {"updates": True}},
    "a value out of range": {"run_dir": "r", "train": {"script": "t.py", "nproc_per_node": 0}},
    "a missing field": {"run_dir": "r", "train": {"nproc_per_node": 2}},
}

VALIDATE = {
    "torchrelay.util.schema": (
        "from torchrelay.controller.plan import Plan\ndef check(data):\n    Plan.from_dict(data, '.')\n"
    ),
    "pydantic 2": "def check(data):\n    Plan.model_validate(data)\n",
    "msgspec": "def check(data):\n    msgspec.convert(data, Plan)\n",
}


PEERS = ("pydantic 2", "msgspec")
DEPS: list[str] = []  # --deps: folders holding pydantic and msgspec, for the peers only


def _python_for(name: str, other: str) -> tuple[str, str]:
    if name in PEERS:
        return other, os.pathsep.join([*DEPS, str(SRC)])
    return sys.executable, str(SRC)


def _run(python: tuple[str, str], code: str) -> str:
    env = {**os.environ, "PYTHONPATH": python[1]}
    out = subprocess.run([python[0], "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{python} failed:\n{code}\n{out.stderr}")
    return out.stdout


def import_seconds(python: tuple[str, str], body: str) -> float:
    # CPU time, not wall: on a shared machine waiting for a core is not the import's cost (the shape of the
    # result is the same on an idle one, only less noisy)
    code = "import time\nt0 = time.process_time()\n" + body + "\nprint(time.process_time() - t0)\n"
    return float(_run(python, code).strip().splitlines()[-1])


def messages(python: tuple[str, str], name: str) -> dict[str, str]:
    body = MODELS.get(name, "") + "\n" + VALIDATE[name]
    code = body + textwrap.dedent(
        f"""
        import json
        out = {{}}
        for case, data in json.loads({json.dumps(json.dumps(BAD))}).items():
            try:
                check(data)
                out[case] = "(accepted)"
            except Exception as exc:
                out[case] = f"{{type(exc).__name__}}: {{exc}}"
        print(json.dumps(out))
        """
    )
    return json.loads(_run(python, code).strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--python", default=sys.executable, help="an interpreter with pydantic and msgspec")
    ap.add_argument(
        "--deps", action="append", default=[], help="a folder with pydantic and msgspec (PYTHONPATH)"
    )
    ap.add_argument("--peers", default="pydantic,msgspec", help="the peers to measure, comma-separated")
    args = ap.parse_args()
    DEPS.extend(args.deps)
    left_out = [name for name in PEERS if name.split()[0] not in args.peers.split(",")]
    for name in left_out:
        MODELS.pop(name)
        VALIDATE.pop(name)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print(f"import CPU time, median of {args.runs} fresh interpreters, interleaved (ms; ratio to the floor)")
    times: dict[str, list[float]] = {name: [] for name in MODELS}
    for _ in range(args.runs):  # interleaved, so that a busy moment of the machine hits every candidate alike
        for name, body in MODELS.items():
            times[name].append(import_seconds(_python_for(name, args.python), body) * 1000)
    floor = statistics.median(times[next(iter(MODELS))])
    for name, ms in times.items():
        med = statistics.median(ms)
        print(f"  {name:44s} {med:8.1f} ms  {med / floor:6.2f}x  (min {min(ms):.1f}, max {max(ms):.1f})")
    for name in VALIDATE:
        print(f"\nmessages of {name}:")
        for case, text in messages(_python_for(name, args.python), name).items():
            print(f"  {case}: {text}".replace("\n", "\n      "))


if __name__ == "__main__":
    main()
