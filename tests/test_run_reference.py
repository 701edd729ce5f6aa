"""docs/RUN.md lists every public attribute of a `Run` and a `Step`, and `run.manifest_path` is the manifest the
dataset reads: the run's own copy, not the file the configuration named (issue 51)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, clean_env

SCRIPT = """
import json, sys
import torchrelay as tr

class Rows:
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i): return i

if __name__ == "__main__":
    manifest, root, run_dir = sys.argv[1:4]
    cfg = tr.RelayConfig(seed=1, micro_batch=2, grad_accum=1, total_updates=1, warmup_updates=0,
                         manifest=manifest, data_root=root)
    seen = {}
    with tr.Run.open(run_dir, cfg) as run:
        for step in run.steps(run.dataloader(Rows(len(run.manifest)), collate_fn=list)):
            for _micro, _batch in step.micro_batches():
                pass
            seen["step"] = sorted(a for a in dir(step) if not a.startswith("_"))
        seen["run"] = sorted(a for a in set(dir(run)) | set(vars(run)) if not a.startswith("_"))
        seen["manifest_path"] = str(run.manifest_path)
        seen["dir_manifest_path"] = str(run.dir.manifest_path)
        seen["first_path"] = run.manifest.records[0]["path"]
    print("SEEN " + json.dumps(seen))
    sys.exit(run.exit_code)
"""


def test_every_public_attribute_is_on_the_reference_page_and_the_manifest_is_the_run_s(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    root.mkdir()
    manifest = tmp_path / "mine.jsonl"
    rows = [{"id": f"s{i}", "path": str(root / f"{i}.bin")} for i in range(4)]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(manifest), str(root), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    seen = json.loads(out.stdout.split("SEEN ", 1)[1])
    assert (
        seen["manifest_path"]
        == seen["dir_manifest_path"]
        == str(tmp_path / "run" / "data" / "manifest.jsonl")
    )
    assert Path(seen["manifest_path"]).is_file() and seen["first_path"] == str(root / "0.bin")
    page = (REPO / "docs" / "RUN.md").read_text()
    listed = set(re.findall(r"`(?:run|step|Run)\.(\w+)", page))
    assert not [a for a in seen["run"] if a not in listed], [a for a in seen["run"] if a not in listed]
    assert not [a for a in seen["step"] if a not in listed], [a for a in seen["step"] if a not in listed]
    assert "docs/RUN.md" in (REPO / "README.md").read_text()


def test_the_readme_loop_divides_by_the_layout_s_grad_accum() -> None:
    # A move to another world size derives another grad_accum (tests/test_elastic.py); the user's own config keeps
    # the old one: dividing by it scaled the gradient after a move 2 -> 1 (found by a script of a reader's own).
    skeleton = (REPO / "README.md").read_text().split("## The loop in one screen", 1)[1].split("```", 2)[1]
    divided = re.findall(r"/\s*([\w.]+)\.grad_accum", skeleton)
    assert divided == ["run.config"], divided
