"""A DataLoader whose order does not depend on its worker count, and that reports the ids it delivered.

The batch sampler yields, for this rank, the fixed slice of every (update, micro-step) from the resume
position on: resuming is a jump, not a replay, and any `num_workers` gives the same batches in the same
order because DataLoader returns batches in sampler order whatever worker produced them. A dataset that sets
`wants_context = True` receives a SampleContext (index, epoch, update, seed) instead of the bare index, so its
augmentation can depend on the epoch inside the workers (see data/sample.py).

Worker processes are forked from the rank, as torch's DataLoader does, unless another Python thread is alive when
they start; then they come from a forkserver. What a fork can break is a lock another thread holds at that moment,
copied held into a child where nothing will ever release it, and then taken by the child. The native threads a
rank has by then (gloo's TCP and run loops, NCCL's watchdogs, CUDA's) hold only their own library's locks, which a
worker never takes (it runs no collective and may not touch CUDA); malloc's and stdio's locks are reset by glibc
at the fork, OpenMP's pool by torch's fork handler. A Python thread is another matter: stdout's buffer, a queue, a
module's lock, any native lock inside the call it is in (a checkpoint's write, a hash) may be held, and a worker
prints, unpickles and runs torch. torchrelay's own threads (persist, reserve, retention, reads) are never alive when
the workers start (once per segment, before the first update and after the restore has joined its readers);
tqdm's monitor (Trainer's progress bar) may be: its lock is held across the fork, so it is asleep; and so may a
queue feeder of another DataLoader, which takes only its own queue's locks. The forkserver is a
fresh process with no threads, with torch and the script's imports imported once, that forks each worker; it costs
one more import of all of them (seconds of CPU with transformers; benchmarks/RESULTS.md, "Trainer resume with
loader workers"). Workers outlive the stop signals that torchrun or Slurm send to a rank's whole process group
(the rank stops at its next boundary and ends them), end on a SIGTERM from their own rank, and die with their parent.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import functools
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from torchrelay.data.order import GlobalOrder
from torchrelay.data.sample import SampleContext
from torchrelay.errors import ConfigError
from torchrelay.policy.stop import STOP_SIGNALS

CONTEXTS = ("forkserver", "spawn", "fork")
PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class RankBatches:
    """The batch sampler: manifest indices per micro-step for one rank, from `start_update` on."""

    order: GlobalOrder
    start_update: int
    total_updates: int
    rank: int
    world_size: int
    micro_batch: int
    grad_accum: int
    context: bool = False  # yield SampleContexts instead of bare indices

    def __iter__(self) -> Iterator[list[Any]]:
        for u in range(self.start_update, self.total_updates):
            epoch = self.order.epoch_of(u)
            for m in range(self.grad_accum):
                slot = self.order.slot(u, m, self.rank, self.world_size, self.micro_batch)
                if self.context:
                    yield [SampleContext(i, epoch, u + 1, self.order.seed) for i in slot]
                else:
                    yield slot

    def __len__(self) -> int:
        return (self.total_updates - self.start_update) * self.grad_accum


class _Tagged(Dataset):
    """Returns (index, item) so the loop can log which samples a batch really held."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitem__(self, key: int | SampleContext) -> tuple[int, Any]:
        return (key.index if isinstance(key, SampleContext) else key), self.dataset[key]

    def __len__(self) -> int:
        return len(self.dataset)


class _TaggedCollate:
    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, samples: list[tuple[int, Any]]) -> tuple[list[int], Any]:
        return [i for i, _ in samples], self.collate_fn([item for _, item in samples])


