"""Where a copy may be written: never into what it reads, nor inside any run directory, bundle or checkpoint.

Shared by pack, prepare and export (tools that do not import each other), so it sits below them."""

from __future__ import annotations

import os
from pathlib import Path

from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.errors import ConfigError
from torchrelay.paths.layout import CONTRACT_FILE
from torchrelay.util.safepath import is_inside


def refuse_nested(source: Path, source_what: str, dest: Path, dest_what: str) -> None:
    """Refuse a destination that is the source, lies inside it or holds it (links followed): the copy would
    write into what it reads (a run prepared inside its bundle fails the bundle's next verify)."""
    if is_inside(source, dest):
        inside = "is" if os.path.realpath(source) == os.path.realpath(dest) else "lies inside"
        problem = f"the {dest_what} {dest} {inside} the {source_what} {source}"
    elif is_inside(dest, source):
        problem = f"the {source_what} {source} lies inside the {dest_what} {dest}"
    else:
        return
    raise ConfigError(problem, hint=f"choose a {dest_what} outside the {source_what} (and not holding it)")


def refuse_inside_runs(dest: Path, dest_what: str, owned: Path | None = None) -> None:
    """Refuse a destination inside any run directory, bundle or checkpoint, not only the one read (links followed):
    a file written there is one no inventory (or SHA256SUMS) lists, and the next resume refuses that checkpoint.
    `owned`: a folder of a run that torchrelay itself writes (validation's own folder): a destination inside it may
    lie in that run directory, never inside a checkpoint."""
    real = Path(os.path.realpath(dest))
    mine = Path(os.path.realpath(owned)) if owned is not None else None
    for folder in (real, *real.parents):
        if (folder / INVENTORY).is_file():
            what = "checkpoint"
        elif (folder / CONTRACT_FILE).is_file():
            if mine is not None and is_inside(mine, real) and is_inside(folder, mine):
                continue
            what = "run directory (or bundle)"
        else:
            continue
        raise ConfigError(
            f"the {dest_what} {dest} lies inside the {what} {folder}",
            hint=f"choose a {dest_what} outside every run directory, bundle and checkpoint",
        )
