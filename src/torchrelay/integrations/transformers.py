"""Hugging Face `Trainer` with every torchrelay guarantee: a mixin (or `RelayTrainer`) and its callback.

    from torchrelay.integrations.transformers import RelayTrainer      # Trainer + RelayTrainerMixin
    trainer = RelayTrainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.train()
    sys.exit(trainer.relay.exit_code)                                   # 0 finished, 3 budget, 4 request, 5 signal

How it fits Trainer's loop. The run is `Run.open`ed when the trainer is built (the contract from TrainingArguments,
the model config and the dataset, checked before anything trains). Trainer's training DataLoader is replaced by the
run's own `run.steps()` driven one micro-batch at a time: Trainer pulls the gradient-accumulation batches of an update
from it, and pulling the first batch of the next update is the update boundary, where torchrelay records the update's
metrics and sample ids, saves every `save_steps` updates, and agrees on a stop (request file, signal, budget). An
agreed stop saves the checkpoint first and ends the batches, which stops Trainer's loop. So the opener, the stop
agreement, the saver and the exposure ledger are the core's own; nothing here re-implements them.

The resume position comes from the order in O(1) (Trainer's own resume replays the sampler up to it); the model,
optimizer and LR scheduler are restored through `run.track` once Trainer has built and wrapped them (on_train_begin),
each rank's RNG right before the first batch, and `state.global_step` where Trainer sets up its state. Trainer's own
checkpointing (`_save_checkpoint`) is replaced: checkpoint-N/ is torchrelay's (DCP shards, inventory, commit protocol).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from torchrelay.config import envvars
from torchrelay.config.relay import stored_config
from torchrelay.data.loader import RelayLoader, start_forkserver
from torchrelay.errors import ConfigError, RelayError
from torchrelay.integrations.hf_contract import (
    RelayOptions,
    check_dataset,
    check_supported,
    parallel_identity,
    relay_config,
    write_manifest,
)
from torchrelay.log import logger
from torchrelay.manifest import Manifest, index_path
from torchrelay.paths.layout import MANIFEST_REL
from torchrelay.paths.rundir import RunDir
from torchrelay.records.contract import load_contract
from torchrelay.records.ended import Ended
from torchrelay.records.reshard import contract_global_batch
from torchrelay.run import Run, Step


def _manifest_samples(run: RunDir, options: RelayOptions, existing: bool) -> int:
    """How many samples the run's manifest lists: the script's file for a new run, else the run's own copy (the
    script's path may be the old cluster's; prepare rebased the copy and its data_root)."""
    run_dir = run.path
    if not existing:
        return len(Manifest.load(options.manifest or "", options.data_root))
    copy = run.manifest_path
    cfg = stored_config(run)
    return len(Manifest.load(copy, cfg.data_root, index=index_path(copy), root=run_dir))


class _UpdateBatches:
    """What Trainer iterates as its training DataLoader: the run's updates, micro-batch by micro-batch.

    Its length is the whole schedule's micro-batches whatever the resume point, so Trainer's epoch arithmetic sees
    one unchanging epoch; the batches themselves start at the resume position.
    """

    def __init__(self, trainer: RelayTrainerMixin, loader: RelayLoader) -> None:
        self._trainer = trainer
        self._loader = loader
        self.dataset = loader.dataset  # Trainer.num_examples reads it
        self.batch_size = trainer.relay.config.micro_batch
        self.steps: Iterator[Step] | None = None
        self.current: Step | None = None

    def __len__(self) -> int:
        cfg = self._trainer.relay.config
        return cfg.total_updates * cfg.grad_accum

    def __iter__(self) -> Iterator[Any]:
        if self.steps is not None:
            raise RelayError("a torchrelay run trains once per launch: train() was called twice")
        self.steps = self._trainer.relay.steps(self._loader)
        for step in self.steps:  # each next() past the first is an update boundary: record, save, agree
            self.current = step
            for _micro, batch in step.micro_batches():  # Trainer defers the gradient sync itself
                yield batch
        self.current = None
        self._trainer.control.should_training_stop = True  # an agreed stop (saved) or the schedule's end

    def finish(self) -> None:
        """The boundary after Trainer's last update: it records that update and saves and ends the segment."""
        if self.steps is None:
            return
        following = next(self.steps, None)
        if following is not None:
            self.close()
            raise RelayError(
                f"Trainer left its loop after update {following.update - 1} of "
                f"{self._trainer.relay.config.total_updates} without a torchrelay stop (a callback that sets "
                "should_training_stop?); that update was not saved",
                hint="stop a run with `torchrelay stop RUN_DIR`, a signal or a budget; the newest complete "
                "checkpoint is intact and the next launch resumes from it",
            )

    def close(self) -> None:
        """End the run's update loop without a boundary (an error): its loader workers stop."""
        if self.steps is not None and hasattr(self.steps, "close"):
            self.steps.close()