def _worker_init(rank_pid: int, worker_id: int) -> None:
    """First thing in every worker: a stop signal is the rank's business, and the worker dies with its parent.

    torchrun (and `scancel`) signal a rank's whole process group; the rank stops at its next boundary and ends
    its workers then. But a SIGTERM from the rank itself (DataLoader's shutdown, multiprocessing's exit handler
    terminating what is left) must still end the worker, or the rank would wait for it forever. So the stop
    signals stay blocked, as the worker was started, and one thread takes each and looks at who sent it.
    """
    if hasattr(signal, "sigwaitinfo"):
        threading.Thread(
            target=_take_stop_signals, args=(rank_pid,), name="torchrelay-signals", daemon=True
        ).start()
    else:  # no sigwaitinfo (macOS): ignore them; the rank's shutdown then waits for its workers to finish
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    # A rank killed outright must not leave workers behind (DataLoader's own watchdog only looks while the worker
    # waits for work). The parent is the rank's thread that started the loader, or the forkserver.
    die_with_parent()


def _take_stop_signals(rank_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo(STOP_SIGNALS)
        if info.si_signo == signal.SIGTERM and info.si_pid == rank_pid:
            # Exit 0, as torch's own worker handler does for its parent's SIGTERM: the rank's SIGCHLD check (torch's
            # _error_if_any_worker_fails) reports any other end as a failed worker, "exited unexpectedly with exit
            # code 143": a second traceback at the exit of a rank that failed with its workers alive
            # (multiprocessing's exit handler terminates them, then joins).
            os._exit(0)


def _libc_prctl() -> Any:
    """libc's prctl, looked up where this module is imported: in the rank, before any worker is forked. A forked
    worker then calls it without dlopen or dlsym, which take the dynamic loader's lock: a lock another thread of the
    rank (a native one: gloo's, torch's) may have held at the fork, for good in the child."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the thread that started it ends (elsewhere: nothing happens)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


class _Probe(pickle.Pickler):
    """Pickles into nothing, to learn whether an object can reach a worker; tensors and arrays always can."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy":
            return (type(None), ())
        return NotImplemented


class _Sink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(b)


def unpicklable(obj: Any) -> str | None:
    """Why `obj` cannot be sent to a forkserver's worker, or None when it can."""
    try:
        _Probe(_Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as exc:  # noqa: BLE001 - any failure of pickle is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


def other_python_threads() -> list[str]:
    """The threads other than this one that run Python code, by name: threading's, and any native thread that is
    inside Python now (it has a frame). Two kinds are left out. tqdm's monitor is asleep across a fork
    (`_monitors_held`). A multiprocessing queue's feeder (another DataLoader's, alive a while after it ends, or
    for good with persistent workers) takes only its own queue's locks, and a worker never uses that queue."""
    threads = threading.enumerate()
    skip = {threading.get_ident()} | {
        t.ident for t in threads if _is_tqdm_monitor(t) or _is_queue_feeder(t) or _target_returned(t)
    }
    named = {t.ident: t.name for t in threads if t.ident not in skip}
    current_frames = getattr(sys, "_current_frames", dict)
    for ident in current_frames():
        if ident not in named and ident not in skip:
            named[ident] = f"a native thread in Python ({ident})"
    return sorted(named.values())


def _target_returned(thread: threading.Thread) -> bool:
    """The thread's target has returned (Thread.run drops it then) and the thread is only leaving: a loader's own
    queue feeders, once its queues close, are listed a moment longer without their target."""
    return not hasattr(thread, "_target")


def _is_queue_feeder(thread: threading.Thread) -> bool:
    from multiprocessing import queues

    feed = getattr(
        queues.Queue, "_feed", None
    )  # the feeder's target, while it runs (CPython's multiprocessing)
    return feed is not None and getattr(thread, "_target", None) is feed


def _is_tqdm_monitor(thread: threading.Thread) -> bool:
    monitor = getattr(sys.modules.get("tqdm._monitor"), "TMonitor", None)
    return monitor is not None and isinstance(thread, monitor) and thread.is_alive()


@contextlib.contextmanager
def _monitors_held() -> Iterator[None]:
    """tqdm's monitor (one a process, started with Trainer's progress bar) sleeps, and does everything else,
    including writing to the terminal, under its bars' lock: held here, no fork can find the monitor holding any
    lock a worker might take."""
    locks = []
    for thread in threading.enumerate():
        if _is_tqdm_monitor(thread):
            locks.append(thread.tqdm_cls.get_lock())  # type: ignore[attr-defined]
    with contextlib.ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


def forks_workers(others: list[str] | None = None) -> bool:
    """Whether workers nobody asked a start method for are forked: no other thread of this process runs Python
    (`others`, the names `other_python_threads` gives, or looked at now), so no lock a worker takes can be held."""
    return not (other_python_threads() if others is None else others)


def main_unguarded() -> str | None:
    """Why worker processes may not import the training script (forkserver and spawn workers do), or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None  # an interactive session or `python -c`: workers import nothing
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError) as exc:
        return f"{path} cannot be read ({exc})"
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            return None
    return (
        f'{path} has no `if __name__ == "__main__":` block, so a worker importing it would run the training'
    )


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [n for n in sides if isinstance(n, ast.Name) and n.id == "__name__"]
    consts = [n for n in sides if isinstance(n, ast.Constant) and n.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


@dataclass(slots=True)
class RelayLoader:
    """What `Run.dataloader` returns; the run builds the real DataLoader at the resume position."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any] | None
    num_workers: int
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    multiprocessing_context: str | None = None  # None: forkserver when it can run, else fork (see `context`)
    # the other Python threads `context` saw when it last chose (describe() names them)
    _seen: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def wants_context(self) -> bool:
        """The dataset asked for SampleContexts (`wants_context = True`) instead of bare indices."""
        return getattr(self.dataset, "wants_context", False) is True

    def context(self, others: list[str] | None = None) -> tuple[str | None, str | None]:
        """(start method of the workers, a note when the default had to fall back to fork).

        others: the other threads of this process that run Python (default: `other_python_threads()` now). With
        none, and no start method asked for, the workers are forked, as torch's DataLoader does; with some, a
        forkserver starts them, so that no lock one of those threads holds is copied into a worker.
        """
        if self.num_workers == 0:
            return None, None
        if others is None:
            others = other_python_threads()
        self._seen = others  # what describe() names as the reason for a forkserver
        asked = self.multiprocessing_context
        if asked is not None and asked not in CONTEXTS:
            raise ConfigError(f"run.dataloader(multiprocessing_context={asked!r}): choose one of {CONTEXTS}")
        if asked == "fork" or (asked is None and forks_workers(others)):
            return "fork", None
        why = main_unguarded()
        if why is None:
            bad = unpicklable((_Tagged(self.dataset), _TaggedCollate(self.collate_fn)))
            why = bad and f"the dataset or collate_fn cannot be pickled for the workers ({bad})"
        if why is None:
            return asked or "forkserver", None
        if asked is not None:
            raise ConfigError(
                f"run.dataloader(multiprocessing_context={asked!r}): {why}",
                hint='keep the training under `if __name__ == "__main__":` and the dataset picklable '
                "(paths and records, files opened in __getitem__), or ask for multiprocessing_context='fork'",
            )
        return "fork", (
            f"loader workers are forked from the rank, not started by a forkserver: {why}; a fork copies the "
            "locks that the rank's other Python threads hold (a rare hang); see docs/LOOP.md, DataLoader workers"
        )

    def describe(self, context: str | None) -> str:
        """The line a rank says before its first update: how many workers, started how, and why a forkserver (the
        threads `context` saw when it chose: a look later sees the threads of that moment, not of the choice)."""
        line = f"LOADER_WORKERS {self.num_workers} {context}"
        others = []
        if context == "forkserver" and self.multiprocessing_context is None:
            others = self._seen if self._seen is not None else other_python_threads()
        return line + (f" (other Python threads: {', '.join(others)})" if others else "")

    def build(self, batches: RankBatches, seed: int, context: str | None = None) -> DataLoader:
        # An explicit generator keeps DataLoader from drawing its base seed from the global torch RNG,
        # which would shift every later draw by a different amount in a resumed process.
        gen = torch.Generator()
        gen.manual_seed(seed * 1_000_003 + batches.start_update)
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
            kwargs["worker_init_fn"] = functools.partial(_worker_init, os.getpid())
            if context is not None:
                kwargs["multiprocessing_context"] = _mp_context(context)
        if self.wants_context:
            batches = dataclasses.replace(batches, context=True)
        return DataLoader(
            _Tagged(self.dataset),
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=_TaggedCollate(self.collate_fn),
            pin_memory=self.pin_memory,
            generator=gen,
            **kwargs,
        )

    def start(self, batches: RankBatches, seed: int, context: str | None = None) -> Iterator[Any]:
        """The batches from the resume position on; the workers (and a forkserver) start here."""
        loader = self.build(batches, seed, context)
        if self.num_workers == 0:
            return iter(loader)
        # Children inherit the signal mask of the thread that starts them, through exec too: blocked from their
        # first instruction, the workers cannot die of a stop signal before _worker_init takes them over (and the
        # forkserver and multiprocessing's resource tracker keep them blocked for life). A signal for this
        # process meanwhile waits, and is handled as soon as the mask is restored.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            if context in ("forkserver", "spawn"):
                # The resource tracker unblocks SIGTERM as its start ends; started here, not inside iter(), the
                # mask is set again before the forkserver starts.
                resource_tracker.ensure_running()
                signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                return iter(loader)
            with _monitors_held():  # iter() forks every worker before it returns
                return iter(loader)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def script_imports() -> list[str]:
    """The modules the training script imports at its top level, as this process has them loaded.

    Each worker of a forkserver imports the script (as `__mp_main__`), and with it whatever the script imports:
    transformers is seconds of CPU per worker, eight workers per rank. Python 3.11's forkserver would preload
    `__main__` itself, but looks for a key its preparation data never holds. So the server imports these instead,
    once; a worker's import of the script then finds them loaded. `from P import name` also names the module that
    defines `name` (transformers resolves its names lazily, module by module). Only modules already imported here
    are named: nothing the rank did not run itself.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return []
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return []
    names: dict[str, None] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(dict.fromkeys(a.name for a in node.names))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names[node.module] = None
            package = sys.modules.get(node.module)
            for alias in node.names:
                defined = getattr(getattr(package, alias.name, None), "__module__", None)
                if isinstance(defined, str):
                    names[defined] = None
                names[f"{node.module}.{alias.name}"] = None  # a submodule imported by name
    return [n for n in names if n in sys.modules and n != "__main__"]


def _mp_context(name: str) -> Any:
    ctx = multiprocessing.get_context(name)
    if name == "forkserver":
        # Workers fork from a server that imported torch and the script's imports once, so each one starts in a
        # fraction of a second; this is ignored once a server runs.
        ctx.set_forkserver_preload(["torch", *script_imports(), "torchrelay.data.forkserver_preload"])
    return ctx


def start_forkserver(num_workers: int, asked: str | None = None, others: list[str] | None = None) -> bool:
    """Start the workers' forkserver now, if the loader will want one (workers, the script under a main guard, and
    a forkserver asked for, or, asked for nothing, other threads running Python now, as `RelayLoader.context`
    decides): it imports while the rank goes on (builds its model and optimizer, restores its checkpoint), and the
    first batch no longer waits for it. A loader that then starts its workers another way (the threads ended, an
    unpicklable dataset) leaves the server unused; one that finds threads that were not there yet starts the
    server itself, later. True when one was started."""
    if num_workers < 1 or asked not in (None, "forkserver") or main_unguarded() is not None:
        return False
    if asked is None and forks_workers(others):
        return False  # the workers will be forked (RelayLoader.context), unless Python threads appear
    from multiprocessing import forkserver

    _mp_context("forkserver")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # as in RelayLoader.start: blocked for life
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return True
