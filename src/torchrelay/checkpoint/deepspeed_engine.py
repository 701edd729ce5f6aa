"""A DeepSpeed engine's own checkpoint inside a torchrelay checkpoint.

`run.track(model=engine)` hands the engine's model, its ZeRO-partitioned optimizer, its loss scaler, its step
counters and the LR scheduler it was given to `engine.save_checkpoint`, which writes them into
`checkpoint-N/deepspeed/` of the temporary directory the commit protocol made: the files are inventoried with
everything else, `COMPLETE.json` is still written last, and a crash before the rename leaves no checkpoint. The
RNG, the loop state and other tracked objects are torchrelay's own, as for any run.

DeepSpeed writes pickles (`torch.save`). They are read back only from a checkpoint the run verified against its
inventory at open, for a run whose contract matched, and with `torch.load(weights_only=True)` admitting the three
DeepSpeed classes its optimizer shards hold (`LOADABLE`): never DeepSpeed's own `weights_only=False`.

A ZeRO-1/2 optimizer is partitioned over the data-parallel ranks that saved it; on another world size (a layout
change, docs/ELASTIC.md) its partitions are resharded for the new ranks and the move proven (zero_reshard.py).
ZeRO-3 continues only on the world size that saved it.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.errors import CheckpointError, ConfigError, UnsafeInput
from torchrelay.util.dotted import flatten
from torchrelay.util.durable import fsync_file
from torchrelay.util.hashing import sha256_many

DS_DIR = "deepspeed"  # checkpoint-N/deepspeed/<DS_TAG>/ holds what engine.save_checkpoint writes
DS_TAG = "zero"
PARAMS_KEY = "deepspeed"  # RelayConfig.params["deepspeed"]: the engine's configuration, part of the contract
TRAINER_ARGS = (
    "training_args"  # a Trainer run records it as params["training_args"]["deepspeed"] (integrations/)
)
# Keys of a DeepSpeed configuration that change what is printed or profiled, never a bit of the state.
RUNTIME_KEYS = (
    "steps_per_print",
    "wall_clock_breakdown",
    "dump_state",
    "memory_breakdown",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "monitor_config",
)
# The only classes besides tensors and containers that DeepSpeed 0.19's ZeRO checkpoints pickle.
LOADABLE = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
)


def engine_class() -> type | None:
    """DeepSpeedEngine when the script imported deepspeed (never imported here: it costs seconds)."""
    module = sys.modules.get("deepspeed")
    cls = getattr(module, "DeepSpeedEngine", None) if module is not None else None
    return cls if isinstance(cls, type) else None


def is_engine(obj: Any) -> bool:
    cls = engine_class()
    return cls is not None and isinstance(obj, cls)


def _flatten(config: Any) -> dict[str, Any]:
    return flatten(config) if isinstance(config, dict) else {}


# The layout's share of a DeepSpeed configuration: a move to another world size derives them (docs/ELASTIC.md),
# and check_engine holds them against the run's own micro_batch and grad_accum instead.
LAYOUT_KEYS = ("gradient_accumulation_steps", "train_batch_size")


def _math(config: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in _flatten(config).items()
        if k.split(".")[0] not in RUNTIME_KEYS and k not in LAYOUT_KEYS
    }


def _recorded(params: Any) -> tuple[Any, str]:
    """The DeepSpeed configuration a run's contract records, and the field it is in."""
    params = params if isinstance(params, dict) else {}
    recorded, field = params.get(PARAMS_KEY), f"params.{PARAMS_KEY}"
    trainer_args = params.get(TRAINER_ARGS)
    if recorded is None and isinstance(trainer_args, dict) and isinstance(trainer_args.get(PARAMS_KEY), dict):
        recorded, field = trainer_args[PARAMS_KEY], f"params.{TRAINER_ARGS}.{PARAMS_KEY}"
    return recorded, field


