"""SHA-256 with its chaining state recorded every PART_BYTES: a file hashed once, front to back, as it is written,
can then be verified in parts on many threads, each part from the state before it.

SHA-256 digests a file block by block, carrying 32 bytes of state from each block to the next; the digest is the
last state, finalised. The writer records that state at every part boundary (`PartHasher.states`). A reader checks
part k by starting from state k-1 (the standard initial state for part 0), hashing part k and comparing the result
with state k, the last part's result finalised and compared with the file's SHA-256. When every part matches, the
chain from the initial state through every byte is the file's SHA-256 (each link was checked), so the proof is the
whole-file digest's, whatever the recorded states claim; a wrong state only fails a part.

The state is not exposed by hashlib: this uses the libcrypto that hashlib itself loaded, through its SHA256_CTX
functions (deprecated in OpenSSL 3, still exported by its default builds). Where they are missing, `available()`
is False: the writer records no states and readers hash each file in order, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# The state is recorded every this many bytes (a multiple of SHA-256's 64-byte block): small enough that a load's
# tail (its last part, hashed after its last read) is short, large enough that the inventory stays small.
PART_BYTES = 16 << 20
MIN_PART_BYTES = 1 << 20  # the smallest part a reader accepts from an inventory (bounds the work per state)
_BLOCK = 64


class _Ctx(ctypes.Structure):
    """OpenSSL's SHA256_CTX: eight 32-bit state words, the bit count (low, high), a partial block."""

    _fields_ = [
        ("h", ctypes.c_uint32 * 8),
        ("Nl", ctypes.c_uint32),
        ("Nh", ctypes.c_uint32),
        ("data", ctypes.c_uint32 * 16),
        ("num", ctypes.c_uint32),
        ("md_len", ctypes.c_uint32),
    ]


_lib: Any = None
_probed = False
_probe_lock = threading.Lock()


def _libcrypto_path() -> str | None:
    """The libcrypto hashlib linked (the same library, not a second copy), else the system's."""
    try:
        import _hashlib  # noqa: F401  # loads libcrypto into the process

        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcrypto" in path:
                    return path
    except (ImportError, OSError):
        pass
    return ctypes.util.find_library("crypto")


def _load() -> Any:
    global _lib, _probed
    with _probe_lock:
        if _probed:
            return _lib
        _probed = True
        path = _libcrypto_path()
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)  # CDLL: each call releases the GIL
            for name in ("SHA256_Init", "SHA256_Update", "SHA256_Final"):
                getattr(lib, name)
        except (OSError, AttributeError):
            return None
        ptr = ctypes.POINTER(_Ctx)
        lib.SHA256_Init.argtypes = [ptr]
        lib.SHA256_Update.argtypes = [ptr, ctypes.c_void_p, ctypes.c_size_t]
        lib.SHA256_Final.argtypes = [ctypes.c_char_p, ptr]
        # the structure's layout is checked, not assumed: a state taken midway and resumed gives hashlib's digest
        data = bytes(range(256)) * 8
        ctx = _Ctx()
        lib.SHA256_Init(ctypes.byref(ctx))
        lib.SHA256_Update(ctypes.byref(ctx), data[:1024], 1024)
        resumed = _resume(lib, bytes(ctx.h), 1024)
        lib.SHA256_Update(ctypes.byref(resumed), data[1024:], len(data) - 1024)
        out = ctypes.create_string_buffer(32)
        lib.SHA256_Final(out, ctypes.byref(resumed))
        if out.raw != hashlib.sha256(data).digest():
            return None
        _lib = lib
        return lib


def available() -> bool:
    """Whether part states can be recorded and checked in this process."""
    return _load() is not None


def _resume(lib: Any, state: bytes, offset: int) -> _Ctx:
    """A context that continues a hash from `state` (32 bytes as the structure holds them) after `offset` bytes."""
    ctx = _Ctx()
    lib.SHA256_Init(ctypes.byref(ctx))
    ctypes.memmove(ctx.h, state, 32)
    bits = offset * 8
    ctx.Nl, ctx.Nh = bits & 0xFFFFFFFF, bits >> 32
    return ctx


def _update(lib: Any, ctx: _Ctx, view: memoryview) -> None:
    if not len(view):
        return
    if view.readonly:
        data: Any = bytes(view)  # rare (small immutable pieces): hashed from a copy
        lib.SHA256_Update(ctypes.byref(ctx), data, len(data))
        return
    buf = (ctypes.c_char * len(view)).from_buffer(view)
    try:
        lib.SHA256_Update(ctypes.byref(ctx), ctypes.addressof(buf), len(view))
    finally:
        del buf


