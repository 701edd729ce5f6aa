"""What every node of a run must share with rank 0's: the versions in use and the program's own files."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchrelay import __version__
from torchrelay.errors import ConfigError
from torchrelay.identity.code import running_files
from torchrelay.util.hashing import sha256_or_none


def node_fingerprint(code_dir: str | os.PathLike[str] | None, pins: list[str]) -> dict[str, Any]:
    """What every node of a run must share with rank 0's: the versions (python, torch, torchrelay, each pin; a pin
    not met here is refused here) and the content of the program's own files, relative to this node's code
    directory (a node-local checkout may lie elsewhere, it may not differ)."""
    root = Path(code_dir).resolve() if code_dir is not None else None
    files = running_files(code_dir)
    return {
        "versions": versions(pins),
        "code": {rel: sha256_or_none(root / rel) for rel in files} if root is not None else {},
    }


def fingerprint_summary(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The versions and one digest of the program files: what every rank sends at open (the files themselves
    only when a digest differs, to name them)."""
    code = json.dumps(fingerprint.get("code") or {}, sort_keys=True).encode()
    return {"versions": fingerprint.get("versions") or {}, "code_sha256": hashlib.sha256(code).hexdigest()}


def fingerprint_differences(reference: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """`what: reference's -> other's` for each version and each program file (present on both) that differ."""
    out = []
    ref_v, other_v = reference.get("versions") or {}, other.get("versions") or {}
    for name in sorted(set(ref_v) | set(other_v)):
        if ref_v.get(name) != other_v.get(name):
            out.append(f"{name} {ref_v.get(name)} -> {other_v.get(name)}")
    ref_c, other_c = reference.get("code") or {}, other.get("code") or {}
    for rel in sorted(set(ref_c) & set(other_c)):
        if ref_c[rel] != other_c[rel]:
            out.append(f"{rel} sha256 {str(ref_c[rel])[:12]}… -> {str(other_c[rel])[:12]}…")
    return out


def versions(pins: list[str]) -> dict[str, str]:
    """python, torch, torchrelay, and each pinned package's installed version; a pin not met is refused."""
    from importlib import metadata  # here: a tenth of the import of `torchrelay ledger`, which never pins

    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrelay": __version__,
    }
    for pin in pins:
        if "==" not in pin:
            raise ConfigError(f"pin {pin!r} must have the form name==version")
        name, wanted = (s.strip() for s in pin.split("==", 1))
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "not installed"
        if have != wanted:
            raise ConfigError(
                f"pinned package {name} must be {wanted}, but {have} is installed",
                hint=f"install it with `pip install {name}=={wanted}` or change the run's pins",
            )
        out[name] = have
    return out
