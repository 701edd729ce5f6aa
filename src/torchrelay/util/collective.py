"""The one cross-rank failure protocol: a rank's exception in any collective phase becomes the same error on
every rank, and no rank waits for a peer that has failed (docs/FAILURES.md).

Every exchange of the protocol starts with the same collective: one all-reduce (MAX) of a few integers on the
phase's process group, the first of which says whether a rank failed, and which. When none did, the exchange
goes on with its own payload (an all-gather, a gather, a scatter) or just returns the integers (the stop
agreement's code and interval travel in them); when one did, every rank gathers the failures (one line each) and
raises the same error, naming the rank. Because every exchange starts alike, a rank that fails anywhere takes
part in the exchange its peers are waiting in, whichever call site they reached: a rank that fails before a
collective still joins it, with its failure. `phase(...)` is that guard around a block of work, ending with an
exchange when the block succeeded, so that no rank leaves a phase before every rank finished it.

The policy, once:
- The group: the training thread's exchanges go over a gloo group of their own (`ranks()`), created by the first
  exchange (every rank reaches it at the same point: opening the run), with a timeout of its own
  (TIMEOUT_S, TORCHRELAY_COLLECTIVE_TIMEOUT_S): CPU-only, so a CUDA run never synchronizes its stream to agree,
  and never the group the training's own collectives run on. The persist thread passes its own gloo group
  (run/saver.py): one group is never used by two threads at once.
- The error: the lowest failing rank's, of its class and exit code, its message prefixed with the phase and the
  rank; the other failing ranks are named after it. An error that is not the library's own (a bug) keeps its
  traceback on the rank that raised it; the others raise a RelayError (exit 1) pointing to it.
- Who says it: rank 0, at once (unless its own failure is a bug: its traceback says it), then every rank meets
  once more before raising, so that no rank ends (and torchrun ends the others) before rank 0 said it. Every
  rank raises the error marked as reported: its excepthook prints nothing more and exits with the code.
- A peer that died or stopped answering: gloo raises in the waiting ranks at once when a peer's process ends
  (its sockets close), or after TORCHRELAY_COLLECTIVE_TIMEOUT_S when it hangs; the exchange then raises one line saying so (exit 1), or
  the rank's own failure if it had one.
- A failure where the peers go on without an exchange (a micro-batch that cannot be read, run/loop.py's Feed):
  the rank holds it (`Ranks.defer`) and keeps entering the collectives its peers enter; the next exchange it
  enters, the one its peers enter at the same point, carries it, and the error is named by the phase it
  happened in.
- With one process there is nothing to agree: the error is raised as it is (an OSError as the PathError or
  DiskFull it means), and nothing is printed here.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import torchrelay.config.envvars as envvars
from torchrelay.errors import RelayError, from_exception, mark_reported, report
from torchrelay.util.failures import Failure, agreed_error, is_agreed, mark_agreed, unwrap

T = TypeVar("T")

WIDTH = 2  # integers an exchange carries beside the failure flag (the stop agreement's code and interval)


@dataclass(slots=True)
class _Phase:
    name: str
    hint: str | None
    translate: Callable[[BaseException], BaseException] | None
    settle: Callable[[RelayError], None] | None
    name_rank: bool


_local = threading.local()


def _settle(phase: _Phase, err: RelayError) -> None:
    """The phase's own record of the failure (opening records a refused segment), before any rank raises."""
    if phase.settle is not None:
        with contextlib.suppress(Exception):  # settling must not hide the failure
            phase.settle(err)


def _current(name: str) -> _Phase:
    """The innermost phase open on this thread (it names the error), else a bare one named `name`."""
    stack: list[_Phase] = getattr(_local, "stack", [])
    return stack[-1] if stack else _Phase(name, None, None, None, True)


