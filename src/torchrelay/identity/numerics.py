"""The numerics identity of a segment: what decides the bits a floating-point kernel computes.

Bit-for-bit equality (a resumed run ends where the uninterrupted one ends; the audit's EQUAL) holds within one
identity: the same processor and the capability torch dispatches (AVX2, AVX-512, ...), the same math libraries,
the same GPU model and CUDA libraries, the same TF32, precision and deterministic-algorithm settings, the same
number of threads. Across identities the ledger and the contract still hold; the parameters differ by kernel
rounding. Each segment records its identity in history.jsonl; a resume compares it with the earlier segments'
and says so when it changed (docs/NUMERICS.md).

The identity is gathered on rank 0, when the segment opens: set TF32, precision and determinism before
`Run.open`. Every rank runs the same versions (the node fingerprint refuses a difference); a GPU model that differs
between nodes is not compared here.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torchrelay.util.records import clip

FORMAT = 1

# The fields compared, in the order a difference is told, with the name it is told by.
LABELS: dict[str, str] = {
    "cpu.capability": "CPU capability",
    "cpu.vendor": "CPU vendor",
    "cpu.model": "CPU model",
    "cpu.threads": "number of CPU threads",
    "torch": "torch",
    "blas": "BLAS library",
    "mkl": "MKL",
    "onednn": "oneDNN",
    "onednn.enabled": "oneDNN use",
    "openmp": "OpenMP",
    "float32_matmul_precision": "float32 matmul precision",
    "deterministic": "deterministic algorithms",
    "cuda": "CUDA",
    "gpu.model": "GPU model",
    "gpu.capability": "GPU compute capability",
    "cublas": "cuBLAS",
    "cudnn": "cuDNN",
    "nccl": "NCCL",
    "tf32.matmul": "TF32 matmul",
    "tf32.cudnn": "TF32 in cuDNN",
    "cudnn.deterministic": "cuDNN deterministic",
    "cudnn.benchmark": "cuDNN benchmark",
}
GPU_FIELDS = frozenset(k for k in LABELS if k.startswith(("gpu.", "cublas", "cudnn", "nccl", "tf32.")))


def gather(device: int | None = None) -> dict[str, Any]:
    """This process's numerics identity (format 1; see LABELS), JSON-ready; `device`: the CUDA device to name
    (None: the current one)."""
    import torch

    config = torch.__config__.show()
    mkldnn = torch.backends.mkldnn
    out: dict[str, Any] = {
        "format": FORMAT,
        "cpu.vendor": _cpuinfo("vendor_id") or platform.machine() or None,
        "cpu.model": _cpuinfo("model name") or platform.processor() or None,
        "cpu.capability": torch.backends.cpu.get_cpu_capability(),
        "cpu.threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "blas": _match(r"BLAS_INFO=(\w+)", config),
        "mkl": _match(r"Math Kernel Library Version (\S+?)(?:-Product)? Build", config),
        "onednn": _match(r"(?:MKL-DNN|oneDNN) v(\S+)", config),
        "onednn.enabled": bool(mkldnn.is_available() and mkldnn.enabled),
        "openmp": _match(r"OpenMP (\d+)", config),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": _deterministic(torch),
        "cuda": None,
    }
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else device
        major, minor = torch.cuda.get_device_capability(index)
        cudnn = torch.backends.cudnn
        out |= {
            "cuda": torch.version.cuda,
            "gpu.model": torch.cuda.get_device_name(index),
            "gpu.capability": f"{major}.{minor}",
            "cublas": _package_version("nvidia-cublas", "nvidia-cublas-cu12", "nvidia-cublas-cu11"),
            "cudnn": cudnn.version() if cudnn.is_available() else None,
            "nccl": _nccl(torch),
            "tf32.matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32.cudnn": bool(cudnn.allow_tf32),
            "cudnn.deterministic": bool(cudnn.deterministic),
            "cudnn.benchmark": bool(cudnn.benchmark),
        }
    return out


def fingerprint(identity: Mapping[str, Any]) -> str:
    """A short digest of the compared fields: two segments with the same one compute the same bits."""
    doc = {k: identity.get(k) for k in LABELS}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def describe(identity: Mapping[str, Any]) -> str:
    """One line for people: processor and capability, libraries, GPU, the settings that change the bits."""
    i = identity
    cpu = f"{i.get('cpu.model') or '?'} ({i.get('cpu.vendor') or '?'}), {i.get('cpu.capability') or '?'}"
    cpu += f", {i.get('cpu.threads')} thread{'s' if i.get('cpu.threads') != 1 else ''}"
    libs = ", ".join(
        f"{name} {i[k]}"
        for k, name in (("mkl", "MKL"), ("onednn", "oneDNN"), ("openmp", "OpenMP"))
        if i.get(k)
    )
    text = f"{cpu}; torch {i.get('torch')}" + (f", {libs}" if libs else "")
    if i.get("cuda"):
        text += (
            f"; {i.get('gpu.model')} (sm {i.get('gpu.capability')}), CUDA {i['cuda']}, cuBLAS {i.get('cublas')}, "
            f"cuDNN {i.get('cudnn')}, NCCL {i.get('nccl')}, TF32 matmul {_on(i.get('tf32.matmul'))}, "
            f"TF32 cuDNN {_on(i.get('tf32.cudnn'))}, cuDNN deterministic {_on(i.get('cudnn.deterministic'))}"
        )
    else:
        text += "; no GPU"
    text += (
        f"; float32 matmul {i.get('float32_matmul_precision')}, deterministic {_on(i.get('deterministic'))}"
    )
    return f"{text} [{fingerprint(i)}]"


def differences(
    before: Mapping[str, Any], now: Mapping[str, Any], *, skip: Iterable[str] = ()
) -> dict[str, list[Any]]:
    """{field: [before, now]} for each compared field that differs, in LABELS order; a value is echoed at most
    SHOWN characters long (a segment's numerics come from its file: a 25 MB string echoed three times into the
    next segment's `numerics_change` made a line history.jsonl's reader refuses)."""
    left_out = set(skip)
    return {
        k: [_echo(before.get(k)), _echo(now.get(k))]
        for k in LABELS
        if k not in left_out and before.get(k) != now.get(k)
    }


SHOWN = 200  # characters of a value that a comparison repeats


def _echo(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return clip(value, SHOWN) if isinstance(value, str) else value
    return clip(json.dumps(value), SHOWN)  # a record of another shape: its text, cut


def tell(differ: Mapping[str, list[Any]]) -> str:
    """'another CPU capability, AVX512 instead of AVX2; another torch, ...' for a differences() result."""
    return "; ".join(
        f"another {LABELS.get(k, k)}, {_show(new)} instead of {_show(old)}"
        for k, (old, new) in differ.items()
    )


def compare_with_history(
    history: list[dict[str, Any]], now: Mapping[str, Any], *, upto: int, skip: Iterable[str] = ()
) -> dict[str, Any] | None:
    """How `now` compares with the segments whose updates a resume from update `upto` keeps.

    None when no earlier segment ran an update that is kept. Else a record: `segments` (1-based positions in
    history.jsonl) whose identity differs, `unknown` (those that recorded none), `fields` ({field: [before, now]}
    against the latest differing segment), `line` (what to say: empty when nothing differs and nothing is
    unknown).
    """
    kept = [
        (n, seg)
        for n, seg in enumerate(history, 1)
        if isinstance(seg.get("first_update"), int)
        and seg["first_update"] <= upto
        and seg.get("ended") != "refused"
    ]
    if not kept:
        return None
    recorded = [(n, seg["numerics"]) for n, seg in kept if isinstance(seg.get("numerics"), dict)]
    unknown = [n for n, seg in kept if not isinstance(seg.get("numerics"), dict)]
    differ_by = {n: differences(ident, now, skip=skip) for n, ident in recorded}
    differing = [n for n, d in differ_by.items() if d]
    fields = differ_by[differing[-1]] if differing else {}
    parts = []
    if differing:
        parts.append(f"bit-for-bit comparison with {segment_list(differing)} is not expected: {tell(fields)}")
    if unknown:
        parts.append(f"{segment_list(unknown)} recorded no numerics identity (written before torchrelay did)")
    return {"segments": differing, "unknown": unknown, "fields": fields, "line": "; ".join(parts)}


def segment_list(numbers: list[int]) -> str:
    """'segment 3' or 'segments 1-3, 5'."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"segment{'s' if len(numbers) > 1 else ''} {text}"


