"""torchtitan (0.3) with every torchrelay guarantee: a checkpoint manager and a token loader for its configs.

    from torchrelay.integrations.torchtitan import RelayCheckpointManager, RelayTokenLoader
    config.checkpoint = RelayCheckpointManager.Config(enable=True, interval=50, manifest="/data/owt/train.jsonl")
    config.dataloader = RelayTokenLoader.Config(replacement=False)

How it fits torchtitan's Trainer. Both are torchtitan `Configurable`s: the Trainer builds the loader, then the
manager (`config.checkpoint.build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=...,
states={"train_state": trainer}, ...)`), once the process group is up, so the manager opens the Run there. Its
contract is the run's schedule as torchtitan computes it (`training.steps`, `local_batch_size` and the gradient
accumulation steps, `debug.seed`), the token windows' settings and torchtitan's training, optimizer, LR-scheduler
and loss sections; `torchtitan` is pinned. `Trainer.train` calls `load` first: the manager registers the model, the
optimizers, the LR schedulers and the trainer's own state (`step`, `ntokens_seen`) with `run.track`, which restores
them from the newest complete checkpoint. The loader's batches are the run's `run.steps()`, micro-batch by
micro-batch; asking for the first one restores each rank's RNG. `save(step)`, which the Trainer calls after every
update, is the update boundary: torchrelay records the update's sample ids, saves every `interval` updates and agrees
on a stop (a request file, a signal, a budget). An agreed stop ends the loader, which ends torchtitan's loop
("Ran out of data"); `close` ends the segment and `exit_code` says how.

torchtitan's own checkpoint options that choose what to load (`load_step`, `initial_load_path`, `exclude_from_loading`,
`last_save_model_only`, `create_seed_checkpoint`, async modes) are refused: torchrelay restores its newest complete
checkpoint, all of it. Pipeline parallelism (several model parts) is refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import torch
from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools import filesystem

from torchrelay.config.relay import RelayConfig
from torchrelay.data.tokens import TokenWindows
from torchrelay.errors import EXIT_ERROR, ConfigError, RelayError
from torchrelay.run import Run, Step

PIN = "torchtitan"
# The sections of torchtitan's config that decide what the training computes; the rest (dump_folder, checkpoint,
# metrics, comm, profiler, parallelism, dataloader workers) may change between launches.
CONTRACT_SECTIONS = ("training", "optimizer", "lr_scheduler", "loss")


def _plain(value: Any) -> Any:
    """A JSON value for the contract (anything JSON cannot hold as its text)."""
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=str))


def titan_identity(titan_config: Any) -> dict[str, Any]:
    """What torchtitan computes with, beside the schedule: the contract's params["torchtitan"]."""
    ident = {
        name: _plain(getattr(titan_config, name)) for name in CONTRACT_SECTIONS if hasattr(titan_config, name)
    }
    debug = getattr(titan_config, "debug", None)
    if debug is not None:
        ident["deterministic"] = bool(getattr(debug, "deterministic", False))
    spec = getattr(titan_config, "model_spec", None)
    if spec is not None:
        ident["model"] = {"name": str(getattr(spec, "name", "")), "flavor": str(getattr(spec, "flavor", ""))}
    return ident