class Ranks:
    """The ranks of one process group, as the protocol talks to them; every rank calls the same exchanges in the
    same order (the group's collectives are matched by order, not by call site)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        on = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if on else 1
        self.alone = self.size == 1
        self.rank = dist.get_rank() if on else 0  # the global rank: what messages name
        self._root = 0 if self.alone else dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        self.coordinator = self.rank == self._root
        self._pending: BaseException | None = None  # this rank's own exception while it is being agreed

    # ------------------------------------------------------------------------------------- the exchange
    def exchange(
        self, name: str, failure: Failure | None = None, ints: Sequence[int] = (), lost_hint: str = ""
    ) -> list[int]:
        """Every rank's `ints` reduced by MAX (at most WIDTH); raises the agreed error when any rank failed.
        `lost_hint`: what to check first when the peers never come (a call some ranks skip)."""
        if self.alone:
            return list(ints)
        held: tuple[Failure, BaseException] | None = getattr(_local, "deferred", None)
        if held is not None:
            _local.deferred = None
            # This rank failed earlier: its peers learn it here, in an exchange they enter.
            if failure is None:
                self._pending = held[1]
                return self._fail(name, held[0])
        values = [0] * (WIDTH + 1)
        values[1 : 1 + len(ints)] = list(ints)
        if failure is not None:
            values[0] = self.size - failure.rank  # the largest is the lowest failing rank
        t = torch.tensor(values, dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a peer died or hung: said in one line
            raise self._lost(name, failure, exc, lost_hint) from None
        if int(t[0]) == 0:
            return [int(v) for v in t[1 : 1 + len(ints)]]
        return self._raise(name, failure)

    def _raise(self, name: str, failure: Failure | None) -> Any:
        """A rank failed: every rank gathers the failures and raises the same error."""
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, failure, group=self.group)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(name, failure, exc) from None
        failures = sorted((f for f in out if f is not None), key=lambda f: f.rank)
        phase = _current(name)
        err = agreed_error(phase.name, failures, name_rank=phase.name_rank)
        if phase.hint is not None and failures[0].phase is None:
            err.hint = phase.hint
        _settle(phase, err)
        if self.rank == 0 and not (failure is not None and failure.bug):
            report(err, 0)
        mark_reported(err)
        # Rank 0 has said it before any rank ends (torchrun ends the others once one has); a peer that ended
        # meanwhile changes nothing: the error stands.
        with contextlib.suppress(Exception):
            dist.barrier(group=self.group)
        raise mark_agreed(err)

    def _lost(self, name: str, failure: Failure | None, exc: BaseException, first: str = "") -> RelayError:
        """What a rank raises when the exchange itself failed (a peer ended or did not answer in time)."""
        if failure is not None:
            return mark_agreed(agreed_error(_current(name).name, [failure]))  # type: ignore[return-value]
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return mark_agreed(  # type: ignore[return-value]
            RelayError(
                f"{_current(name).name}: rank {self.rank} lost its peers ({text})",
                hint=(first and f"{first}; or ")
                + f"another rank ended or did not answer within {envvars.COLLECTIVE_TIMEOUT_S.get():g} s: its output says why "
                "(TORCHRELAY_COLLECTIVE_TIMEOUT_S sets the wait)",
            )
        )

    # ------------------------------------------------------------------------------------- guarded work
    def _attempt(self, name: str, fn: Callable[[], T]) -> tuple[T | None, Failure | None]:
        """Run this rank's part; a failure comes back as a Failure, or is raised at once when it needs no
        agreement (already agreed, an interrupt) or when this process is alone."""
        try:
            return fn(), None
        except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
            return None, self._failure(name, exc)

    def _failure(self, name: str, exc: BaseException) -> Failure:
        if is_agreed(exc) or not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
            raise exc  # every rank raises it already, or an interrupt / exit that is not a failure to share
        phase = _current(name)
        raw = exc
        if phase.translate is not None:
            exc = phase.translate(exc)
            if exc is not raw:
                exc.__cause__ = raw
        failure = Failure.of(exc, self.rank, phase.name)
        if (
            self.alone
        ):  # no exchange, but the same settling as with many ranks (a refused segment is recorded)
            if failure.bug is not None:
                _settle(phase, agreed_error(phase.name, [failure], name_rank=phase.name_rank))
                raise exc
            err = exc if isinstance(exc, RelayError) else from_exception(unwrap(exc)[1], phase.name)
            if phase.hint is not None and err is not raw:
                err.hint = phase.hint
            _settle(phase, err)
            raise err from (None if err is raw else raw)
        self._pending = exc  # raised in place of the agreed error when it is a bug (its traceback)
        return failure

    def _fail(self, name: str, failure: Failure) -> Any:
        """This rank failed: join the exchange the others wait in; raise the agreed error (or the bug)."""
        original, self._pending = self._pending, None
        try:
            self.exchange(name, failure)
        except RelayError as err:
            if failure.bug is not None and original is not None:
                raise mark_agreed(original) from None  # its traceback; the others raise `err` already
            raise err from original
        raise AssertionError("an exchange with a failure always raises")  # pragma: no cover

    def defer(self, name: str, exc: BaseException) -> None:
        """This rank failed in phase `name` where its peers go on without an exchange, inside collectives of the
        training's own that this rank must still enter (DDP's gradient all-reduce, FSDP's all-gathers): the failure
        is held, and the next exchange this thread enters carries it, the one its peers enter at the same point
        (the stop agreement, a save, the segment's end); every rank then raises it, named by `name`. Raised at
        once when this process is alone (and, like any phase, an interrupt or an agreed error at once)."""
        failure = self._failure(name, exc)
        original, self._pending = self._pending, None
        _local.deferred = (replace(failure, phase=_current(name).name), original)

    def agree(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` on every rank; returns this rank's value once every rank succeeded."""
        value, failure = self._attempt(name, fn)
        if failure is not None:
            self._fail(name, failure)
        self.exchange(name)
        return value  # type: ignore[return-value]

    def agree_max(self, name: str, fn: Callable[[], Sequence[int]], lost_hint: str = "") -> list[int]:
        """`fn()` (at most WIDTH integers) on every rank; their MAX over ranks, in one all-reduce."""
        value, failure = self._attempt(name, fn)
        if failure is not None:
            self._fail(name, failure)
        return self.exchange(name, ints=value or (), lost_hint=lost_hint)

    def all_gather(self, name: str, fn: Callable[[], T]) -> list[T]:
        """`fn()` on every rank; every rank's value, in rank order, once every rank succeeded."""
        value, failure = self._attempt(name, fn)
        if failure is not None:
            self._fail(name, failure)
        if self.alone:
            return [value]  # type: ignore[list-item]
        self.exchange(name)
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.group)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(name, None, exc) from None
        return out

    def gather(self, name: str, fn: Callable[[], T]) -> list[T] | None:
        """`fn()` on every rank; every rank's value on the coordinator (the group's first rank), None elsewhere."""
        value, failure = self._attempt(name, fn)
        if failure is not None:
            self._fail(name, failure)
        if self.alone:
            return [value]  # type: ignore[list-item]
        self.exchange(name)
        out: list[Any] | None = [None] * self.size if self.coordinator else None
        try:
            dist.gather_object(value, out, dst=self._root, group=self.group)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(name, None, exc) from None
        return out

    def scatter(self, name: str, fn: Callable[[], list[T]] | None) -> T:
        """`fn()` on the coordinator (one value per rank, in rank order): each rank receives its own."""
        parts, failure = self._attempt(name, fn) if self.coordinator and fn is not None else (None, None)
        if failure is not None:
            self._fail(name, failure)
        if self.alone:
            assert parts is not None
            return parts[0]
        self.exchange(name)
        box: list[Any] = [None]
        try:
            dist.scatter_object_list(
                box, parts if self.coordinator else None, src=self._root, group=self.group
            )
        except Exception as exc:  # noqa: BLE001
            raise self._lost(name, None, exc) from None
        return box[0]

    def broadcast(self, name: str, fn: Callable[[], T] | None) -> T:
        """`fn()` on the coordinator; its value on every rank."""
        value, failure = self._attempt(name, fn) if self.coordinator and fn is not None else (None, None)
        if failure is not None:
            self._fail(name, failure)
        if self.alone:
            return value  # type: ignore[return-value]
        self.exchange(name)
        box: list[Any] = [value]
        try:
            dist.broadcast_object_list(box, src=self._root, group=self.group)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(name, None, exc) from None
        return box[0]

    @contextmanager
    def phase(
        self,
        name: str,
        *,
        hint: str | None = None,
        translate: Callable[[BaseException], BaseException] | None = None,
        settle: Callable[[RelayError], None] | None = None,
        name_rank: bool = True,
        end: bool = True,
    ) -> Iterator[None]:
        """A phase every rank runs: an exception escaping the block on one rank joins the exchange its peers
        wait in (inside the block or after it) and becomes the same error on every rank; the block's exchanges
        name this phase. `hint`: what to do, for any failure of the phase; `translate`: applied to this rank's
        exception first; `settle`: called on every rank with the agreed error before any rank raises it (rank 0
        records a refused launch); `name_rank=False`: a failure of rank 0 keeps its own message (rank 0 alone
        acted); `end`: an exchange ends the block, so that no rank goes on before every rank finished it."""
        stack: list[_Phase] = _local.__dict__.setdefault("stack", [])
        stack.append(_Phase(name, hint, translate, settle, name_rank))
        try:
            try:
                yield
            except BaseException as exc:  # noqa: BLE001 - every rank must learn of it
                failure = self._failure(name, exc)
                self._fail(name, failure)
            if end:
                self.exchange(name)
        finally:
            stack.pop()


