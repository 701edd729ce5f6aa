"""The script bench_trainer_resume.py --workers launches: a Trainer script as users write them (transformers imported
at the top, the dataset a top-level class, the training under a main guard), so that a forkserver's workers import
it and, with it, transformers. `--relay`: RelayTrainer; else Trainer and its own resume_from_checkpoint.

    python benchmarks/trainer_resume_script.py --out DIR --workers 2 [--relay] [--resume] [--context forkserver]
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from torchrelay.integrations.transformers import RelayOptions, RelayTrainer  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class FirstUpdate(TrainerCallback):
    def __init__(self, marks: dict[str, float], stop: bool) -> None:
        self.marks, self.stop = marks, stop

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.marks.setdefault("first_update_done", time.perf_counter())
        self.marks.setdefault("global_step", state.global_step)
        # one update after the resume is all this measures (torchrelay's run stops by its request file)
        control.should_training_stop = self.stop


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--out", required=True)
    cli.add_argument("--workers", type=int, default=0)
    cli.add_argument("--relay", action="store_true")
    cli.add_argument("--resume", action="store_true")
    cli.add_argument(
        "--context", default=None, help="dataloader_multiprocessing_context (default: Trainer's)"
    )
    opt = cli.parse_args()
    args = TrainingArguments(
        output_dir=opt.out,
        use_cpu=True,
        per_device_train_batch_size=8,
        max_steps=100,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=1,
        logging_strategy="no",
        dataloader_num_workers=opt.workers,
        dataloader_multiprocessing_context=opt.context,
        report_to="none",
        disable_tqdm=True,
        seed=1234,
    )
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    marks: dict[str, float] = {"imported": time.perf_counter()}
    if opt.relay:
        options = RelayOptions(dataset_fingerprint="synthetic-tokens-v1:4096")
        trainer = RelayTrainer(model=model, args=args, train_dataset=Tokens(), relay=options)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.add_callback(FirstUpdate(marks, stop=not opt.relay))
    marks["train"] = time.perf_counter()
    if opt.relay:
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=f"{opt.out}/checkpoint-1" if opt.resume else None)
    report = {
        k: round(v - T0, 4) if isinstance(v, float) and k != "global_step" else v for k, v in marks.items()
    }
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