def _deterministic(torch: Any) -> str | bool:
    if not torch.are_deterministic_algorithms_enabled():
        return False
    return "warn_only" if torch.is_deterministic_algorithms_warn_only_enabled() else True


def _nccl(torch: Any) -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a build without NCCL
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _package_version(*names: str) -> str | None:
    """The installed version of the first of `names`: torch names no cuBLAS version, but its CUDA builds install
    cuBLAS as a wheel (nvidia-cublas for CUDA 13, nvidia-cublas-cu12 before; seen with torch 2.11 on an H200)."""
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _cpuinfo(key: str) -> str | None:
    """The first `key` line of /proc/cpuinfo (Linux); None elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    return _match(rf"(?m)^{re.escape(key)}\s*:\s*(.+?)\s*$", text)


def _match(pattern: str, text: str) -> str | None:
    found = re.search(pattern, text)
    return found.group(1) if found else None


def _on(value: Any) -> str:
    return (
        {True: "on", False: "off", None: "?"}.get(value, str(value)) if not isinstance(value, str) else value
    )


def _show(value: Any) -> str:
    return "none" if value is None else clip(str(value), SHOWN)


# Set by the training program, not by the machine: `prepare` (which runs outside it) does not compare them.
SETTINGS = frozenset(
    {
        "cpu.threads",
        "onednn.enabled",
        "float32_matmul_precision",
        "deterministic",
        "tf32.matmul",
        "tf32.cudnn",
        "cudnn.deterministic",
        "cudnn.benchmark",
    }
)


def check_resume(
    history: list[dict[str, Any]], now: Mapping[str, Any], *, upto: int, strict: bool
) -> dict[str, Any] | None:
    """A resume from update `upto` with identity `now`: the segment's `numerics_change` record when an earlier
    segment's identity differs (warned), else None (a segment that recorded none is told, not warned);
    strict: a difference is refused with NumericsChanged (exit 2) naming the fields, before anything is written."""
    from torchrelay.errors import NumericsChanged
    from torchrelay.log import logger

    found = compare_with_history(history, now, upto=upto)
    if found is None or not found["line"]:
        return None
    if not found["segments"]:
        logger.info(f"[torchrelay] {found['line']}")
        return None
    if strict:
        fields = found["fields"]
        raise NumericsChanged(
            f"resume refused (strict_numerics): the numerics differ from {segment_list(found['segments'])} in "
            f"{', '.join(fields)}: {tell(fields)}",
            hint="continue on a machine with the recorded numerics (torchrelay status shows them), or launch with "
            "--set strict_numerics=false to continue with a warning",
        )
    logger.warning(f"[torchrelay] warning: {found['line']}")
    return {"segments": found["segments"], "fields": found["fields"], "line": found["line"]}


def compare_here(
    history: list[dict[str, Any]], now: Mapping[str, Any], *, upto: int
) -> dict[str, Any] | None:
    """`prepare`'s comparison, outside the training program: the machine and its libraries only (SETTINGS are
    the program's), and no GPU field where this process sees no GPU (a login node): the launch compares those."""
    skip = SETTINGS | (GPU_FIELDS | {"cuda"} if not now.get("cuda") else frozenset())
    return compare_with_history(history, now, upto=upto, skip=skip)
