"""PyTorch Lightning with every torchrelay guarantee: one callback that makes `Trainer.fit` a torchrelay run.

    from torchrelay.integrations.lightning import RelayLightning
    relay = RelayLightning("runs/lit", tr.RelayConfig(seed=1234, micro_batch=4, grad_accum=2, ...))
    trainer = pl.Trainer(strategy="ddp", callbacks=[relay], enable_checkpointing=False)
    trainer.fit(model, train_dataloaders=relay.dataloader(dataset, collate_fn=collate))
    sys.exit(relay.exit_code)                       # 0 finished, 3 budget, 4 request, 5 signal

How it fits Lightning's loop (the same pieces as the Hugging Face route, integrations/transformers.py). The run is
`Run.open`ed in the callback's `setup`, once Lightning's strategy has joined the process group: the contract is the
RelayConfig plus what Lightning computes with (precision, gradient clipping, the strategy, the module's class and
hyper-parameters, Lightning's version). The training batches are the run's own `run.steps()`, micro-batch by
micro-batch: Lightning accumulates `grad_accum` of them (deferring DDP's gradient sync itself) and steps the
optimizer; pulling the first batch of the next update is the update boundary, where torchrelay records the update's
metrics and sample ids, saves, and agrees on a stop (request file, signal, budget). An agreed stop saves first and
ends the batches, which ends Lightning's epoch. The model, optimizer and LR scheduler are registered with
`run.track` in `on_train_start` (Lightning has built and wrapped them), each rank's RNG is restored right before
the first batch, and Lightning's step counter starts at the resume update.

One Lightning epoch spans one launch: its length is the micro-batches left of the schedule, so `max_steps` and
`max_epochs` are the run's; the data order's epochs are torchrelay's (`relay.run.order`). Lightning's own
checkpoints and `fit(ckpt_path=...)` are not used: torchrelay chooses and restores the newest complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from torchrelay.checkpoint.torch_compat import settle_ddp_buckets
from torchrelay.config import envvars
from torchrelay.config.relay import RelayConfig
from torchrelay.data.loader import RelayLoader, start_forkserver
from torchrelay.errors import EXIT_ERROR, ConfigError, RelayError
from torchrelay.run import Run, Step
from torchrelay.run.exact_reduce import EXACT

PIN = "pytorch-lightning"


def _plain(value: Any) -> Any:
    """A JSON value for the contract (enums by value, anything else JSON cannot hold as its text)."""
    return json.loads(json.dumps(value, default=lambda v: v.value if isinstance(v, Enum) else str(v)))


def lightning_identity(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """What Lightning computes with, beside the RelayConfig: the contract's params["lightning"]."""
    hparams = dict(getattr(module, "hparams", {}) or {})
    return _plain(
        {
            # its class's name, not its module's: a script run as __main__ or imported by a wrapper is one program
            "module": type(module).__qualname__,
            "hparams": hparams,
            "precision": str(trainer.precision),
            "gradient_clip_val": trainer.gradient_clip_val,
            "gradient_clip_algorithm": trainer.gradient_clip_algorithm,
            "strategy": type(trainer.strategy).__qualname__,
            "accelerator": type(trainer.accelerator).__qualname__,
        }
    )