def _state_hex(ctx: _Ctx) -> str:
    return bytes(ctx.h).hex()


class PartHasher:
    """A SHA-256 of bytes fed in order, recording the state at every `part` bytes (`states`: hex, one per
    boundary strictly inside the stream); a plain SHA-256 with `states` None where libcrypto's is not usable."""

    def __init__(self, part: int | None = None) -> None:
        part = PART_BYTES if part is None else part
        if part <= 0 or part % _BLOCK:
            raise ValueError(f"part size {part} is not a positive multiple of {_BLOCK}")
        self.part = part
        self._lib = _load()
        self._n = 0
        self._plain = hashlib.sha256() if self._lib is None else None
        self._ctx = _Ctx()
        self._boundary = (
            False  # the last update ended exactly on a part boundary (its state not recorded yet)
        )
        self.states: list[str] | None = None if self._lib is None else []
        if self._lib is not None:
            self._lib.SHA256_Init(ctypes.byref(self._ctx))

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if self._plain is not None:
            self._plain.update(view)
            self._n += len(view)
            return
        assert self.states is not None
        while len(view):
            if self._boundary:  # more bytes follow a boundary: its state lies inside the stream
                self.states.append(_state_hex(self._ctx))
                self._boundary = False
            take = min(len(view), self.part - self._n % self.part)
            _update(self._lib, self._ctx, view[:take])
            self._n += take
            view = view[take:]
            if self._n % self.part == 0:
                self._boundary = True

    def hexdigest(self) -> str:
        if self._plain is not None:
            return self._plain.hexdigest()
        ctx = _Ctx()
        ctypes.memmove(ctypes.byref(ctx), ctypes.byref(self._ctx), ctypes.sizeof(_Ctx))
        out = ctypes.create_string_buffer(32)
        self._lib.SHA256_Final(out, ctypes.byref(ctx))
        return out.raw.hex()


def part_count(size: int, part: int) -> int:
    """Parts of a `size`-byte file (at least one: an empty file is one empty part)."""
    return max(1, -(-size // part))


def check_part(data: Any, index: int, part: int, states: list[str], digest: str) -> bool:
    """Whether `data` (the bytes of part `index`) leads from the state before it to the one after it (the last
    part: to the file's SHA-256 `digest`). `states` as the inventory lists them (len = parts - 1)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("libcrypto's SHA256 functions are not available in this process")
    if index == 0:
        ctx = _Ctx()
        lib.SHA256_Init(ctypes.byref(ctx))
    else:
        ctx = _resume(lib, bytes.fromhex(states[index - 1]), index * part)
    _update(lib, ctx, memoryview(data).cast("B"))
    if index < len(states):
        return _state_hex(ctx) == states[index].lower()
    out = ctypes.create_string_buffer(32)
    lib.SHA256_Final(out, ctypes.byref(ctx))
    return out.raw.hex() == digest.lower()


def check_files(files: list[tuple[Path, int, int, list[str], str]], jobs: int) -> dict[Path, bool]:
    """Whether each file (path, size, part size, states, SHA-256) matches, its parts checked on `jobs` threads at
    once (a large file's parts in parallel, where its SHA-256 alone is one core's work). Each part is read into a
    buffer of its thread (no mapping: a file truncated meanwhile reads short and fails, it cannot fault)."""
    local = threading.local()

    def one(path: Path, index: int, part: int, states: list[str], digest: str, size: int) -> bool:
        want = min(part, size - index * part)
        buf = getattr(local, "buf", None)
        if buf is None or len(buf) < part:
            buf = local.buf = bytearray(part)
        view = memoryview(buf)[:want]
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:]], index * part + got)
                if not n:
                    return False
                got += n
        finally:
            os.close(fd)
        return check_part(view, index, part, states, digest)

    jobs_of = [
        (path, k, part, states, digest, size)
        for path, size, part, states, digest in files
        for k in range(part_count(size, part))
    ]
    ok = {path: True for path, *_ in files}
    with ThreadPoolExecutor(
        max_workers=max(1, min(jobs, len(jobs_of) or 1)), thread_name_prefix="sha256"
    ) as pool:
        for job, good in zip(jobs_of, pool.map(lambda j: one(*j), jobs_of), strict=True):
            if not good:
                ok[job[0]] = False
    return ok
