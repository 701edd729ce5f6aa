"""`export`: a checkpoint's model weights as safetensors files a serving stack loads (Hugging Face's layout).

Offline, on the CPU, without a process group, in bounded memory: the checkpoint's inventory is verified first,
then each model tensor is read alone from its DCP chunks, renamed, cast and appended to a shard file whose header
was written from the metadata. The optimizer is never read. The folder gets `model.safetensors` (or numbered shards
and `model.safetensors.index.json`), `torchrelay_export.json` (where the weights come from) and `SHA256SUMS`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrelay import __version__
from torchrelay.checkpoint.dcp_io import own_empty
from torchrelay.checkpoint.deepspeed_engine import DS_DIR
from torchrelay.checkpoint.inventory import INVENTORY, validate_complete
from torchrelay.checkpoint.reader import iter_model_tensors, model_tensor_specs
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.errors import CheckpointError, ConfigError
from torchrelay.export.parity import ParityOptions, check_parity
from torchrelay.export.safetensors_stream import SafetensorsWriter, TensorSlot
from torchrelay.paths.destinations import refuse_inside_runs, refuse_nested
from torchrelay.paths.layout import checkpoint_label, parse_checkpoint_name
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import load_contract
from torchrelay.util.durable import fsync_dir
from torchrelay.util.hashing import sha256_hex
from torchrelay.util.records import read_json_or_none
from torchrelay.util.sums import SUMS_NAME, SumEntry, write_sums

EXPORT_FORMAT = 1
PROVENANCE = "torchrelay_export.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '512MiB' -> 512 * 2**20, '1000' -> 1000."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"size {text!r} is not a number of bytes like 5GB, 512MiB or 1000000")
    unit = m.group(2).upper().rstrip("B")
    power = "KMGT".find(unit[:1]) + 1 if unit else 0
    base = 1024 if unit.endswith("I") else 1000
    value = int(float(m.group(1)) * base**power)
    if value < 1:
        raise ConfigError(f"size {text!r} must be at least one byte")
    return value


@dataclass(kw_only=True, slots=True)
class ExportOptions:
    """What to write: the format, a dtype to cast floating tensors to, prefixes to drop, prefixes to rename."""

    format: str = "safetensors"
    dtype: str | None = None  # bf16 | fp16 | fp32; None keeps each tensor's stored dtype
    drop: list[str] = field(default_factory=list)  # module paths: "head" drops head and head.*
    rename: list[tuple[str, str]] = field(default_factory=list)  # (old, new) module paths, applied in order
    max_shard_bytes: int = 5 * 10**9  # as Hugging Face's save_pretrained shards by default
    include: list[Path] = field(
        default_factory=list
    )  # files copied beside the weights (config.json, tokenizer)
    checkpoint: int | None = None  # of a run directory; None: its newest complete one
    # compare the export, loaded with from_pretrained, with the training model on the run's samples (parity.py)
    parity: ParityOptions | None = None

    def __post_init__(self) -> None:
        if self.format != "safetensors":
            raise ConfigError(f"export --format {self.format!r}: only 'safetensors' is supported")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"export --dtype {self.dtype!r} must be one of {sorted(DTYPES)}")
        if self.max_shard_bytes < 1:
            raise ConfigError(f"export --max-shard-size must be positive, got {self.max_shard_bytes}")
        for prefix in self.drop:
            if not prefix.strip("."):
                raise ConfigError(f"export --drop {prefix!r}: name a module path such as 'head'")
        for old, _new in self.rename:
            if not old.strip("."):
                raise ConfigError(f"export --rename {old!r}=...: name the module path to rename")
        names = [p.name for p in self.include]
        if len(set(names)) != len(names) or {SINGLE_FILE, INDEX_FILE, PROVENANCE, SUMS_NAME} & set(names):
            raise ConfigError(
                f"export --include: names must be unique and not the export's own files: {names}"
            )


@dataclass(slots=True)
class ExportResult:
    out: Path
    checkpoint: Path
    update: int
    files: list[str]
    tensors: int
    bytes: int
    dropped: list[str]
    renamed: dict[str, str]
    seconds: float
    parity: dict[str, Any] | None = None


def parse_rename(text: str) -> tuple[str, str]:
    """'OLD=NEW' (NEW may be empty: the prefix is removed)."""
    if "=" not in text:
        raise ConfigError(f"export --rename expects OLD=NEW, got {text!r}")
    old, new = text.split("=", 1)
    return old.strip(), new.strip()


def _matches(name: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


def _renamed(name: str, old: str, new: str) -> str:
    old, new = old.rstrip("."), new.rstrip(".")
    rest = name[len(old) :].lstrip(".")
    return ".".join(part for part in (new, rest) if part)


def name_map(
    names: list[str], drop: list[str], rename: list[tuple[str, str]]
) -> tuple[dict[str, str], list[str]]:
    """({checkpoint name: exported name}, dropped names); a --drop or --rename that matches nothing, or two
    tensors renamed to one name, is refused (a typo would otherwise export the wrong model silently)."""
    kept: list[str] = []
    dropped: list[str] = []
    for name in names:
        (dropped if any(_matches(name, p) for p in drop) else kept).append(name)
    unused = [p for p in drop if not any(_matches(n, p) for n in names)]
    if unused:
        raise ConfigError(f"export --drop {unused[0]!r} matches no model tensor", hint=_some(names))
    mapping = {name: name for name in kept}
    for old, new in rename:
        hits = [k for k, v in mapping.items() if _matches(v, old)]
        if not hits:
            raise ConfigError(
                f"export --rename {old}={new} matches no (kept) model tensor", hint=_some(names)
            )
        for k in hits:
            mapping[k] = _renamed(mapping[k], old, new)
    seen: dict[str, str] = {}
    for k, v in mapping.items():
        if not v:
            raise ConfigError(f"export --rename turns {k!r} into an empty name")
        if v in seen:
            raise ConfigError(f"export --rename gives {seen[v]!r} and {k!r} the same name {v!r}")
        seen[v] = k
    return mapping, dropped


def _some(names: list[str]) -> str:
    roots = sorted({n.split(".")[0] for n in names})
    return f"the checkpoint's top-level modules are {roots[:12]}"


def resolve_checkpoint(source: Path, which: int | None) -> tuple[Path, RunDir | None]:
    """(checkpoint directory, the run or bundle directory holding it, if any) for a run, bundle or checkpoint."""
    source = Path(source)
    alone = (source / INVENTORY).exists() or parse_checkpoint_name(source.name) is not None
    run = RunDir(source.parent if alone else source)  # a bundle's top holds a run directory's files too
    if alone:
        if which is not None:
            raise ConfigError("export --checkpoint N applies to a run directory, not to a checkpoint")
        return source, run if run.exists() else None
    if not run.exists():
        raise ConfigError(
            f"{source} is neither a run directory, a bundle nor a checkpoint-<N> directory",
            hint="pass RUN_DIR (its newest complete checkpoint) or RUN_DIR/checkpoint-N",
        )
    load_contract(run)  # a damaged contract holds no run to export from: refused, naming the file
    complete = [c for c in list_checkpoints(run) if c.complete]
    if which is None:
        if not complete:
            raise CheckpointError(f"{source} has no complete checkpoint to export")
        return complete[-1].path, run
    match = [c for c in complete if c.update == which]
    if not match:
        have = ", ".join(str(c.update) for c in complete) or "none"
        raise CheckpointError(
            f"{source / checkpoint_label(which)} is not a complete checkpoint (complete: {have})"
        )
    return match[0].path, run


def _shards(slots: list[TensorSlot], limit: int) -> list[list[TensorSlot]]:
    """Consecutive groups of at most `limit` bytes; a tensor larger than the limit gets a file of its own."""
    out: list[list[TensorSlot]] = []
    size = 0
    for slot in slots:
        if not out or (size + slot.nbytes > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(slot)
        size += slot.nbytes
    return out or [[]]


def export_code(code: dict[str, Any]) -> dict[str, Any] | None:
    """The contract's code identity in the export's documented fields {commit, tree, dirty, dirty_sha256}, plus
    `files` ({path: sha256} of the program files no commit holds). Outside git (or with files git does not track)
    `dirty_sha256` is the SHA-256 of those files' canonical listing, so the four fields name the code alone; an
    empty tree (a plain directory holding only the program) is null."""
    if not code:
        return None
    files: dict[str, Any] = {}
    for key in ("untracked", "modified"):
        part = code.get(key)
        if isinstance(part, dict):
            files.update({str(k): v for k, v in part.items()})
    digest = code.get("dirty_sha256")
    if digest is None and files:
        digest = hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {
        "commit": code.get("commit"),
        "tree": code.get("tree") or None,
        "dirty": bool(code.get("dirty")),
        "dirty_sha256": digest,
        "files": dict(sorted(files.items())),
    }


def _provenance(ckpt: Path, run: RunDir | None, inventory: dict[str, Any]) -> dict[str, Any]:
    contract: dict[str, Any] = {}
    lineage: dict[str, Any] = {}
    if run is not None:
        contract = read_json_or_none(run.contract_path, what="the training contract", root=run.path) or {}
        lineage = read_json_or_none(run.lineage_path, what="the run's lineage", root=run.path) or {}
    fields = contract.get("fields", {}) if isinstance(contract, dict) else {}
    return {
        "run_dir": str(run.path.resolve()) if run is not None else None,
        "checkpoint": ckpt.name,
        "update": inventory.get("update"),
        "inventory_sha256": sha256_hex(ckpt / INVENTORY),
        "contract_sha256": contract.get("sha256") or inventory.get("contract_sha256"),
        "segment": inventory.get("segment"),
        "lineage": lineage.get("lineage") if isinstance(lineage, dict) else None,
        "code": export_code({k.removeprefix("code."): v for k, v in fields.items() if k.startswith("code.")}),
        "versions": {k.removeprefix("versions."): v for k, v in fields.items() if k.startswith("versions.")},
    }


def export_weights(
    source: Path, out: Path, options: ExportOptions, owned: Path | None = None
) -> ExportResult:
    """Write the model weights of `source` (run directory, bundle or checkpoint) into the new folder `out`;
    `owned`: a run's folder torchrelay writes itself (validation's), in which `out` may lie."""
    started = time.perf_counter()
    ckpt, holder = resolve_checkpoint(Path(source), options.checkpoint)
    inventory = validate_complete(ckpt)  # a damaged checkpoint is refused, naming the file
    if (ckpt / DS_DIR).is_dir() and not (ckpt / "model").is_dir():
        raise ConfigError(
            f"{ckpt} holds a DeepSpeed engine's own checkpoint ({DS_DIR}/), which export does not read",
            hint=f"DeepSpeed consolidates its weights: python {ckpt / DS_DIR / 'zero_to_fp32.py'} "
            f"{ckpt / DS_DIR} OUT --tag zero (on a copy; it runs DeepSpeed's code)",
        )
    out = Path(out)
    # as pack and prepare refuse their destination: an export inside a checkpoint made every resume refuse it
    refuse_nested(ckpt, "checkpoint", out, "export folder")
    refuse_inside_runs(out, "export folder", owned)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} already exists and is not empty", hint="choose a new export folder")
    for path in options.include:
        if not path.is_file():
            raise ConfigError(f"export --include {path}: no such file")
    specs = model_tensor_specs(ckpt)
    if not specs:
        raise CheckpointError(
            f"{ckpt} holds no model tensors (was a model tracked with run.track(model=...)?)"
        )
    mapping, dropped = name_map(list(specs), options.drop, options.rename)
    cast = DTYPES.get(options.dtype or "")

    def out_dtype(dtype: torch.dtype) -> torch.dtype:
        return cast if cast is not None and dtype.is_floating_point else dtype

    by_new = {new: old for old, new in mapping.items()}
    slots = [
        TensorSlot(new, specs[by_new[new]][0], out_dtype(specs[by_new[new]][1])) for new in sorted(by_new)
    ]
    groups = _shards(slots, options.max_shard_bytes)
    files = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out.name}.export-tmp-"
    _remove_stale_temporaries(out.parent, prefix)
    tmp = out.parent / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        sums: list[SumEntry] = []
        total = 0
        for name, group in zip(files, groups):
            with SafetensorsWriter(tmp / name, group, {"format": "pt"}) as writer:
                tensors = iter_model_tensors(ckpt, [by_new[s.name] for s in group])
                for slot in group:
                    # next() and unpacking, not zip/enumerate: those keep their last tuple (and so the previous
                    # tensor) alive while the next one is read, doubling the peak
                    _old, tensor = next(tensors)
                    writer.write(slot.name, _cast(tensor, slot.dtype))
                    total += slot.nbytes
                    del tensor
            sums.append(SumEntry(name, writer.sha256.hexdigest()))
        if len(files) > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {s.name: f for f, g in zip(files, groups) for s in g},
            }
            _write(tmp / INDEX_FILE, index)
            sums.append(SumEntry(INDEX_FILE, sha256_hex(tmp / INDEX_FILE)))
        for path in options.include:
            shutil.copyfile(path, tmp / path.name)
            sums.append(SumEntry(path.name, sha256_hex(tmp / path.name)))
        # before the provenance and the rename: an export that fails its parity is not written
        parity = check_parity(tmp, ckpt, holder, options.parity) if options.parity is not None else None
        renamed = {k: v for k, v in mapping.items() if k != v}
        provenance = {
            "format": EXPORT_FORMAT,
            "tool": f"torchrelay {__version__}",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": _provenance(ckpt, holder, inventory),
            "options": {
                **asdict(options),
                "include": [p.name for p in options.include],
                "parity": None
                if options.parity is None
                else {**asdict(options.parity), "hooks": options.parity.hooks.name},
            },
            "tensors": len(slots),
            "total_bytes": total,
            "files": [s.path for s in sums],
            "dropped": dropped,
            "renamed": renamed,
            **({"parity": parity} if parity is not None else {}),
        }
        _write(tmp / PROVENANCE, provenance)
        sums.append(SumEntry(PROVENANCE, sha256_hex(tmp / PROVENANCE)))
        write_sums(tmp / SUMS_NAME, sums)
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        out=out,
        checkpoint=ckpt,
        update=int(inventory["update"]),
        files=[s.path for s in sums] + [SUMS_NAME],
        tensors=len(slots),
        bytes=total,
        dropped=dropped,
        renamed=renamed,
        seconds=time.perf_counter() - started,
        parity=parity,
    )


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as `dtype`; a cast's copy (as tensor.to makes it) in memory that leaves the process when freed:
    one from the C heap may stay, and the next tensor's cast then takes new memory (dcp_io.own_memory)."""
    if tensor.dtype == dtype:
        return tensor
    return own_empty(tensor.shape, dtype).copy_(tensor)


def _remove_stale_temporaries(parent: Path, prefix: str) -> None:
    """An export killed before its rename left `<prefix><pid>-<id>`: removed once that process is gone (another
    export of the same folder may be running)."""
    for child in parent.iterdir():
        pid, _, rest = child.name.removeprefix(prefix).partition("-")
        if not child.name.startswith(prefix) or not pid.isdigit() or not rest or child.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(child, ignore_errors=True)
        except PermissionError:
            continue  # another user's live process


def _write(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
