"""Serving parity: the export, loaded as a serving stack loads it, computes what the training model computes.

`torchrelay export --parity N --parity-hooks FILE` loads the folder being exported with transformers'
`from_pretrained`, and the training model (built by FILE, loaded with the checkpoint's own tensors under their own
names), and runs both on the first N samples of the run's order. An export whose floating tensors are all float32
must give equal logits (torch.equal); a lower precision is held to a stated tolerance: the mean KL divergence of the
export's next-token distribution from training's (and, if given, the largest absolute logit error). The verdict is
recorded in torchrelay_export.json with the numerics identity it was measured on; a failure writes no export.

FILE is Python, run in this process (so --parity runs your code; export alone runs none). It defines
    training_model(config) -> torch.nn.Module                 # the module run.track saved, random init is fine
    inputs(config, record) -> dict[str, Tensor]               # the serving model's keyword inputs for one sample
    training_logits(model, inputs) -> Tensor                  # the same logits from the training module
and optionally `load_exported(path, dtype) -> torch.nn.Module` (default: AutoModelForCausalLM.from_pretrained).
`config` is the run's RelayConfig; `record` its manifest line (paths under the run's data_root).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from torchrelay.checkpoint.reader import iter_model_tensors, model_tensor_specs
from torchrelay.config.relay import stored_config
from torchrelay.errors import ConfigError, ParityError, RelayError
from torchrelay.identity import numerics
from torchrelay.ledger.exposure import order_and_contract
from torchrelay.paths.rundir import RunDir
from torchrelay.util.hashing import sha256_hex

HOOKS = ("training_model", "inputs", "training_logits")


@dataclass(kw_only=True, slots=True)
class ParityOptions:
    """How many samples, whose code builds the training model, and the tolerance below float32."""

    samples: int
    hooks: Path
    kl: float = 1e-2  # mean KL(train || export) per position, in nats
    max_abs: float | None = None  # largest |logit difference|; None: recorded, not held

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"export --parity {self.samples}: give the number of samples to compare (>= 1)")
        if not Path(self.hooks).is_file():
            raise ConfigError(
                f"export --parity-hooks {self.hooks}: no such file",
                hint="a Python file defining training_model, inputs and training_logits (docs/CLI.md)",
            )
        if self.kl < 0 or (self.max_abs is not None and self.max_abs < 0):
            raise ConfigError("export --parity-kl / --parity-max-abs must not be negative")


def _load_hooks(path: Path) -> ModuleType:
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"torchrelay_parity_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"export --parity-hooks {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the hooks import the training script beside them
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    missing = [name for name in HOOKS if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigError(
            f"export --parity-hooks {path}: defines no {missing[0]}()",
            hint="define training_model(config), inputs(config, record) and training_logits(model, inputs)",
        )
    return module


def _from_pretrained(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # its progress bar and load report would bury the one line that says what is wrong
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        # with output_loading_info it returns (model, info), which transformers' stubs do not say
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, output_loading_info=True)
        model, info = loaded
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing, unexpected = info.get("missing_keys") or [], info.get("unexpected_keys") or []
    if missing or unexpected:
        raise ParityError(
            f"from_pretrained of the export leaves {len(missing)} of the model's tensors unset (e.g. "
            f"{sorted(missing)[:2]}) and {len(unexpected)} exported tensors unused (e.g. {sorted(unexpected)[:2]})",
            hint="check --rename and --drop against the serving model's state_dict names",
        )
    return model


def _training_model(hooks: ModuleType, config: Any, ckpt: Path) -> torch.nn.Module:
    model = hooks.training_model(config)
    state = dict(iter_model_tensors(ckpt, sorted(model_tensor_specs(ckpt))))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ConfigError(
            f"export --parity-hooks: training_model() does not hold {ckpt.name}'s model tensors: "
            f"{str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else exc}",
            hint="return the module run.track(model=...) saved (unwrapped)",
        ) from exc
    return model.float().eval()


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(reference) || softmax(other)), in nats."""
    ref = torch.log_softmax(reference.double(), dim=-1).reshape(-1, reference.shape[-1])
    oth = torch.log_softmax(other.double(), dim=-1).reshape(-1, other.shape[-1])
    return float((ref.exp() * (ref - oth)).sum(-1).mean())


