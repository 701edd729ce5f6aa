"""A Hugging Face Trainer run as a torchrelay run: its RelayConfig and resume contract.

The contract holds every TrainingArguments field that can change the math (learning rate, batch sizes, schedule,
optimizer, precision, seeds, ...), the model's config and the training set's fingerprint. Fields that only say where
things go or how fast they get there (output and logging paths, worker counts, `report_to`, save cadence, hub
settings) are runtime-only: they may differ between segments. A field not listed as runtime is in the contract, so
a TrainingArguments field added by a later transformers release is checked until someone decides otherwise.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrelay.config.relay import SAMPLERS, RelayConfig
from torchrelay.errors import ConfigError

# TrainingArguments fields that never change what is computed: where output and logs go, how often and whereto
# progress is reported, when checkpoints are written and how many are kept (torchrelay's save_every and keep),
# how batches are loaded (torchrelay's order does not depend on it), evaluation's own batching, the hub.
RUNTIME_ARGS = frozenset(
    {
        "output_dir",
        "logging_dir",
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "log_on_each_node",
        "logging_nan_inf_filter",  # changes the logged loss only
        "include_num_input_tokens_seen",
        "log_level",
        "log_level_replica",
        "disable_tqdm",
        "report_to",
        "run_name",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "save_strategy",
        "save_steps",
        "save_on_each_node",
        "save_total_limit",
        "save_only_model",
        "push_to_hub",
        "hub_token",
        "hub_private_repo",
        "hub_model_id",
        "hub_strategy",
        "hub_always_push",
        "hub_revision",
        "ignore_data_skip",
        "resume_from_checkpoint",
        "restore_callback_states_from_checkpoint",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
        "dataloader_drop_last",  # torchrelay's order always uses whole global batches
        "per_device_eval_batch_size",
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "eval_accumulation_steps",
        "include_for_metrics",
        "batch_eval_metrics",
        "metric_for_best_model",
        "greater_is_better",
        "skip_memory_metrics",
        "torch_empty_cache_steps",
        "do_train",
        "do_eval",
        "do_predict",
        "local_rank",
        "ddp_timeout",
        "debug",
    }
)
# FSDP settings (TrainingArguments.fsdp_config keys and accelerate's FullyShardedDataParallelPlugin fields) that
# change no value any rank computes: when parameters are re-gathered or prefetched (the all-gather copies them exactly),
# how Trainer would write its own checkpoints (torchrelay writes them: DCP, sharded), how the model is first loaded.
# Everything else FSDP is set with (version, mixed precision, CPU offload, what is wrapped as one unit, activation
# checkpointing) is in the contract: a reduction over other buckets or an optimizer step on another device may round
# differently.
FSDP_RUNTIME = frozenset(
    {
        "reshard_after_forward",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "state_dict_type",
        "state_dict_config",
        "optim_state_dict_config",
        "cpu_ram_efficient_loading",
        "sync_module_states",
        "param_init_fn",
    }
)
# Keys of a model config that name where it came from, not what it computes.
MODEL_CONFIG_RUNTIME = ("_name_or_path", "transformers_version")
FINGERPRINT_VERSION = "hf_items_v1"


@dataclass(kw_only=True, slots=True)
class RelayOptions:
    """What a Trainer script may add to the run's configuration (all optional)."""

    # default: TrainingArguments.output_dir (TORCHRELAY_RUN_DIR overrides both)
    run_dir: str | None = None
    # default: a datasets.Dataset's own fingerprint, else a digest of every training sample
    dataset_fingerprint: str | None = None
    # more packages whose installed version is enforced (transformers and accelerate always are)
    pins: list[str] = field(default_factory=list)
    # files whose SHA-256 is part of the contract (their paths are not)
    external_files: dict[str, str] = field(default_factory=dict)
    # your own hyper-parameters, part of the contract except the keys in runtime_params
    params: dict[str, Any] = field(default_factory=dict)
    runtime_params: list[str] = field(default_factory=list)
    # more TrainingArguments fields to treat as runtime-only
    runtime_args: list[str] = field(default_factory=list)
    # A torchrelay manifest (JSONL, one sample a line, each with a unique `id`; `path`s under `data_root`): the
    # training set is indexed by its lines, its path-independent fingerprint is the contract, and
    # `torchrelay prepare --set data_root=... --check-files` moves and checks the data. Without it, the
    # train_dataset's own fingerprint is (dataset_fingerprint, or a digest of every sample).
    manifest: str | None = None
    data_root: str = ""
    # builds the training set from the manifest's records (the run's own copy, rebased by prepare):
    # `dataset(records)[i]` is line i. Instead, a train_dataset of as many samples may be given to the Trainer.
    dataset: Callable[[Sequence[dict[str, Any]]], Any] | None = None
    # the run's order: "shuffled", or "length_bucketed" (global batches of similar manifest `length`)
    sampler: str = "shuffled"
    bucket_size: int = 64  # length_bucketed: batches sorted by length within this many global batches
    # The memory tier (docs/CHECKPOINTS.md): also save every `memory_every` updates into node-local memory, keeping
    # `memory_keep` there; 0: off. TrainingArguments has no such field (save_steps is the durable `save_every`).
    # Runtime fields: a launch may change them.
    memory_every: int = 0
    memory_keep: int = 1
    # This launch may continue the run on another number of ranks with the same global batch (docs/ELASTIC.md);
    # None reads TORCHRELAY_RESHARD (`torchrelay launch --reshard` sets it). Not part of the contract.
    reshard: bool | None = None

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"RelayOptions.sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ConfigError(f"RelayOptions.bucket_size must be an integer >= 1, got {self.bucket_size!r}")
        if self.manifest is None:
            needs = [
                name
                for name, given in (
                    ("data_root", bool(self.data_root)),
                    ("dataset", self.dataset is not None),
                    ("sampler='length_bucketed'", self.sampler == "length_bucketed"),
                )
                if given
            ]
            if needs:
                raise ConfigError(
                    f"RelayOptions.{needs[0]} needs RelayOptions.manifest (the JSONL listing the samples)",
                    hint="give manifest=PATH: one JSON object per sample with a unique `id` (and `length` for "
                    "the length_bucketed sampler)",
                )


