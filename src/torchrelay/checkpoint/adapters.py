"""What `run.track` accepts: anything with state_dict/load_state_dict, and the random generators people hold.

A generator has no state_dict of its own, so it is wrapped in a small versioned adapter whose state is tensors
and JSON numbers (never a pickle). Loading restores the very object the script holds, in place.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from torchrelay.errors import CheckpointError, ConfigError

ADAPTER_VERSION = 1


class _GeneratorState:
    """Base of the adapters: a kind and a version stored with the state, refused when they differ."""

    kind = ""

    def __init__(self, name: str, obj: Any) -> None:
        self.name = name
        self.obj = obj

    def _check(self, state: dict[str, Any]) -> None:
        kind, version = state.get("kind"), state.get("version")
        if kind != self.kind or version != ADAPTER_VERSION:
            raise CheckpointError(
                f"tracked state {self.name!r}: the checkpoint holds a {kind!r} (adapter version {version!r}), "
                f"this run tracks a {self.kind!r} (adapter version {ADAPTER_VERSION})",
                hint="track an object of the same kind under this name as the run that saved it",
            )

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": ADAPTER_VERSION, **self._state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check(state)
        self._load(state)

    def _state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class TorchGeneratorState(_GeneratorState):
    """A torch.Generator (any device): its state tensor, and the device it must go back to."""

    kind = "torch.Generator"

    def _state(self) -> dict[str, Any]:
        return {"device": str(self.obj.device), "state": self.obj.get_state()}

    def _load(self, state: dict[str, Any]) -> None:
        if state["device"] != str(self.obj.device):
            raise CheckpointError(
                f"tracked state {self.name!r}: a generator of device {state['device']}, now {self.obj.device}",
                hint="create the generator on the device the run that saved it used",
            )
        self.obj.set_state(state["state"])


def _np_to_tree(value: Any) -> Any:
    """numpy arrays become int64 tensors with their dtype; Python ints (PCG64's 128-bit words) stay exact in JSON."""
    if isinstance(value, np.ndarray):
        return {"array": torch.from_numpy(value.astype(np.int64)), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {k: _np_to_tree(v) for k, v in value.items()}
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _np_from_tree(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        return value["array"].numpy().astype(np.dtype(value["dtype"]))
    if isinstance(value, dict):
        return {k: _np_from_tree(v) for k, v in value.items()}
    return value


class NumpyGeneratorState(_GeneratorState):
    """A numpy.random.Generator: its bit generator's state dict (PCG64, MT19937, Philox, SFC64)."""

    kind = "numpy.random.Generator"

    def _state(self) -> dict[str, Any]:
        return {"bit_generator": _np_to_tree(self.obj.bit_generator.state)}

    def _load(self, state: dict[str, Any]) -> None:
        self.obj.bit_generator.state = _np_from_tree(state["bit_generator"])


class NumpyRandomStateState(_GeneratorState):
    """A legacy numpy.random.RandomState (MT19937 and its cached Gaussian)."""

    kind = "numpy.random.RandomState"

    def _state(self) -> dict[str, Any]:
        return {"state": _np_to_tree(self.obj.get_state(legacy=False))}

    def _load(self, state: dict[str, Any]) -> None:
        self.obj.set_state(_np_from_tree(state["state"]))


class PythonRandomState(_GeneratorState):
    """A random.Random: its Mersenne Twister words as a tensor, the version and cached Gaussian as JSON."""

    kind = "random.Random"

    def _state(self) -> dict[str, Any]:
        version, words, gauss = self.obj.getstate()
        return {"format": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss}

    def _load(self, state: dict[str, Any]) -> None:
        words = tuple(int(x) for x in state["words"].tolist())
        self.obj.setstate((int(state["format"]), words, state["gauss"]))


def adapt(name: str, obj: Any) -> Any:
    """The stateful that `run.track(name=obj)` saves: obj itself, or an adapter for a random generator."""
    if isinstance(obj, random.SystemRandom):
        raise ConfigError(
            f"run.track({name}=...): a random.SystemRandom draws from the OS and has no state to restore",
            hint="use random.Random(seed) for a stream that must resume",
        )
    if isinstance(obj, torch.Generator):
        return TorchGeneratorState(name, obj)
    if isinstance(obj, np.random.Generator):
        return NumpyGeneratorState(name, obj)
    if isinstance(obj, np.random.RandomState):
        return NumpyRandomStateState(name, obj)
    if isinstance(obj, random.Random):
        return PythonRandomState(name, obj)
    if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
        return obj
    raise ConfigError(
        f"run.track({name}=...): a {type(obj).__name__} has no state_dict/load_state_dict",
        hint="pass an object with state_dict()/load_state_dict(), or a torch.Generator, numpy Generator or "
        "random.Random",
    )