def declares_engine(params: Any) -> bool:
    """Whether a run's params record a DeepSpeed configuration: the run tracks an engine (check_engine refuses one
    the contract does not record), known at open, before the engine is."""
    return isinstance(_recorded(params)[0], dict)


def check_engine(engine: Any, optimizer: Any, config: Any) -> None:
    """Refuse an engine whose configuration is not the one the run's contract records (a RelayConfig), naming
    the field; and an optimizer tracked beside it (the engine saves its own)."""
    if optimizer is not None:
        raise ConfigError(
            "run.track(model=engine, optimizer=...): a DeepSpeed engine saves and restores its own optimizer",
            hint="track the engine alone: run.track(model=engine) (or with other statefuls by name)",
        )
    params, micro_batch, grad_accum = config.params, config.micro_batch, config.grad_accum
    recorded, field = _recorded(params)
    if not isinstance(recorded, dict):
        raise ConfigError(
            "run.track(model=engine): the DeepSpeed configuration is not part of the run's contract",
            hint="put the dict given to deepspeed.initialize(config=...) in RelayConfig.params['deepspeed'], "
            "and initialize with run.config.params['deepspeed']",
        )
    actual = engine.config if isinstance(engine.config, dict) else {}
    want, have = _math(recorded), _math(actual)
    keys = set(want) | set(have)
    if field != f"params.{PARAMS_KEY}":
        # Trainer fills in the "auto" values from TrainingArguments (in the contract themselves) and adds keys
        # of its own: what the recorded file says must hold, the rest is derived.
        keys = {k for k in want if want[k] != "auto"}
    differ = [
        f"{field}.{k}: {want.get(k, '<absent>')!r} in the contract, {have.get(k, '<absent>')!r} in the engine"
        for k in sorted(keys)
        if want.get(k, "<absent>") != have.get(k, "<absent>")
    ]
    if differ:
        raise ConfigError(
            "run.track(model=engine): the engine was initialized with another DeepSpeed configuration than "
            f"the run's: {'; '.join(differ[:6])}",
            hint="initialize with deepspeed.initialize(config=run.config.params['deepspeed']); only "
            f"{', '.join(RUNTIME_KEYS[:3])}, ... may be added",
        )
    for what, engine_value, relay_field, relay_value in (
        (
            "train_micro_batch_size_per_gpu",
            engine.train_micro_batch_size_per_gpu(),
            "micro_batch",
            micro_batch,
        ),
        ("gradient_accumulation_steps", engine.gradient_accumulation_steps(), "grad_accum", grad_accum),
    ):
        if engine_value != relay_value:
            raise ConfigError(
                f"run.track(model=engine): DeepSpeed's {what} is {engine_value}, the run's {relay_field} is "
                f"{relay_value}",
                hint=f"set {what} to the run's {relay_field}: torchrelay's loader and DeepSpeed's "
                "accumulation must cut the same updates",
            )
    offload = _flatten(actual).get("zero_optimization.offload_optimizer.device")
    if offload == "nvme" or _flatten(actual).get("zero_optimization.offload_param.device") == "nvme":
        raise ConfigError(
            "run.track(model=engine): ZeRO-Infinity's NVMe offload keeps state in a swap folder outside the "
            "checkpoint directory; torchrelay cannot commit it",
            hint="offload to 'cpu' or 'none'",
        )
    if _flatten(actual).get("checkpoint.use_node_local_storage"):
        raise ConfigError(
            "run.track(model=engine): checkpoint.use_node_local_storage writes a checkpoint per node; "
            "torchrelay commits one checkpoint directory that every rank sees",
            hint="leave checkpoint.use_node_local_storage off",
        )


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def save_engine(engine: Any, directory: Path) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    """engine.save_checkpoint into `directory/deepspeed` (every rank, on the training thread: DeepSpeed's own
    collectives), each file fsynced; returns the record the state file keeps of it, and {relative path: (SHA-256,
    size)} of this rank's share of the files, hashed for the inventory."""
    rank, world_size = _world()
    root = directory / DS_DIR
    engine.save_checkpoint(
        str(root), tag=DS_TAG, save_latest=False
    )  # ends with a barrier: all files are there
    # DeepSpeed neither fsyncs nor says who wrote what: each rank fsyncs and hashes a share of the files.
    files = sorted(p for p in root.rglob("*") if p.is_file())
    mine = [path for i, path in enumerate(files) if i % world_size == rank]
    for path in mine:
        fsync_file(path)
    digests = sha256_many(mine)
    written = {str(path.relative_to(directory)): digests[path] for path in mine}
    record = {
        "dir": DS_DIR,
        "tag": DS_TAG,
        "zero_stage": int(engine.zero_optimization_stage()),
        "world_size": world_size,
        "global_steps": int(engine.global_steps),
        "version": _version(),
    }
    return record, written