def _plain(value: Any) -> Any:
    """A JSON value for the contract (enums by value, anything else JSON cannot hold as its text)."""
    return json.loads(json.dumps(value, default=lambda v: v.value if isinstance(v, Enum) else str(v)))


def math_args(args: Any, runtime: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """The TrainingArguments fields of the contract, by name."""
    skip = RUNTIME_ARGS | set(runtime)
    out = {k: v for k, v in args.to_dict().items() if k not in skip}
    if isinstance(out.get("fsdp_config"), dict):
        out["fsdp_config"] = {
            k: v for k, v in out["fsdp_config"].items() if k.removeprefix("fsdp_") not in FSDP_RUNTIME
        }
    ds = out.get("deepspeed")
    if isinstance(ds, str) and ds.endswith(".json") and os.path.isfile(ds):
        # A path is where the file lies; what it says is what trains.
        out["deepspeed"] = json.loads(Path(ds).read_text())
    return dict(_plain(out))


def _setting(value: Any) -> Any:
    """A JSON value naming an FSDP setting, the same in every launch (never an object's repr: it holds an address)."""
    import dataclasses
    import functools

    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Enum):
        return _setting(value.value) if isinstance(value.value, bool | int | float | str) else value.name
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, list | tuple | set | frozenset):
        items = [_setting(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, dict):
        return {str(k): _setting(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, functools.partial):
        return {"function": _setting(value.func), "keywords": _setting(value.keywords)}
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value):
        fields = {f.name: _setting(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"class": type(value).__qualname__, **fields}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return type(value).__qualname__  # a module, an offload policy without fields: what it is, not where


def parallel_identity(accelerator: Any) -> dict[str, Any] | None:
    """The FSDP settings accelerate trains with, from its plugin (TrainingArguments.fsdp/fsdp_config, or
    `accelerate launch --use_fsdp` and its environment, which TrainingArguments does not show); None without FSDP."""
    state = getattr(accelerator, "state", None)
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is None or "FSDP" not in str(getattr(state, "distributed_type", "")):
        return None
    import dataclasses

    settings = {
        f.name: _setting(getattr(plugin, f.name))
        for f in dataclasses.fields(plugin)
        if f.name not in FSDP_RUNTIME
    }
    return {"fsdp": settings, "mixed_precision": str(getattr(accelerator, "mixed_precision", "no"))}


def model_identity(model: Any) -> dict[str, Any]:
    """The model's class and its config without where it was loaded from."""
    ident: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)):
        conf = dict(config.to_dict())
        for key in MODEL_CONFIG_RUNTIME:
            conf.pop(key, None)
        ident["config"] = _plain(conf)
    return ident


