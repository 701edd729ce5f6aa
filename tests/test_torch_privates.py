"""torch's private names live in one adapter, checkpoint/torch_compat.py, with the torch versions it was tested on:
a release that moves one then breaks that module alone (issue 20). The scan reads src/ as text (no import)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src" / "torchrelay"
ADAPTER = SRC / "checkpoint" / "torch_compat.py"
# Modules whose private names count: torch's own, and pickle's (the metadata unpickler hooks pickle._Unpickler).
OWNERS = ("torch", "pickle")
# Private attributes read with getattr from objects of other libraries (or torchrelay's own marks), not torch's.
NOT_TORCH = {
    "_tr_loss": "transformers.Trainer's running loss (integrations/transformers.py)",
    "_fingerprint": "datasets.Dataset's hash (integrations/hf_contract.py)",
    "_tracked": "torchrelay's Run (audit/probe.py)",
    "_torchrelay_probe_n": "torchrelay's own count on an iterator (audit/probe.py)",
    "_current_frames": "CPython's sys: which native threads run Python now (data/loader.py)",
    "_feed": "multiprocessing.queues.Queue's feeder, the target of its thread (data/loader.py)",
    "_target": "threading.Thread's target (data/loader.py: is this thread a queue's feeder)",
}
_PRIVATE = re.compile(r"^_(?!_)")  # _name, not __dunder__


def _private(dotted: str) -> bool:
    return any(_PRIVATE.match(part) for part in dotted.split("."))


def _torch_attributes() -> set[str]:
    """Private attribute names of the torch objects torchrelay handles (read on any receiver but self/cls)."""
    from torch.distributed.tensor import DTensor

    kinds = [torch.Tensor, DTensor, torch.UntypedStorage, torch.nn.Module, torch.optim.Optimizer]
    kinds += [torch.utils.data.DataLoader, torch.Generator]
    return {name for kind in kinds for name in dir(kind) if _PRIVATE.match(name)}


def uses(source: str, torch_attributes: set[str]) -> list[str]:
    """Each use of a private name of torch or pickle in `source`: `line: what`."""
    tree = ast.parse(source)
    found: list[str] = []
    bound: set[str] = set()  # names bound by an import from torch or pickle (modules and their members)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in OWNERS:
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if _private(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OWNERS:
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(node.module) or _PRIVATE.match(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            receiver = node.value.id if isinstance(node.value, ast.Name) else None
            if (isinstance(root, ast.Name) and root.id in bound) or (
                node.attr in torch_attributes and receiver not in ("self", "cls")
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = (
                node.args[1]
                if node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                else None
            )
            text = name.value if isinstance(name, ast.Constant) else None
            if isinstance(text, str) and _PRIVATE.match(text) and text not in NOT_TORCH:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2:
            module, member = node.elts
            if (
                isinstance(module, ast.Constant)
                and isinstance(member, ast.Constant)
                and isinstance(module.value, str)
                and isinstance(member.value, str)
                and module.value.split(".")[0] in OWNERS
                and (_private(module.value) or _PRIVATE.match(member.value))
            ):
                found.append(f"{node.lineno}: the name {module.value}.{member.value}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_no_torch_private_outside_the_adapter() -> None:
    attributes = _torch_attributes()
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        if path != ADAPTER:
            wrong += [f"{path.relative_to(SRC)}:{use}" for use in uses(path.read_text(), attributes)]
    assert not wrong, (
        "move these into src/torchrelay/checkpoint/torch_compat.py (one adapter, its tested torch "
        + ("versions beside it):\n" + "\n".join(wrong))
    )


def test_the_scan_sees_every_kind_of_use() -> None:
    """Each way a private name has been reached in src/ is caught (so the test above can fail)."""
    attributes = _torch_attributes()
    cases = {
        "from torch.distributed._shard._utils import narrow_tensor_by_index": 1,
        "from torch.distributed.checkpoint.filesystem import _StorageInfo": 1,
        "import torch._C": 1,
        "import torch\nr = torch._C.PyTorchFileReader": 1,
        "import pickle\nclass U(pickle._Unpickler): pass": 1,
        "import torch.utils.data.dataloader as dl\nx = dl._BaseDataLoaderIter": 1,
        "import torch\nisinstance(m, torch.nn.modules.batchnorm._BatchNorm)": 1,
        "def f(t):\n    return t._local_tensor, t._spec": 2,
        "offset = getattr(storage, '_checkpoint_offset', None)": 1,
        "ALLOWED = {('torch._utils', '_get_layout'), ('torch.distributed.checkpoint.filesystem', '_StorageInfo')}": 2,
    }
    for source, count in cases.items():
        assert len(uses(source, attributes)) == count, (source, uses(source, attributes))
    clean = (
        "import torch\nimport torch.distributed.checkpoint as dcp\nclass W(dcp.FileSystemWriter):\n"
        "    def f(self):\n        return self._private, torch.nn.Linear, getattr(x, '_tr_loss', None)\n"
    )
    assert uses(clean, attributes) == []


def test_the_adapter_names_the_torch_it_was_tested_on() -> None:
    """A torch outside the tested window (2.8 ... 2.13) fails here until torch_compat's names are checked on it."""
    from torchrelay.checkpoint import torch_compat

    for name in torch_compat.__all__:
        assert getattr(torch_compat, name) is not None, name
    window = [tuple(int(p) for p in v.split(".")[:2]) for v in torch_compat.TESTED_TORCH]
    running = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert min(window) <= running <= max(window), (
        f"torch {torch.__version__} is outside the window torchrelay's private names were tested on "
        f"({torch_compat.TESTED_TORCH}): check each in src/torchrelay/checkpoint/torch_compat.py, then add it"
    )
