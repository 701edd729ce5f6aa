"""The import graph follows docs/ARCHITECTURE.md: a module imports only from its own layer or the ones below, and
one tool never imports another tool — except the few imports that document names as debt (issue 10)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "torchrelay"

# (prefix of a module path under torchrelay, layer); the longest matching prefix wins
LAYERS = [
    ("util", 0), ("errors", 0), ("config.envvars", 0), ("records.ended", 0), ("log", 0),
    ("paths", 1), ("config", 1), ("records", 1), ("identity", 1), ("manifest", 1),
    ("checkpoint", 1), ("storage", 1),
    ("data", 2), ("policy", 2), ("readers", 2), ("run", 2), ("ledger", 2), ("records.summary", 2),
    ("handoff", 3), ("audit", 3), ("report", 3), ("export", 3), ("integrations", 3),
    ("controller", 4),
    ("cli", 5), ("commands", 5), ("__main__", 5),
]  # fmt: skip
TOOL_LAYER = 3
# Tool-to-tool imports that exist today, each a piece of issue 10's debt; a new one fails this test.
KNOWN_TOOL_IMPORTS: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")


def _top(module: str) -> str:
    return module.split(".")[0]


def _layer(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, layer)
    return best[1] if best else None


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.startswith("torchrelay."):
                found.add(name.removeprefix("torchrelay."))
    return found


def test_every_module_has_a_layer() -> None:
    files = [p for p in SRC.rglob("*.py") if "_site" not in p.parts and p != SRC / "__init__.py"]
    missing = sorted(_module(p) for p in files if _layer(_module(p)) is None)
    assert not missing, (
        f"place these modules in a layer (tests/test_layers.py, docs/ARCHITECTURE.md): {missing}"
    )


def test_imports_point_down_and_tools_stay_apart() -> None:
    wrong, used = [], set()
    for path in SRC.rglob("*.py"):
        if path == SRC / "__init__.py" or "_site" in path.parts:
            continue  # the package's lazy re-exports; the audit's sitecustomize runs inside the user's script
        mod = _module(path)
        own = _layer(mod)
        for target in _imports(path):
            layer = _layer(target)
            if layer is None or own is None:
                continue  # `from torchrelay import __version__` and the like
            if layer > own:
                wrong.append(f"{mod} (layer {own}) imports {target} (layer {layer})")
            elif layer == own == TOOL_LAYER and _top(mod) != _top(target):
                if (_top(mod), _top(target)) not in KNOWN_TOOL_IMPORTS:
                    wrong.append(f"tool {mod} imports tool {target}")
                used.add((_top(mod), _top(target)))
    assert not wrong, "\n".join(sorted(wrong))
    # a debt paid off leaves the list, so that it cannot come back unnoticed
    assert used >= KNOWN_TOOL_IMPORTS, (
        f"no longer imported, remove from KNOWN_TOOL_IMPORTS: {KNOWN_TOOL_IMPORTS - used}"
    )


def test_no_test_imports_from_benchmarks() -> None:
    """Benchmarks may use the tests' support modules, never the other way: a test must not break when a benchmark
    is edited or dropped, and the fast tier must not import a benchmark's heavy setup."""
    tests = Path(__file__).resolve().parent
    folder = "bench" + "marks"  # spelled apart, so this file does not match its own rule
    benches = {p.stem for p in (tests.parent / folder).glob("*.py")}
    found = []
    for path in sorted(tests.glob("*.py")):
        if path.name == "test_benchmarks.py":
            continue  # the one test whose subject is the benchmarks: it runs each at a toy size in a process of its own
        source = path.read_text()
        if f'"{folder}"' in source:  # a path to the folder: put on sys.path or loaded by file name
            found.append(f"{path.name}: names the benchmarks folder")
        if not any(name in source for name in benches):
            continue  # the parse below is for the files that could import one
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            )
            found += [f"{path.name}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in benches]
    assert not found, found


def test_the_light_verbs_import_no_torch() -> None:
    """`status`, `stop` and `ledger` read files: the import of torch would be most of their time (5 CPU s at load, of
    a LingBot-sized ledger's 6; benchmarks/RESULTS.md). So does the ledger's background prover, which runs beside
    the training on its node."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom torchrelay.cli import build_parser\n"
        "for verb in ('status', 'stop', 'ledger'):\n    build_parser(verb)\n"
        "import torchrelay.ledger.prover\n"
        "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_every_verb_s_help_imports_no_torch() -> None:
    """`torchrelay VERB --help` starts in well under a second on a quiet 2-core machine: building any verb's
    parser imports no torch (2 s of `launch --help` and `export --help` were its import, issue 51)."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom torchrelay.cli import VERBS, build_parser\n"
        "heavy = []\n"
        "for verb in VERBS:\n    build_parser(verb)\n"
        "    heavy += [f'{verb}: {m}' for m in ('torch', 'safetensors') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_offline_readers_resolve_and_the_light_ones_import_no_torch() -> None:
    """torchrelay.readers is the public module of docs/CORE_API.md: every name it lists resolves, and the readers
    that `status` and `ledger` use load without torch (the tensor readers bring it when asked for)."""
    import subprocess
    import sys

    import torchrelay.readers as readers

    assert all(callable(getattr(readers, name)) for name in readers.__all__)
    code = (
        "import sys\nimport torchrelay.readers as r\n"
        "for name in ('RunDir', 'stored_config', 'summarize', 'prove', 'read_history', 'write_request'):\n"
        "    getattr(r, name)\n"
        "print(sorted(m for m in ('torch', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