# (a weak reference to the default group it was made for, or None before one exists; the protocol over its own
# group). Weak: a script's destroy_process_group() must free the default group then, not at the interpreter's end.
_training: list[tuple[weakref.ref[Any] | None, Ranks]] = []
_training_lock = threading.Lock()
# The protocol over each group torchrelay made (own_group: the training thread's, the background save's).
_holding: weakref.WeakSet[Ranks] = weakref.WeakSet()
_registered = False


class _Released:
    """What a Ranks holds after the exit handler let go of its group: a collective given it fails at once."""

    def __repr__(self) -> str:
        return "<a process group released at exit>"


def own_group(**kwargs: Any) -> Ranks:
    """A gloo group of torchrelay's own (every rank makes it at the same point), as the protocol over it; the one
    maker of such groups, so that the exit handler knows each of them (release_groups)."""
    global _registered
    peers = Ranks(dist.new_group(backend="gloo", **kwargs))
    _holding.add(peers)
    if not _registered:
        _registered = True
        atexit.register(release_groups)
    return peers


def release_groups() -> None:
    """Let go of every process group torchrelay holds, while the interpreter is alive (an exit handler).

    A group dies when its last reference does; dying, a gloo group joins its worker threads, one of which may
    still hold the last collective's work, whose tensors were made in Python: letting go of them takes the GIL.
    During the interpreter's finalization a thread that takes the GIL is ended by an unwind C++ cannot pass
    (`terminate called without an active exception`: SIGABRT, and the exit code a stop promised is lost). So the
    groups torchrelay made die here (the script's destroy_process_group() unregistered them, or they stay
    registered and die with the script's own): every Ranks holding one lets go of it, reachable or not (a Run in
    a reference cycle), with no collection of the heap (it would hold a rank's exit up for as long as the heap
    takes to walk, and torchrun ends the ranks still running once one has ended with a code other than 0)."""
    with _training_lock:
        _training.clear()
    for peers in list(_holding):
        peers.group = _Released()
    _holding.clear()