def check_parity(out: Path, ckpt: Path, run: RunDir | None, options: ParityOptions) -> dict[str, Any]:
    """Compare the export in `out` with the training model of `ckpt` on the run's first samples; the record for
    torchrelay_export.json, or ParityError. Exact when the exported floating tensors are float32."""
    if run is None:
        raise ConfigError(
            f"export --parity needs the run's data: export {ckpt.parent} (the run directory or bundle), not a "
            "checkpoint alone"
        )
    if not (out / "config.json").is_file():
        raise ConfigError(
            "export --parity loads the export with from_pretrained, which needs its config.json",
            hint="add --include PATH/config.json (the serving model's config)",
        )
    hooks = _load_hooks(options.hooks)
    config = stored_config(run)
    order, manifest, _sha = order_and_contract(run)
    indices = [int(i) for i in order.epoch_order(0)[: min(options.samples, len(manifest))]]
    dtype = _floating_dtype(out)
    exact = dtype == torch.float32
    loader = getattr(hooks, "load_exported", None)
    try:
        exported = (loader(out, dtype) if callable(loader) else _from_pretrained(out, dtype)).eval()
    except RelayError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' own refusal, as one line
        raise ParityError(
            f"from_pretrained({out.name}) failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        ) from exc
    training = _training_model(hooks, config, ckpt)
    worst_abs, kls, unequal = 0.0, [], 0
    with torch.no_grad():
        for i in indices:
            feed = hooks.inputs(config, manifest.records[i])
            want = hooks.training_logits(training, feed).float()
            got = exported(**feed).logits.float()
            if want.shape != got.shape:
                raise ParityError(
                    f"sample {i} (manifest line {i}): the export's logits are {tuple(got.shape)}, training's "
                    f"{tuple(want.shape)}"
                )
            unequal += int(not torch.equal(want, got))
            worst_abs = max(worst_abs, float((want - got).abs().max()))
            kls.append(_kl(want, got))
    kl = sum(kls) / len(kls)
    identity = numerics.gather()
    record = {
        "samples": len(indices),
        "indices": indices,
        "dtype": str(dtype).removeprefix("torch."),
        "mode": "exact" if exact else "tolerance",
        "unequal_samples": unequal,
        "max_abs": worst_abs,
        "kl": kl,
        "tolerance": None if exact else {"kl": options.kl, "max_abs": options.max_abs},
        "hooks": {"file": Path(options.hooks).name, "sha256": sha256_hex(Path(options.hooks))},
        "numerics": identity,
        "numerics_fingerprint": numerics.fingerprint(identity),
    }
    if exact and unequal:
        raise ParityError(
            f"export parity: {unequal} of {len(indices)} samples give other logits than the training model "
            f"(float32, max |error| {worst_abs:.3g}, KL {kl:.3g})",
            hint="check --rename and --drop; a float32 export must compute exactly what training computes",
        )
    over_abs = options.max_abs is not None and worst_abs > options.max_abs
    if not exact and (kl > options.kl or over_abs):
        raise ParityError(
            f"export parity ({record['dtype']}): KL {kl:.3g} (tolerance {options.kl:g}), max |error| "
            f"{worst_abs:.3g}{f' (tolerance {options.max_abs:g})' if options.max_abs is not None else ''}",
            hint="check --rename and --drop, or export in float32 (--dtype fp32) to compare exactly",
        )
    return record


def _floating_dtype(out: Path) -> torch.dtype:
    """The dtype of the export's floating tensors (export casts them all alike)."""
    from safetensors import safe_open

    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                dtype = f.get_slice(name).get_dtype()
                if dtype in ("BF16", "F16", "F32", "F64"):
                    return {"BF16": torch.bfloat16, "F16": torch.float16}.get(dtype, torch.float32)
    return torch.float32
