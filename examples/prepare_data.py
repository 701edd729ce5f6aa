"""Make a real text data set from this machine's Python standard library: a data root and a manifest.

Each sample is a run of whole source lines (at most --max-bytes bytes) of one stdlib module. The
manifest names each sample's file by its absolute path under the data root, as cluster manifests do,
so moving the data means rebasing the manifest (which `torchrelay prepare` does, with proof).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sysconfig
from pathlib import Path


def build(out: Path, files: int, max_bytes: int) -> tuple[Path, Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = (out / "root").resolve()
    root.mkdir(parents=True, exist_ok=True)
    sources = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 4000)[:files]
    manifest = out / "manifest.jsonl"
    with open(manifest, "w") as f:
        for src in sources:
            dst = root / src.name
            shutil.copyfile(src, dst)
            data = dst.read_bytes()
            start, chunk = 0, 0
            lines = data.splitlines(keepends=True)
            pos = 0
            for line in lines:
                if pos + len(line) - start > max_bytes and pos > start:
                    f.write(
                        json.dumps(
                            {
                                "id": f"{src.stem}#{chunk}",
                                "path": str(dst),
                                "offset": start,
                                "length": pos - start,
                            }
                        )
                        + "\n"
                    )
                    start, chunk = pos, chunk + 1
                pos += len(line)
            if pos > start:
                f.write(
                    json.dumps(
                        {
                            "id": f"{src.stem}#{chunk}",
                            "path": str(dst),
                            "offset": start,
                            "length": min(pos - start, max_bytes),
                        }
                    )
                    + "\n"
                )
    return root, manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--max-bytes", type=int, default=128)
    args = parser.parse_args()
    root, manifest = build(args.out, args.files, args.max_bytes)
    n = len(manifest.read_text().splitlines())
    print(f"data root {root}\nmanifest {manifest} ({n} samples)")


if __name__ == "__main__":
    main()
