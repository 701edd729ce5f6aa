"""A probe inside the audited processes: digests of the batches that the script's own DataLoaders deliver, and
of the random streams the script holds where a segment begins.

torchrelay's ledger records what its own loader delivers. A script that also (or instead) draws batches from
a DataLoader of its own is invisible to it, so the audit puts `_site/` on PYTHONPATH; its sitecustomize calls
`install()` in every process of the launch, which records, per rank, a digest of each batch such a loader
yields, with the update it was drawn in. Two runs whose digests part were fed different data.

At the start of the updates the audit names (the first update of each continued segment, and the same updates
of the uninterrupted run) the probe also digests the state of every random stream the process holds besides the
global ones torchrelay restores: each torch.Generator, numpy Generator and random.Random that the script's own
frames and globals hold. A stream whose state differs there restarted instead of continuing; when they all agree, a
difference at the resume lies in non-random state. At the same updates it digests the state tensors the process
holds besides parameters: every buffer of the tracked model and of modules the script holds, and the tensor
attributes of the objects registered with `run.track`. One that differs between the ranks of the uninterrupted run
and comes back otherwise after the resume is state that differs by rank and was saved once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from torchrelay.config import envvars
from torchrelay.errors import RelayError
from torchrelay.util.jsonl import read_records
from torchrelay.util.safepath import open_writable, refuse_link

ENV = envvars.AUDIT_PROBE.name  # the folder the probe writes rank<r>.jsonl into; unset: the probe is off
# Updates at whose start the probe also records the state of every random stream the process holds
# (streams-rank<r>.jsonl): the audit passes the first update of each continued segment.
STREAMS_AT_ENV = envvars.AUDIT_STREAMS_AT.name
SITE_DIR = Path(__file__).resolve().parent / "_site"

_state: dict[str, Any] = {"update": 0}


def _digest(obj: Any, h: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _digest(item, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())


def _record(it: Any, batch: Any) -> None:
    # torch is loaded by now: the batch came from it
    from torchrelay.checkpoint.torch_compat import index_sampler

    batches = index_sampler(it)
    if type(batches).__module__.startswith("torchrelay."):
        return  # torchrelay's own loader: the exposure ledger already records it
    sampler = getattr(batches, "sampler", batches)
    count = getattr(it, "_torchrelay_probe_n", 0)
    it._torchrelay_probe_n = count + 1
    h = hashlib.sha256()
    _digest(batch, h)
    rank = os.environ.get("RANK", "0")
    line = {
        "update": _state["update"],
        "n": count,
        "sampler": type(sampler).__name__,
        "sha": h.hexdigest()[:20],
    }
    _append(f"rank{rank}.jsonl", line)


def install() -> None:
    """Wrap DataLoader iteration and torchrelay's Step so each foreign batch is recorded with its update."""
    if not envvars.AUDIT_PROBE.is_set() or _state.get("installed"):
        return
    import importlib

    from torchrelay.checkpoint.torch_compat import DataLoaderIter  # torch: only once the probe is on

    relay_run = importlib.import_module("torchrelay.run")  # already in sys.modules when the hook calls us

    original_next = DataLoaderIter.__next__
    original_step = relay_run.Step.__init__
    original_track = relay_run.Run.track

    def track(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state["run"] = self  # what the script registered, to digest its state tensors at the resume
        return original_track(self, *args, **kwargs)

    def __next__(self: Any) -> Any:
        batch = original_next(self)
        with contextlib.suppress(Exception):  # the probe must never break the audited run
            _record(self, batch)
        return batch

    streams_at = set(envvars.AUDIT_STREAMS_AT.get())

    def step_init(self: Any, update: int, *args: Any, **kwargs: Any) -> None:
        _state["update"] = update
        if update in streams_at:
            with contextlib.suppress(Exception):  # the probe must never break the audited run
                _record_streams(update)
        original_step(self, update, *args, **kwargs)

    DataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
    relay_run.Step.__init__ = step_init
    relay_run.Run.track = track
    _state["installed"] = True


def random_streams() -> list[tuple[str, str]]:
    """(type, digest of its state) of each random stream the script itself holds, but the global ones.

    The script's own objects are the locals of its frames on the main thread's stack and the globals of its
    `__main__`, and one level inside each (an attribute, a list or dict entry): an augmentation object holding a
    generator is found, the private streams of libraries (tempfile's names, seeded from the OS) are not.
    """
    import random

    import torch

    kinds: tuple[type, ...] = (torch.Generator, random.Random)
    with contextlib.suppress(ImportError):
        import numpy

        kinds = (*kinds, numpy.random.Generator)
    skip = {id(torch.default_generator), id(random._inst)}
    if torch.cuda.is_available():
        skip |= {id(g) for g in torch.cuda.default_generators}
    roots = [obj for _, obj in _script_roots()]
    found: dict[int, Any] = {}

    def consider(obj: Any) -> bool:
        if isinstance(obj, kinds) and not isinstance(obj, random.SystemRandom):
            if id(obj) not in skip:
                found[id(obj)] = obj
            return True
        return False

    for root in roots:
        if consider(root) or isinstance(root, type) or type(root).__name__ == "module":
            continue
        inner: list[Any] = []
        if isinstance(root, list | tuple | set):
            inner = list(root)
        elif isinstance(root, dict):
            inner = list(root.values())
        elif hasattr(root, "__dict__"):
            with contextlib.suppress(TypeError):
                inner = list(vars(root).values())
        for item in inner:
            consider(item)

    out = []
    for stream in found.values():
        if isinstance(stream, torch.Generator):
            kind, state = "torch.Generator", bytes(stream.get_state().numpy().tobytes())
        elif isinstance(stream, random.Random):
            kind, state = "random.Random", repr(stream.getstate()).encode()
        else:
            kind, state = "numpy Generator", repr(stream.bit_generator.state).encode()
        out.append((kind, hashlib.sha256(state).hexdigest()[:20]))
    return sorted(out)


def _script_roots() -> list[tuple[str, Any]]:
    """(name, object) of the globals of `__main__` and the locals of the script's own frames on the main thread."""
    import sysconfig
    import threading

    libraries = tuple(
        str(Path(p).resolve())
        for p in {
            *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
            str(Path(__file__).resolve().parents[1]),  # torchrelay itself
        }
        if p
    )
    roots: list[tuple[str, Any]] = []
    main = sys.modules.get("__main__")
    if main is not None:
        roots += list(vars(main).items())
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and not str(Path(name).resolve()).startswith(libraries):
            roots += list(frame.f_locals.items())
        frame = frame.f_back
    return roots


def state_tensors() -> dict[str, str]:
    """{name: digest} of the tensors the process holds as state, parameters aside (see the module docstring).

    The tracked model's buffers are `model.<buffer>`, a tracked object's are `<track name>.<attribute>`, the
    buffers of a module the script holds without tracking it are `<variable>.<buffer>`. Plain tensors among the
    script's locals are left out: they are the previous update's leftovers, which a resumed process never has.
    """
    import torch

    from torchrelay.checkpoint.ranks import tensor_digest

    seen: set[int] = set()
    out: dict[str, str] = {}

    def add(name: str, tensor: Any) -> None:
        if (
            isinstance(tensor, torch.Tensor)
            and not isinstance(tensor, torch.nn.Parameter)
            and id(tensor) not in seen
        ):
            seen.add(id(tensor))
            out[name] = tensor_digest(tensor)

    def holder(name: str, obj: Any) -> None:
        if isinstance(obj, torch.nn.Module):
            for buf_name, buf in obj.named_buffers():
                add(f"{name}.{buf_name}", buf)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for attr, value in list(vars(obj).items()):
                add(f"{name}.{attr}", value)

    run = _state.get("run")
    tracked = getattr(run, "_tracked", None)  # what the script passed to run.track (run/saver.py's Tracked)
    if tracked is not None:
        if tracked.model is not None:
            holder("model", tracked.model)
        for name, obj in dict(tracked.statefuls).items():
            holder(name, obj)
    for name, obj in _script_roots():
        if isinstance(obj, torch.nn.Module):
            holder(name, obj)
    return dict(sorted(out.items()))


def global_streams() -> dict[str, str]:
    """{name: digest} of the global generators torchrelay seeds or restores: Python's `random`, numpy's, torch's
    CPU generator and each CUDA device's. Two launches that start update 1 with one in another state drew it
    from the OS; one that moves between the starts of two updates is drawn from during an update."""
    import random

    import torch

    states: dict[str, bytes] = {
        "random": repr(random.getstate()).encode(),
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
    }
    with contextlib.suppress(ImportError):
        import numpy

        states["numpy"] = repr(numpy.random.get_state(legacy=False)).encode()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            states[f"cuda:{i}"] = bytes(state.numpy().tobytes())
    return {k: hashlib.sha256(v).hexdigest()[:20] for k, v in sorted(states.items())}


def dropout_modules() -> list[str]:
    """`<name> p=<p>` of each dropout module with p > 0 in the tracked model and the modules the script holds."""
    import torch

    from torchrelay.checkpoint.torch_compat import DropoutBase

    kinds = (DropoutBase,)
    roots: list[tuple[str, Any]] = []
    tracked = getattr(_state.get("run"), "_tracked", None)
    if tracked is not None and tracked.model is not None:
        roots.append(("model", tracked.model))
    roots += [(n, o) for n, o in _script_roots() if isinstance(o, torch.nn.Module)]
    found: dict[int, str] = {}
    for root_name, root in roots:
        for name, module in root.named_modules():
            if isinstance(module, kinds) and float(getattr(module, "p", 0.0)) > 0 and id(module) not in found:
                found[id(module)] = f"{root_name}.{name}".rstrip(".") + f" p={module.p:g}"
    return sorted(found.values())


def _record_streams(update: int) -> None:
    rank = os.environ.get("RANK", "0")
    line: dict[str, Any] = {"update": update, "streams": random_streams()}
    with contextlib.suppress(Exception):  # the stream digests stand on their own
        line["tensors"] = state_tensors()
    with contextlib.suppress(Exception):
        line["globals"] = global_streams()
    with contextlib.suppress(Exception):
        line["dropout"] = dropout_modules()
    _append(f"streams-rank{rank}.jsonl", line)


def _append(name: str, line: dict[str, Any]) -> None:
    """Append `line` to the probe's file `name`; a link at the folder or the file is refused, never written
    through (the audit's reader refuses it too, naming it)."""
    folder = Path(envvars.AUDIT_PROBE.get())
    try:
        refuse_link(folder, what="the audit probe's folder")
        folder.mkdir(parents=True, exist_ok=True)
        fd = open_writable(folder / name, what="the audit probe's record", append=True)
    except RelayError as exc:
        if not _state.get("refused"):  # once: the probe is called for every batch
            print(f"[torchrelay audit] probe: {exc.message}", file=sys.stderr)
        _state["refused"] = True
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def read_streams(folder: Path) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """`{(rank, update): [(type, digest), ...]}` of the random streams recorded at the start of each update."""
    out: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for path in sorted(folder.glob("streams-rank*.jsonl")) if folder.is_dir() else []:
        rank = int(path.stem.removeprefix("streams-rank"))
        for row in read_records(path):
            out[(rank, int(row["update"]))] = [(str(k), str(d)) for k, d in row["streams"]]
    return out


def read_tensors(folder: Path) -> dict[tuple[int, int], dict[str, str]]:
    """`{(rank, update): {name: digest}}` of the state tensors recorded at the start of each update."""
    out: dict[tuple[int, int], dict[str, str]] = {}
    for path in sorted(folder.glob("streams-rank*.jsonl")) if folder.is_dir() else []:
        rank = int(path.stem.removeprefix("streams-rank"))
        for row in read_records(path):
            if isinstance(row.get("tensors"), dict):
                out[(rank, int(row["update"]))] = {str(k): str(v) for k, v in row["tensors"].items()}
    return out


def read_globals(folder: Path) -> dict[tuple[int, int], dict[str, str]]:
    """`{(rank, update): {generator: digest}}` of the global generators at the start of each recorded update."""
    out: dict[tuple[int, int], dict[str, str]] = {}
    for path in sorted(folder.glob("streams-rank*.jsonl")) if folder.is_dir() else []:
        rank = int(path.stem.removeprefix("streams-rank"))
        for row in read_records(path):
            if isinstance(row.get("globals"), dict):
                out[(rank, int(row["update"]))] = {str(k): str(v) for k, v in row["globals"].items()}
    return out


def read_dropout(folder: Path) -> list[str] | None:
    """The dropout modules (p > 0) any recorded scan saw; None when no scan recorded them."""
    seen: set[str] | None = None
    for path in sorted(folder.glob("streams-rank*.jsonl")) if folder.is_dir() else []:
        for row in read_records(path):
            if isinstance(row.get("dropout"), list):
                seen = (seen or set()) | {str(x) for x in row["dropout"]}
    return None if seen is None else sorted(seen)


def read(folder: Path) -> dict[int, list[tuple[int, str]]]:
    """`{rank: [(update, digest), ...]}` in the order the batches were drawn."""
    out: dict[int, list[tuple[int, str]]] = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("rank[0-9]*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        rows = read_records(path)
        out[rank] = [(int(r["update"]), str(r["sha"])) for r in rows]
    return out


def samplers(folder: Path) -> list[str]:
    """The sampler classes of the script's own loaders that the probe saw."""
    names: set[str] = set()
    for path in sorted(folder.glob("rank[0-9]*.jsonl")) if folder.is_dir() else []:
        names.update(str(row.get("sampler")) for row in read_records(path))
    return sorted(names)