class _UpdateBatches:
    """What Lightning iterates as its training data: the run's updates, micro-batch by micro-batch.

    Its length is what is left of the schedule, so Lightning's epoch ends where the run does; an agreed stop ends it
    early. Lightning prefetches no batch from an iterable whose length it knows, so the next update's first batch
    (the boundary) is asked for only once the update's optimizer step is done.
    """

    def __init__(self, relay: RelayLightning, dataset: Any, collate_fn: Any, loader_kwargs: dict[str, Any]):
        self._relay = relay
        self.dataset = dataset
        self._collate = collate_fn
        self._loader_kwargs = loader_kwargs
        self.steps: Iterator[Step] | None = None
        self.current: Step | None = None

    def __len__(self) -> int:
        run = self._relay.run
        return (run.config.total_updates - run.start_update) * run.config.grad_accum

    def __iter__(self) -> Iterator[Any]:
        if self.steps is not None:
            raise RelayError("a torchrelay run trains once per launch: its batches were iterated twice")
        run = self._relay.run
        loader: RelayLoader = run.dataloader(self.dataset, self._collate, **self._loader_kwargs)
        self.steps = run.steps(loader)
        for step in self.steps:  # each next() past the first is an update boundary: record, save, agree
            self.current = step
            for _micro, batch in step.micro_batches():  # Lightning defers the gradient sync itself
                yield batch
        self.current = None

    def finish(self) -> None:
        """The boundary after Lightning's last update: it records that update, saves and ends the segment."""
        if self.steps is None:
            return
        following = next(self.steps, None)
        if following is not None:
            self.close()
            raise RelayError(
                f"Lightning left its loop after update {following.update - 1} of "
                f"{self._relay.run.config.total_updates} without a torchrelay stop (trainer.should_stop set by a "
                "callback, such as EarlyStopping?); that update was not saved",
                hint="stop a run with `torchrelay stop RUN_DIR`, a signal or a budget; the newest complete "
                "checkpoint is intact and the next launch resumes from it",
            )

    def close(self) -> None:
        """End the run's update loop without a boundary (an error): its loader workers stop."""
        if self.steps is not None and hasattr(self.steps, "close"):
            self.steps.close()