def _version() -> str:
    module = sys.modules.get("deepspeed")
    return str(getattr(module, "__version__", "?"))


def load_engine(engine: Any, ckpt_dir: Path, record: dict[str, Any] | None) -> None:
    """Restore the engine from what save_engine wrote (every rank), refusing another world size or stage."""
    rank, world_size = _world()
    if not isinstance(record, dict):
        raise CheckpointError(
            f"{ckpt_dir}: holds no DeepSpeed engine state, but a DeepSpeed engine is tracked",
            hint="continue the run with the model and optimizer it was saved with",
        )
    saved_world = record.get("world_size")
    if saved_world != world_size and record.get("zero_stage") not in (1, 2):
        raise ConfigError(
            f"{ckpt_dir.name}: its ZeRO stage {record.get('zero_stage')} state is partitioned over {saved_world} "
            f"ranks, this launch has {world_size}: only ZeRO-1/2 optimizer partitions are resharded",
            hint=f"launch {saved_world} ranks",
        )
    stage = int(engine.zero_optimization_stage())
    if record.get("zero_stage") != stage:
        raise ConfigError(
            f"{ckpt_dir.name}: saved by a ZeRO stage {record.get('zero_stage')} engine, this engine runs stage "
            f"{stage} (params.{PARAMS_KEY}.zero_optimization.stage)",
            hint="continue with the DeepSpeed configuration the run was made with",
        )
    tag = str(record.get("tag", DS_TAG))
    if saved_world != world_size:
        path = _load_resharded(engine, ckpt_dir, tag, rank, world_size)
    else:
        path = _load(engine, ckpt_dir / DS_DIR, tag)
    if path is None:
        raise CheckpointError(f"{ckpt_dir / DS_DIR}: DeepSpeed found no checkpoint to load (rank {rank})")
    replay_cpu_adam(getattr(engine.optimizer, "optimizer", None))
    if int(engine.global_steps) != record.get("global_steps"):
        raise CheckpointError(
            f"{ckpt_dir}: the engine resumed at global step {engine.global_steps}, the record says "
            f"{record.get('global_steps')}"
        )