class RelayCallback(TrainerCallback):
    """Restores the tracked state once Trainer has built it, and logs each update's rank-local loss and LR."""

    def __init__(self, trainer: RelayTrainerMixin) -> None:
        self._trainer = trainer
        # Trainer's running loss sum after the previous update (it resets the sum when it logs)
        self._loss_before = 0.0

    def _step(self, update: int) -> Step | None:
        batches = self._trainer._relay_batches
        step = batches.current if batches is not None else None
        return step if step is not None and step.update == update else None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer's other callbacks have started their threads by now (a reporter's writer; tqdm's monitor is
        # harmless): if the workers will want a forkserver for them, it imports while the checkpoint restores.
        start_forkserver(int(args.dataloader_num_workers), args.dataloader_multiprocessing_context)
        self._trainer.relay_track()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = self._step(state.global_step + 1)  # called before Trainer counts the update
        optimizer = kwargs.get("optimizer")
        if step is not None and optimizer is not None:
            step.log(lr=optimizer.param_groups[0]["lr"])  # the LR this update used (the scheduler steps next)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self._trainer.relay
        # epochs of the run's order, not of this launch's batches
        state.epoch = state.global_step / run.order.updates_per_epoch
        step = self._step(state.global_step)
        pending = self._trainer._relay_pending
        if step is not None and pending:
            step.log(**{k: sum(v) / len(v) for k, v in pending.items()})
        pending.clear()
        total = getattr(self._trainer, "_tr_loss", None)
        if step is not None and total is not None:
            now = float(total)
            step.log(loss=now - self._loss_before)
            self._loss_before = now

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:  # Trainer reset its running loss before this log
            self._loss_before = 0.0
            step = self._step(state.global_step)
            if step is not None and "grad_norm" in logs:
                step.log(grad_norm=logs["grad_norm"])