def _same_world(key: weakref.ref[Any] | None, world: Any) -> bool:
    return world is None if key is None else world is not None and key() is world


def ranks(group: Any = None) -> Ranks:
    """The protocol over `group`, or over the training thread's own gloo group (made by the first call after the
    default group is initialized, which every rank makes at the same point: opening the run)."""
    if group is not None:
        return Ranks(group)
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    with _training_lock:
        if _training and _same_world(_training[0][0], world):
            return _training[0][1]
        if world is not None and dist.get_world_size() > 1:
            peers = own_group(timeout=timedelta(seconds=envvars.COLLECTIVE_TIMEOUT_S.get()))
        else:
            peers = Ranks(None)
        key = weakref.ref(world) if world is not None else None
        _training[:] = [(key, peers)]  # a default group made anew (after destroy) gets its own
        return _training[0][1]


def deferred() -> bool:
    """Whether this thread holds a failure for its next exchange (Ranks.defer)."""
    return getattr(_local, "deferred", None) is not None


def take_deferred() -> BaseException | None:
    """The held failure, as this rank alone raises it (no exchange came: the script left the loop first)."""
    held: tuple[Failure, BaseException] | None = getattr(_local, "deferred", None)
    _local.deferred = None
    if held is None:
        return None
    failure, original = held
    if failure.bug is not None:
        return original
    err = agreed_error(failure.phase or "training", [failure])
    err.__cause__ = original
    return err


def agree(name: str, fn: Callable[[], T]) -> T:
    """`fn()` on every rank of the training thread's group; the same error on every rank if one failed."""
    return ranks().agree(name, fn)


def phase(name: str, **kwargs: Any) -> Any:
    """Ranks.phase over the training thread's group."""
    return ranks().phase(name, **kwargs)