class RelayLightning(pl.Callback):
    """The callback that makes `Trainer.fit` a torchrelay run (see the module's docstring).

    `config` is the run's RelayConfig (a resume checks its contract fields against the run's); `run_dir` may be
    overridden by TORCHRELAY_RUN_DIR (audit, launch). After `fit`, `exit_code` is what the script should exit with.
    """

    def __init__(self, run_dir: str | Path, config: RelayConfig) -> None:
        if config.elastic == EXACT:
            raise ConfigError(
                "RelayConfig.elastic='exact' is not supported with Lightning: Lightning runs the backward passes",
                hint="leave elastic at 'default'",
            )
        self.run_dir = envvars.RUN_DIR.text() or str(run_dir)
        self.config = config
        self.run: Run = None  # type: ignore[assignment]  # opened in setup, once the process group is up
        self._batches: _UpdateBatches | None = None
        self._pending: dict[str, list[float]] = {}
        self._loss: list[float] = []

    @property
    def exit_code(self) -> int:
        """0 finished, 3 budget, 4 request, 5 signal, 6 memory; 1 if the run never opened or failed."""
        return self.run.exit_code if self.run is not None else EXIT_ERROR

    def dataloader(self, dataset: Any, collate_fn: Any = None, **loader_kwargs: Any) -> _UpdateBatches:
        """The training data to pass to `fit`: `dataset[i]` is manifest line i, in the run's exact order, from the
        resume position, on `num_workers` of the config (loader_kwargs: pin_memory, prefetch_factor,
        multiprocessing_context, as `Run.dataloader` takes them)."""
        self._batches = _UpdateBatches(self, dataset, collate_fn, loader_kwargs)
        return self._batches

    def log(self, **metrics: Any) -> None:
        """Log metrics of the update in progress from training_step (`relay.log(acc=...)`): their mean over the
        update's micro-batches goes into this rank's metrics beside the loss."""
        for key, value in metrics.items():
            self._pending.setdefault(key, []).append(float(value))

    # ------------------------------------------------------------------ Lightning's hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.run is not None:
            return
        _check_trainer(trainer, pl_module, self.config)
        params = {**self.config.params, "lightning": lightning_identity(trainer, pl_module)}
        pins = sorted({*self.config.pins, f"{PIN}=={pl.__version__}"})
        self.run = Run.open(self.run_dir, dataclasses.replace(self.config, params=params, pins=pins))
        cfg = self.run.config
        # The schedule is the run's (on a resume, the recorded one, which the contract held equal).
        trainer.accumulate_grad_batches = cfg.grad_accum
        trainer.fit_loop.max_epochs = 1
        trainer.fit_loop.epoch_loop.max_steps = cfg.total_updates
        start_forkserver(
            cfg.num_workers, (self._batches_or_refuse()._loader_kwargs).get("multiprocessing_context")
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _own_sigterm(trainer)
        if trainer.ckpt_path is not None:  # known only once Lightning restored it, after setup
            raise ConfigError(
                f"fit(ckpt_path={str(trainer.ckpt_path)!r}): torchrelay resumes from the run's newest complete "
                "checkpoint itself",
                hint="drop ckpt_path",
            )
        optimizers, schedulers = trainer.optimizers, trainer.lr_scheduler_configs
        if len(optimizers) != 1 or len(schedulers) > 1:
            raise ConfigError(
                f"configure_optimizers returned {len(optimizers)} optimizers and {len(schedulers)} LR schedulers; "
                "torchrelay's Lightning route saves one of each",
                hint="return one optimizer (param groups for different settings) and at most one scheduler",
            )
        for conf in schedulers:
            if conf.interval != "step":
                raise ConfigError(
                    f"configure_optimizers: the LR scheduler's interval is {conf.interval!r}; with torchrelay one "
                    "Lightning epoch is one launch, so an epoch-interval scheduler would follow the launches",
                    hint='return {"scheduler": ..., "interval": "step"} (a schedule in updates)',
                )
        wrapped = trainer.strategy.model
        if self.run.world_size > 2 and isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            settle_ddp_buckets(wrapped)  # as run.track does for a DDP model (the module is tracked unwrapped)
        extra: dict[str, Any] = {"scheduler": schedulers[0].scheduler} if schedulers else {}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            extra["scaler"] = scaler
        self.run.track(model=pl_module, optimizer=optimizers[0], **extra)
        _start_at(trainer, self.run.start_update)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        step = self._step()
        if step is not None:
            step.log(
                lr=optimizer.param_groups[0]["lr"]
            )  # the LR this update uses (the scheduler steps after it)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss.append(float(loss))  # Lightning divided it by grad_accum: the sum is the update's mean
        step = self._step()
        if step is None or len(self._loss) < self.run.config.grad_accum:
            return
        step.log(loss=sum(self._loss), **{k: sum(v) / len(v) for k, v in self._pending.items()})
        self._loss.clear()
        self._pending.clear()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._batches is not None:
            self._batches.finish()
        self.run.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self.run is None:
            return
        if self._batches is not None:
            self._batches.close()
        self.run.close(exception)

    # ------------------------------------------------------------------ helpers
    def _step(self) -> Step | None:
        return self._batches.current if self._batches is not None else None

    def _batches_or_refuse(self) -> _UpdateBatches:
        if self._batches is None:
            raise ConfigError(
                "RelayLightning: fit() was not given relay.dataloader(...) as its training data",
                hint="trainer.fit(model, train_dataloaders=relay.dataloader(dataset, collate_fn=...))",
            )
        return self._batches


def _check_trainer(trainer: pl.Trainer, module: pl.LightningModule, cfg: RelayConfig) -> None:
    """Refuse what an exact resume cannot carry, naming the Trainer argument."""
    if not module.automatic_optimization:
        raise ConfigError(
            "LightningModule.automatic_optimization=False is not supported with torchrelay: it counts updates by "
            "Lightning's optimizer steps",
            hint="use automatic optimization (return the loss from training_step)",
        )
    refused = {
        "accumulate_grad_batches": (
            trainer.accumulate_grad_batches not in (1, cfg.grad_accum),
            f"it is the RelayConfig's grad_accum ({cfg.grad_accum})",
        ),
        "limit_train_batches": (
            trainer.limit_train_batches not in (1.0, None),
            "the run's schedule is total_updates",
        ),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ConfigError(
                f"Trainer({name}={getattr(trainer, name)!r}) is not supported with torchrelay: {why}",
                hint=f"leave {name} at its default",
            )


# Lightning's privates, in one place (tested with pytorch-lightning 2.6): its step counter and its SIGTERM handler.
def _start_at(trainer: pl.Trainer, update: int) -> None:
    """Lightning's global_step (and the step its loggers use) starts at the update the run resumes after."""
    epoch_loop = trainer.fit_loop.epoch_loop
    counter = epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    counter.ready = counter.completed = update
    epoch_loop._batches_that_stepped = update


def _own_sigterm(trainer: pl.Trainer) -> None:
    """Give SIGTERM back to torchrelay's handler (installed when the run opened): Lightning's own broadcasts from
    inside the handler and then raises SIGTERMException at its next batch, which ends the run without a save."""
    before = trainer._signal_connector._original_handlers.get(signal.SIGTERM)
    if callable(before):
        signal.signal(signal.SIGTERM, before)  # type: ignore[arg-type]  # Lightning types its saved handlers narrower


__all__ = ["RelayLightning", "lightning_identity"]