class RelayTrainerMixin:
    """Mix into a Trainer subclass (`class MyTrainer(RelayTrainerMixin, Trainer)`) to make its run a torchrelay run.

    Takes one extra keyword, `relay=RelayOptions(...)`. After construction `self.relay` is the open `torchrelay.Run`
    (its `exit_code` is what the script should exit with). Subclasses may extend `relay_track` (what is saved and
    restored) and `relay_options` (the contract); both are part of this class's stable API.
    """

    relay: Run
    _relay_batches: _UpdateBatches | None
    _relay_pending: dict[str, list[float]]
    # what Trainer provides (this class is always mixed into a Trainer)
    args: Any
    model: Any
    model_wrapped: Any
    optimizer: Any
    lr_scheduler: Any
    train_dataset: Any
    data_collator: Any
    control: Any
    state: Any

    def __init__(self, *args: Any, relay: RelayOptions | None = None, **kwargs: Any) -> None:
        # Trainer's __init__ creates output_dir: when the run lives elsewhere (the audit's and launch's
        # TORCHRELAY_RUN_DIR), the script's own --output-dir must not be left behind as an empty folder.
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            # Workers are forked unless a forkserver is asked for or another Python thread runs (data/loader.py);
            # a forkserver imports what the script imports (transformers: seconds of CPU) while Trainer and the
            # run set up and restore, instead of when the first batch is asked for.
            start_forkserver(
                int(training_args.dataloader_num_workers), training_args.dataloader_multiprocessing_context
            )
        early_dir = envvars.RUN_DIR.text() or (relay.run_dir if relay is not None else None)
        if early_dir and training_args is not None:
            training_args.output_dir = str(early_dir)
        super().__init__(*args, **kwargs)
        self._relay_batches = None
        self._relay_pending: dict[str, list[float]] = {}
        options = self.relay_options(relay or RelayOptions())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"WORLD_SIZE={world} but Trainer did not join a process group, so each rank would train alone",
                hint="on CPU, pass TrainingArguments(use_cpu=True)",
            )
        run_dir = envvars.RUN_DIR.text() or options.run_dir or self.args.output_dir
        if not run_dir:
            raise ConfigError(
                "no run directory: set TrainingArguments.output_dir or RelayOptions(run_dir=...)"
            )
        # Trainer's own output (logs, a final model) goes where the run is: output_dir is runtime-only.
        self.args.output_dir = str(run_dir)
        check_supported(self.args, self.train_dataset, manifest=options.manifest is not None)
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        folder = Path(tempfile.mkdtemp(prefix="torchrelay-hf-"))
        try:
            # A new run copies the manifest into itself; a resume reads its own copy, so none is written then.
            run = RunDir(run_dir)
            existing = run.contract_path.is_file()
            samples = None
            if options.manifest is not None:
                manifest: Path | str = options.manifest
                samples = _manifest_samples(run, options, existing)
            else:
                manifest = MANIFEST_REL if existing else write_manifest(len(self.train_dataset), folder)
            parallel = parallel_identity(getattr(self, "accelerator", None))
            cfg = relay_config(
                self.args,
                self.model,
                self.train_dataset,
                options,
                world_size,
                manifest,
                parallel,
                samples=samples,
                global_batch=contract_global_batch(load_contract(run_dir)["fields"]) if existing else None,
            )
            self.relay = Run.open(run_dir, cfg, reshard=options.reshard)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        try:
            self._relay_accumulation(world_size)
        except BaseException as exc:
            self.relay.close(exc)
            raise
        if options.manifest is not None:
            try:
                if options.dataset is not None:  # from the run's own copy: the paths prepare rebased
                    self.train_dataset = options.dataset(self.relay.manifest.records)
                check_dataset(self.train_dataset, len(self.relay.manifest))
            except BaseException as exc:
                self.relay.close(exc)
                raise
        # The schedule is the run's (on a resume, the recorded one, which the contract held equal).
        self.args.max_steps = self.relay.config.total_updates
        self.add_callback(RelayCallback(self))  # type: ignore[attr-defined]  # Trainer's

    def _relay_accumulation(self, world_size: int) -> None:
        """Trainer's accumulation (and the DeepSpeed configuration's) from the run's layout: on a launch that moved
        the run to another world size the run derived grad_accum for the same global batch, and Trainer, its
        DeepSpeed engine and torchrelay's loader must cut the same updates (the engine is checked when tracked)."""
        cfg = self.relay.config
        if cfg.micro_batch != int(self.args.per_device_train_batch_size):
            raise ConfigError(
                f"TrainingArguments.per_device_train_batch_size is {self.args.per_device_train_batch_size}, the "
                f"run's micro_batch {cfg.micro_batch}",
                hint="launch with the run's per_device_train_batch_size",
            )
        if cfg.grad_accum == int(self.args.gradient_accumulation_steps):
            return
        if self.relay.rank == 0:
            logger.info(
                f"[torchrelay] gradient_accumulation_steps {self.args.gradient_accumulation_steps} -> "
                f"{cfg.grad_accum}: the run's global batch on {world_size} rank(s)"
            )
        self.args.gradient_accumulation_steps = cfg.grad_accum
        ds = getattr(self.args, "hf_deepspeed_config", None)
        if ds is None:
            return
        # Trainer filled the configuration's "auto" values from TrainingArguments when they were built; accelerate
        # hands this same dict to deepspeed.initialize, so the derived values go into it here.
        ds.config["gradient_accumulation_steps"] = cfg.grad_accum
        if isinstance(ds.config.get("train_batch_size"), int):
            ds.config["train_batch_size"] = cfg.micro_batch * cfg.grad_accum * world_size

    # ------------------------------------------------------------------ the stable API for subclasses
    def relay_options(self, options: RelayOptions) -> RelayOptions:
        """The options the run is opened with; a subclass adds contract params or pins (e.g. a DeepSpeed config)."""
        return options

    def relay_track(self, **statefuls: Any) -> None:
        """Register what each checkpoint holds with the run, restoring it on a resume (Trainer has built it all).

        A subclass adds its own state (a generator, an EMA, a counter) through `statefuls`:
        `def relay_track(self, **s): super().relay_track(noise=self.noise_gen, **s)`. It must not call
        `self.relay.track` a second time: that call replaces what this one registered.
        """
        if getattr(self, "is_deepspeed_enabled", False):
            # Trainer(deepspeed=...): the engine saves its own optimizer partitions and counters, and the LR
            # scheduler when DeepSpeed steps it (checkpoint/deepspeed_engine.py); a scheduler Trainer made and steps
            # itself (the config has no "scheduler", the optimizer is Trainer's) is tracked beside it.
            engine = self.model_wrapped
            own = (
                {"scheduler": self.lr_scheduler} if engine.lr_scheduler is None and self.lr_scheduler else {}
            )
            self.relay.track(model=engine, **own, **statefuls)
            return
        # accelerate wraps the torch optimizer; DCP's state-dict helpers want the torch one. With FSDP2 the model is
        # the fully_shard-ed module itself (model_wrapped is model) and the optimizer holds its DTensor shards: each
        # rank saves and restores its own shards.
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        self.relay.track(
            model=self.model_wrapped, optimizer=optimizer, scheduler=self.lr_scheduler, **statefuls
        )

    def relay_log(self, **metrics: Any) -> None:
        """Log metrics of the update in progress from inside Trainer's loop, e.g. each objective's loss in
        compute_loss (`self.relay_log(loss_g3=..., loss_a1=...)`): their mean over the update's micro-batches goes
        into this rank's metrics beside the loss (`status`, training_progress.json and `report` show `loss_*`)."""
        for key, value in metrics.items():
            self._relay_pending.setdefault(key, []).append(float(value))

    # ------------------------------------------------------------------ Trainer's hooks
    def get_train_dataloader(self) -> Any:
        """The run's batches in its exact order, from the resume position (see _UpdateBatches)."""
        dataset, collate = self.train_dataset, self.data_collator
        if type(dataset).__module__.startswith("datasets."):
            dataset = self._remove_unused_columns(dataset, description="Training")  # type: ignore[attr-defined]
        else:
            collate = self._get_collator_with_removed_columns(collate, description="Training")  # type: ignore[attr-defined]
        args = self.args
        loader = self.relay.dataloader(
            dataset,
            collate_fn=collate,
            pin_memory=bool(args.dataloader_pin_memory) and not args.use_cpu,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
        )
        self._relay_batches = _UpdateBatches(self, loader)
        return self._relay_batches

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        # Trainer counts updates from the checkpoint torchrelay resumes, and skips no batch: the run's batches
        # already start there.
        super()._init_training_state(*args, **kwargs)  # type: ignore[misc]
        self.state.global_step = self.relay.start_update
        self.state.epoch = self.relay.start_update / self.relay.order.updates_per_epoch
        return 0, 0

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer's train(), resuming from the run's newest complete checkpoint (chosen when the run opened)."""
        if isinstance(resume_from_checkpoint, str) and not self._is_resume_point(resume_from_checkpoint):
            raise ConfigError(
                f"train(resume_from_checkpoint={resume_from_checkpoint!r}): torchrelay resumes "
                f"{self.relay.resume_from or 'from the start'} (the newest complete checkpoint)",
                hint="drop resume_from_checkpoint (or pass True): the run chooses its checkpoint itself",
            )
        try:
            out = super().train(None, *args, **kwargs)  # type: ignore[misc]
            if self._relay_batches is not None:
                self._relay_batches.finish()
        except BaseException as exc:
            if self._relay_batches is not None:
                self._relay_batches.close()
            self.relay.close(exc)
            raise
        self.relay.close()
        return out

    def _is_resume_point(self, path: str) -> bool:
        chosen = self.relay.resume_from
        return chosen is not None and Path(path).resolve() == chosen.resolve()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # torchrelay saves (every save_every updates, at stops, at the end) through its commit protocol; Trainer's
        # own checkpoint-N/ would collide with it and is not written.
        return None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save_model; into the run directory it writes `final/`, and only once the run has finished
        (the run's own files, config.json among them, live there)."""
        run_dir = self.relay.dir.path
        if output_dir is None or Path(output_dir).resolve() == run_dir:
            if self.relay.ended != Ended.FINISHED:
                if self.relay.rank == 0:
                    logger.warning(
                        f"[torchrelay] save_model: the run has not finished ({self.relay.ended}); the state is in "
                        "its newest checkpoint, final/ is written when it finishes"
                    )
                return
            output_dir = str(run_dir / "final")
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]


class RelayTrainer(RelayTrainerMixin, Trainer):
    """`transformers.Trainer` whose run is a torchrelay run (see RelayTrainerMixin)."""


__all__ = ["RelayCallback", "RelayOptions", "RelayTrainer", "RelayTrainerMixin"]