def _digest(obj: Any, h: Any, where: str) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        h.update(f"A{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h, where)
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _digest(item, h, where)
        h.update(b"]")
    elif obj is None or isinstance(obj, bool | int | float | str | bytes | np.generic):
        h.update(f"{type(obj).__name__}:{obj!r}".encode())
    else:
        raise ConfigError(
            f"{where} holds a {type(obj).__name__}, which torchrelay cannot fingerprint",
            hint="pass RelayOptions(dataset_fingerprint=...) (e.g. the SHA-256 of the files it reads)",
        )


def dataset_fingerprint(dataset: Any) -> str:
    """The training set's identity: a `datasets` fingerprint, or a digest of every sample in index order."""
    fp = getattr(dataset, "_fingerprint", None)  # datasets.Dataset: a hash of its source and transforms
    if isinstance(fp, str) and fp:
        return f"datasets:{fp}"
    h = hashlib.sha256()
    for i in range(len(dataset)):
        _digest(dataset[i], h, f"training sample {i}")
    return f"{FINGERPRINT_VERSION}:{h.hexdigest()}"


def write_manifest(samples: int, folder: Path) -> Path:
    """The run's manifest for a Trainer dataset: line i is sample i (its identity in the exposure ledger)."""
    path = folder / "manifest.jsonl"
    with path.open("w", encoding="utf-8") as f:
        f.writelines(f'{{"id":"{i}"}}\n' for i in range(samples))
    return path


def check_dataset(dataset: Any, samples: int | None = None) -> None:
    """Refuse a training set torchrelay's order cannot index (`samples`: the manifest's, which it must match)."""
    if dataset is None:
        raise ConfigError(
            "Trainer: torchrelay needs a train_dataset",
            hint="pass train_dataset=..., or RelayOptions(manifest=..., dataset=...) to build it from a manifest",
        )
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ConfigError(
            "Trainer: the train_dataset is iterable; torchrelay's order needs a map-style dataset (dataset[i], len)",
            hint="index your samples (a list of records, a datasets.Dataset)",
        )
    if samples is not None and len(dataset) != samples:
        raise ConfigError(
            f"Trainer: the train_dataset has {len(dataset)} samples, RelayOptions.manifest {samples}",
            hint="sample i must be the manifest's line i: build it with RelayOptions(dataset=...) from the records",
        )


def check_supported(args: Any, dataset: Any, *, manifest: bool = False) -> None:
    """Refuse what an exact resume cannot carry, naming the TrainingArguments field (with a manifest, the
    dataset is checked once it is built: see check_dataset)."""
    if not manifest:
        check_dataset(dataset)
    strategy = _plain(args.train_sampling_strategy)
    if strategy == "group_by_length":
        raise ConfigError(
            "TrainingArguments.train_sampling_strategy='group_by_length' is not supported with torchrelay: its "
            "order is Trainer's own and does not resume exactly",
            hint="leave it at 'random' and pass RelayOptions(manifest=..., sampler='length_bucketed'): the "
            "manifest's `length` groups each global batch, on any worker count (docs/TRAINER.md)",
        )
    refused = {
        "auto_find_batch_size": (
            bool(args.auto_find_batch_size),
            "it changes the batch size after an out-of-memory error, and with it the run",
        ),
        "train_sampling_strategy": (
            _plain(args.train_sampling_strategy) != "random",
            "torchrelay owns the data order (seeded, world-size free)",
        ),
        "load_best_model_at_end": (
            bool(args.load_best_model_at_end),
            "torchrelay writes the checkpoints, Trainer cannot pick among them",
        ),
        "save_strategy": (
            _plain(args.save_strategy) == "best",
            "torchrelay saves every save_steps updates and at every stop",
        ),
        "enable_jit_checkpoint": (
            bool(getattr(args, "enable_jit_checkpoint", False)),
            "torchrelay saves and stops on SIGTERM itself",
        ),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ConfigError(
                f"TrainingArguments.{name}={_plain(getattr(args, name))!r} is not supported with torchrelay: {why}",
                hint=f"leave {name} at its default",
            )


def total_updates(args: Any, samples: int, global_batch: int) -> int:
    """max_steps, or num_train_epochs of whole global batches (the order drops each epoch's tail)."""
    if args.max_steps > 0:
        return int(args.max_steps)
    per_epoch = samples // global_batch
    if per_epoch < 1:
        raise ConfigError(
            f"the global batch ({global_batch}) is larger than the training set ({samples} samples)",
            hint="lower per_device_train_batch_size or gradient_accumulation_steps",
        )
    return max(1, math.ceil(float(args.num_train_epochs) * per_epoch))


def save_every(args: Any, total: int, per_epoch: int) -> int:
    """TrainingArguments' save cadence in updates (torchrelay also saves at every stop and at the end)."""
    strategy = _plain(args.save_strategy)
    if strategy == "steps":
        steps = float(args.save_steps)
        return max(1, math.ceil(steps * total) if steps < 1 else int(steps))
    if strategy == "epoch":
        return max(1, per_epoch)
    return total


def relay_config(
    args: Any,
    model: Any,
    dataset: Any,
    options: RelayOptions,
    world_size: int,
    manifest: Path | str,
    parallel: dict[str, Any] | None = None,
    *,
    samples: int | None = None,
    global_batch: int | None = None,
) -> RelayConfig:
    """The RelayConfig of a Trainer run: the schedule and batch from TrainingArguments, the rest in params
    (`parallel`: the FSDP settings accelerate trains with, see parallel_identity; `samples`: the manifest's, when
    RelayOptions names one: its fingerprint is the contract's data.fingerprint, the dataset may not be built yet;
    `global_batch`: an existing run's, which an epoch schedule is counted in whatever this launch's world size)."""
    import accelerate
    import transformers

    if options.manifest is None:
        samples = len(dataset)
        fingerprint = options.dataset_fingerprint or dataset_fingerprint(dataset)
        data = {"fingerprint": fingerprint, "samples": samples, "class": type(dataset).__qualname__}
    else:
        assert samples is not None, "relay_config: a manifest's sample count is needed"
        maker = options.dataset if options.dataset is not None else type(dataset)
        data = {
            "source": "manifest",  # data.fingerprint of the contract, path-independent
            "samples": samples,
            "class": getattr(maker, "__qualname__", type(maker).__qualname__),
            **({"fingerprint": options.dataset_fingerprint} if options.dataset_fingerprint else {}),
        }
    micro, accum = int(args.per_device_train_batch_size), int(args.gradient_accumulation_steps)
    global_batch = global_batch or micro * accum * world_size
    total = total_updates(args, samples, global_batch)
    per_epoch = max(1, samples // global_batch)
    limit = args.save_total_limit
    params = {
        "training_args": math_args(args, options.runtime_args),
        "model": model_identity(model),
        "dataset": data,
        # only with FSDP: the contracts of runs without it stay as they were
        **({"accelerate": parallel} if parallel is not None else {}),
        **options.params,
    }
    pins = [f"transformers=={transformers.__version__}", f"accelerate=={accelerate.__version__}"]
    return RelayConfig(
        seed=int(args.data_seed if args.data_seed is not None else args.seed),
        micro_batch=micro,
        grad_accum=accum,
        total_updates=total,
        warmup_updates=min(total, int(args.get_warmup_steps(total))),
        manifest=str(manifest),
        data_root=options.data_root,
        sampler=options.sampler,
        bucket_size=options.bucket_size,
        num_workers=int(args.dataloader_num_workers),
        save_every=save_every(args, total, per_epoch),
        memory_every=options.memory_every,
        memory_keep=options.memory_keep,
        keep=max(2, int(limit)) if limit else max(2, total),
        pins=sorted(set(pins + list(options.pins))),
        external_files=dict(options.external_files),
        params=params,
        runtime_params=list(options.runtime_params),
    )