class RelayTokenLoader(BaseDataLoader):
    """torchtitan's training data as the run's token windows (docs/TOKENS.md), in the run's exact order.

    Each item is `({"input": x}, labels)`, x and labels `(local_batch_size, seq_len)` int64, the window's tokens and
    the same shifted by one. The windows come from the manifest `RelayCheckpointManager.Config.manifest` names;
    which window a slot reads is `replacement` (stated in the contract). The order is world-size-free: ranks are
    dealt samples by position, so `dp_world_size` and `dp_rank` are torchrelay's, not torchtitan's.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        replacement: bool = False
        """False: slot k reads window k of its file; True: a uniform offset per draw, as nanoGPT's get_batch."""

        dtype: str = "uint16"
        """The token files' dtype (uint16 or uint32)."""

        num_workers: int = 0
        """Loader worker processes (a runtime setting: any count reads the same batches)."""

    def __init__(
        self,
        config: Config,
        *,
        local_batch_size: int,
        seq_len: int,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        **_unused: Any,  # tokenizer, snapshot_every_n_steps: the windows are token ids already, the position is the run's
    ) -> None:
        self.config = config
        self.local_batch_size = int(local_batch_size)
        self.seq_len = int(seq_len)
        self.dp = (int(dp_world_size), int(dp_rank))
        self._manager: RelayCheckpointManager | None = None

    def attach(self, manager: RelayCheckpointManager) -> None:
        self._manager = manager

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        manager = self._manager
        if manager is None:
            raise ConfigError(
                "RelayTokenLoader: the checkpoint manager is not RelayCheckpointManager",
                hint="set config.checkpoint = RelayCheckpointManager.Config(enable=True, manifest=...)",
            )
        run = manager.run
        windows = TokenWindows(
            run.manifest.records,
            block_size=self.seq_len,
            replacement=self.config.replacement,
            dtype=self.config.dtype,
        )
        step = manager.begin(run.dataloader(windows))
        while step is not None:
            for _micro, (x, y, _offsets) in step.micro_batches():
                yield {"input": x}, y
            if manager.current is step:  # the Trainer asked for more micro-batches than one update holds
                raise RelayError(
                    f"torchtitan asked for a micro-batch past update {step.update}'s {run.config.grad_accum} "
                    "before saving it",
                    hint="leave checkpoint.enable on: the Trainer's save after each update is the update boundary",
                )
            step = manager.current

    def state_dict(self) -> dict[str, Any]:
        return {}  # the position is the run's (its checkpoint's update)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class RelayCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager as a torchrelay run (see the module's docstring).

    The run directory is torchtitan's checkpoint folder (`dump_folder`/`folder`); `interval` is `save_every`,
    `keep_latest_k` is `keep` (0: every checkpoint is kept).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        manifest: str = ""
        """The token-window manifest (`torchrelay.token_manifest`): one line per window slot of each token file."""

        data_root: str = ""
        """Where the manifest's relative paths are; `torchrelay prepare --set data_root=...` re-points it."""

        async_save: bool = True
        """Write, hash and commit checkpoints in the background."""

        initial_load_model_only: bool = False  # torchtitan's default warns without an initial_load_path

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        self.run: Run = None  # type: ignore[assignment]  # opened below
        if not self.enable:
            return
        _check_config(config)
        if not isinstance(dataloader, RelayTokenLoader):
            raise ConfigError(
                f"RelayCheckpointManager: the dataloader is a {type(dataloader).__name__}; the data order and the "
                "ledger are torchrelay's",
                hint="set config.dataloader = RelayTokenLoader.Config(replacement=...)",
            )
        if len(model_parts) != 1:
            raise ConfigError(
                f"RelayCheckpointManager: {len(model_parts)} model parts (pipeline parallelism) are not supported",
                hint="set parallelism.pipeline_parallel_degree = 1",
            )
        trainer = states.get("train_state")
        titan = getattr(trainer, "config", None)
        if titan is None or not hasattr(titan, "training"):
            raise ConfigError(
                "RelayCheckpointManager: states['train_state'] is not torchtitan's Trainer (it has no config.training)",
                hint="build the manager as torchtitan's Trainer does: config.checkpoint.build(..., states={'train_state': trainer})",
            )
        seed = getattr(getattr(titan, "debug", None), "seed", None)
        if seed is None:
            raise ConfigError(
                "torchtitan config debug.seed is not set: the run's order and its RNG derive from it",
                hint="set debug.seed (--debug.seed 1234)",
            )
        relay = RelayConfig(
            seed=int(seed),
            micro_batch=dataloader.local_batch_size,
            grad_accum=int(getattr(trainer, "gradient_accumulation_steps", 1)),
            total_updates=int(titan.training.steps),
            manifest=config.manifest,
            data_root=config.data_root,
            num_workers=dataloader.config.num_workers,
            save_every=config.interval,
            keep=config.keep_latest_k if config.keep_latest_k >= 2 else 10**9,
            async_save=config.async_save,
            params={
                "torchtitan": titan_identity(titan),
                "windows": {
                    "seq_len": dataloader.seq_len,
                    "replacement": dataloader.config.replacement,
                    "dtype": dataloader.config.dtype,
                },
            },
            pins=[f"{PIN}=={version(PIN)}"],
        )
        self.run = Run.open(filesystem.join(base_folder, config.folder), relay)
        self._model = model_parts[0]
        self._optimizers, self._lr_schedulers = optimizers, lr_schedulers
        self._states = states
        self._steps: Generator[Step, None, None] | None = None
        self.current: Step | None = None
        self._closed = False
        dataloader.attach(self)

    @property
    def exit_code(self) -> int:
        """0 finished, 3 budget, 4 request, 5 signal, 6 memory; 1 if the run never opened or failed."""
        return self.run.exit_code if self.run is not None else EXIT_ERROR

    # ------------------------------------------------------------------ torchtitan's interface
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            raise ConfigError(
                f"checkpoint.load_step={step}: torchrelay resumes from the run's newest complete checkpoint",
                hint="leave checkpoint.load_step at -1",
            )
        # The container's own `state` is empty (its optimizers hold it): its optimizers are tracked, a list, so
        # that DCP saves their state by parameter name beside the model's (sharded, reshardable).
        optimizers = list(getattr(self._optimizers, "optimizers", [self._optimizers]))
        self.run.track(
            model=self._model,
            optimizer=optimizers,  # type: ignore[arg-type]  # run.track takes one optimizer or a list of them
            lr_schedulers=self._lr_schedulers,
            **{name: obj for name, obj in self._states.items() if obj is not None},
        )
        return self.run.resume_from is not None

    def begin(self, loader: Any) -> Step | None:
        """The first update's Step (the loader's first batch): each rank's RNG is restored here."""
        if self._steps is not None:
            raise RelayError("a torchrelay run trains once per launch: its batches were iterated twice")
        steps = self.run.steps(loader)
        self._steps = steps  # type: ignore[assignment]  # a generator function's: close() ends it
        self.current = next(steps, None)
        return self.current

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        step = self.current
        if step is None or step.update != curr_step:
            raise RelayError(
                f"torchtitan saved step {curr_step}, torchrelay's update in progress is "
                f"{'none' if step is None else step.update}",
                hint="the Trainer's step must start at the run's (leave train_state to the manager)",
            )
        self.current = next(self._steps, None)  # type: ignore[arg-type]  # set by begin
        return True

    def _maybe_wait_for_staging(self) -> None:
        pass  # a save copies what it writes at the boundary, before the next optimizer step

    def _wait_for_saving(self) -> None:
        self.save_future = None

    def _close(self) -> None:
        if self._closed or self.run is None:
            return
        self._closed = True
        if self.current is not None and self._steps is not None:
            self._steps.close()  # the loop ended inside an update (an error): its loader stops
        self.run.close()


def _check_config(config: RelayCheckpointManager.Config) -> None:
    """Refuse torchtitan's options that choose what to load or write: torchrelay's checkpoint is whole."""
    refused = {
        "load_only": config.load_only,
        "initial_load_path": config.initial_load_path is not None,
        "exclude_from_loading": bool(config.exclude_from_loading),
        "create_seed_checkpoint": config.create_seed_checkpoint,
        "enable_first_step_checkpoint": config.enable_first_step_checkpoint,
        "last_save_in_hf": config.last_save_in_hf,
    }
    for name, bad in refused.items():
        if bad:
            raise ConfigError(
                f"checkpoint.{name}={getattr(config, name)!r} is not supported with RelayCheckpointManager: "
                "torchrelay saves and restores every rank's whole state at update boundaries",
                hint=f"leave checkpoint.{name} at its default",
            )
    if not config.manifest:
        raise ConfigError(
            "checkpoint.manifest is empty: RelayCheckpointManager reads the token-window manifest it names",
            hint="write one with torchrelay.token_manifest([...train.bin], MANIFEST, block_size=seq_len)",
        )


__all__ = ["RelayCheckpointManager", "RelayTokenLoader", "titan_identity"]