def _load(engine: Any, root: Path, tag: str) -> Any:
    """engine.load_checkpoint of `root`, every read a weights_only load of a file inside it."""
    previous = engine.checkpoint_engine
    engine.checkpoint_engine = _VerifiedLoads(previous, root)
    try:
        path, _ = engine.load_checkpoint(
            str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    finally:
        engine.checkpoint_engine = previous
    return path


def _load_resharded(engine: Any, ckpt_dir: Path, tag: str, rank: int, world_size: int) -> Any:
    """A ZeRO-1/2 checkpoint of another world size: its partitions cut for this one into a folder beside the
    checkpoint (rank r writes its own), loaded, proven equal to the old ones gathered, and the folder removed."""
    from torchrelay.checkpoint import zero_reshard

    optimizer = engine.optimizer
    if not hasattr(optimizer, "single_partition_of_fp32_groups"):
        raise ConfigError(
            f"{ckpt_dir.name}: this engine's optimizer ({type(optimizer).__name__}) keeps no ZeRO-1/2 flat "
            "partitions torchrelay reshards",
            hint="keep the world size the checkpoint was saved with",
        )
    folder = ckpt_dir.parent / f".zero-reshard-{ckpt_dir.name}"
    if rank == 0:
        zero_reshard.remove(folder)
    _barrier()
    sizes = [int(t.numel()) for t in optimizer.single_partition_of_fp32_groups]
    verified = _VerifiedLoads(engine.checkpoint_engine, ckpt_dir / DS_DIR)
    whole = zero_reshard.reshard_folder(
        ckpt_dir / DS_DIR / tag, folder / tag, rank, world_size, sizes, verified.load
    )
    _barrier()
    try:
        path = _load(engine, folder, tag)
        parts: list[Any] = [None] * world_size
        if world_size > 1:
            dist.all_gather_object(parts, zero_reshard.live_state(optimizer))
        else:
            parts = [zero_reshard.live_state(optimizer)]
        differ = whole.equal(zero_reshard.assemble(parts))
        if differ:
            raise CheckpointError(
                f"{ckpt_dir.name}: the ZeRO partitions moved to {world_size} ranks differ from the saved ones "
                f"({', '.join(differ[:4])})",
                hint="keep the world size the checkpoint was saved with, and report this",
            )
    finally:
        _barrier()
        if rank == 0:
            zero_reshard.remove(folder)
    return path


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def replay_cpu_adam(optimizer: Any) -> None:
    """After its state is loaded, make a DeepSpeedCPUAdam (a plain loop's, or the one inside a ZeRO engine) step on
    exactly as the optimizer that saved it would; any other optimizer is left alone.

    DeepSpeedCPUAdam keeps beta1^t and beta2^t in its C++ object as running products (one multiplication per
    step) that no state_dict holds; a fresh object would compute them with pow at its first step, which differs in
    the last bits. The same calls its step() made, on empty tensors, rebuild the products exactly."""
    inner: Any = optimizer
    op = getattr(inner, "ds_opt_adam", None)
    if inner is None or op is None or not hasattr(inner, "opt_id"):
        return
    steps = [int(st["step"]) for st in inner.state.values() if "step" in st]
    for step in range(1, max(steps, default=0) + 1):
        for group in inner.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                state = inner.state.get(param, {})
                if "step" not in state or int(state["step"]) < step:
                    continue
                none = param.new_empty(0)
                moment = state["exp_avg"].new_empty(0)
                op.adam_update(
                    inner.opt_id,
                    step,
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["weight_decay"],
                    group["bias_correction"],
                    none,
                    none.clone(),
                    moment,
                    moment.clone(),
                )


def safe_load(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """torch.load(weights_only=True) of a DeepSpeed checkpoint file, admitting only the classes in LOADABLE."""
    allowed = []
    for module_name, name in LOADABLE:
        module = sys.modules.get(module_name)
        if module is None:
            import importlib

            module = importlib.import_module(module_name)
        allowed.append(getattr(module, name))
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
        # What weights_only refuses (a global outside LOADABLE, a forged opcode) and what a damaged file raises:
        # one line naming the file, exit 2, never the unpickler's traceback.
        raise UnsafeInput(
            f"{path}: not a DeepSpeed checkpoint file torchrelay loads ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})",
            hint="the checkpoint is damaged or forged; restore it, or resume from an older checkpoint",
        ) from None


class _VerifiedLoads:
    """The engine's checkpoint engine while it loads: DeepSpeed's own, except that every read is a
    weights_only load of a file inside the verified checkpoint."""

    def __init__(self, inner: Any, root: Path) -> None:
        self._inner = inner
        self._root = root.resolve()

    def load(self, path: str, map_location: Any = None) -> Any:
        resolved = Path(path).resolve()
        if self._root not in resolved.parents:
            raise CheckpointError(f"DeepSpeed asked to load {path}, outside the verified {self._root}")
        return safe_load(resolved, map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
