"""Rewrite references to torchrelay's former top-level modules to their packages (issue 48, item 5).

Run from a repository root, on a branch written before the move: `python scripts/move48.py [FILE ...]` (default:
every file git tracks). It rewrites dotted names (`torchrelay.ledger_proof` -> `torchrelay.ledger.proof`, also in
strings such as `python -m` and monkeypatch targets), file paths (`torchrelay/rundir.py`) and
`from torchrelay import envvars` lines. Run `ruff check --fix` afterwards to sort the imports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

MAP = {
    "config": "config.relay",
    "tuning": "config.tuning",
    "envvars": "config.envvars",
    "contract": "records.contract",
    "history": "records.history",
    "train_records": "records.train",
    "validation_records": "records.validation",
    "ended": "records.ended",
    "digests": "records.digests",
    "reshard": "records.reshard",
    "summary": "records.summary",
    "ledger": "ledger.exposure",
    "ledger_proof": "ledger.proof",
    "ledger_prover": "ledger.prover",
    "layout": "paths.layout",
    "rundir": "paths.rundir",
    "lock": "paths.lock",
    "destinations": "paths.destinations",
    "stop": "policy.stop",
    "costmodel": "policy.costmodel",
    "slurm": "controller.slurm",
    "torchrun": "controller.torchrun",
    "validation": "controller.validation",
    "proctree": "util.proctree",
    "kill_points": "util.kill_points",
    "numerics": "identity.numerics",
    "rng": "checkpoint.state.rng",
    "resume_check": "checkpoint.resume_check",
    "lr_shape": "run.lr_shape",
}
_NAMES = "|".join(sorted(MAP, key=len, reverse=True))
# `config` and `ledger` are old modules and new packages: a name already inside the package is left alone, so that
# running the script twice changes nothing.
_INSIDE = {
    old: "|".join(new.split(".")[-1] for new in MAP.values() if new.startswith(old + ".")) for old in MAP
}
_ALTERNATIVES = "|".join(
    rf"{old}(?!(?:\.| import )(?:{_INSIDE[old]})\b)" if _INSIDE[old] else old
    for old in sorted(MAP, key=len, reverse=True)
)
# The old module, not a name that starts with it (`torchrelay.ledger_proof` is not `torchrelay.ledger` + `_proof`).
DOTTED = re.compile(rf"\btorchrelay\.({_ALTERNATIVES})(?![\w])")
SLASHED = re.compile(rf"\btorchrelay/({_NAMES})\.py\b")
FROM = re.compile(r"^(\s*)from torchrelay import ([^\n()]+?)(\s*#.*)?$", re.M)
# one module imported inside a line, as in the code of a `python -c` string
INLINE = re.compile(rf"(?:(?<=[;\"'] )|(?<=[\"']))from torchrelay import ({_NAMES})\b(?! as)")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".sh", ".cfg", ".yml", ".yaml", ".ini"}


def _from_line(m: re.Match[str]) -> str:
    indent, body, comment = m.group(1), m.group(2), m.group(3) or ""
    keep, moved = [], []
    for item in (s.strip() for s in body.split(",") if s.strip()):
        name, _, alias = (part.strip() for part in item.partition(" as "))
        if name not in MAP:
            keep.append(item)
            continue
        parent, _, base = MAP[name].rpartition(".")
        local = alias or name
        moved.append(
            f"{indent}from torchrelay.{parent} import {base}" + ("" if local == base else f" as {local}")
        )
    if not moved:
        return m.group(0)
    lines = ([f"{indent}from torchrelay import {', '.join(keep)}"] if keep else []) + moved
    lines[0] += comment
    return "\n".join(lines)


def rewrite(text: str, python: bool) -> str:
    # Dotted names first: the lines `_from_line` writes name the new packages and must not be rewritten again.
    text = DOTTED.sub(lambda m: "torchrelay." + MAP[m.group(1)], text)
    text = SLASHED.sub(lambda m: "torchrelay/" + MAP[m.group(1)].replace(".", "/") + ".py", text)
    if python:
        text = FROM.sub(_from_line, text)
        text = INLINE.sub(
            lambda m: "from torchrelay.{} import {}".format(*MAP[m.group(1)].rsplit(".", 1)), text
        )
    return text


def main(argv: list[str]) -> int:
    files = (
        argv or subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.split()
    )
    changed = 0
    for name in files:
        path = Path(name)
        if path.suffix not in SUFFIXES or not path.is_file() or path.name == "move48.py":
            continue
        if "fixtures" in path.parts and path.suffix != ".py":
            continue  # recorded runs and bundles keep the bytes their checksums cover
        text = path.read_text()
        new = rewrite(text, path.suffix == ".py")
        if new != text:
            path.write_text(new)
            changed += 1
    print(f"rewrote {changed} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
