"""Hugging Face Trainer over a torchrelay manifest, in length-bucketed order (docs/TRAINER.md).

    python examples/prepare_data.py --out data          # a data root and data/manifest.jsonl (id, path, length)
    torchrun --nproc_per_node=2 examples/train_hf_trainer_manifest.py --output-dir runs/hf-manifest \
        --manifest data/manifest.jsonl --data-root "$PWD/data/root"

Sample i is line i of the manifest: the bytes its `path` names. The manifest's path-independent fingerprint is the
run's contract; after moving the data, `torchrelay prepare BUNDLE --run-dir NEW --set data_root=/new/root
--check-files` rebases the run's copy, checks every file and records it in REBASE_RECORD.json, and the same command
resumes there (its --data-root is the old one: the prepared value wins). Each global batch holds samples of similar
`length` (sampler length_bucketed), in the same order on any worker count and after any resume.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from torchrelay.integrations.transformers import RelayOptions, RelayTrainer

SEQ = 32


class SourceBytes(torch.utils.data.Dataset):
    """Line i of the manifest: up to SEQ bytes of the file it names, from its offset (labels -100 past its end)."""

    def __init__(self, records) -> None:  # the run's copy of the manifest, rebased by prepare
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        rec = self.records[i]
        with open(rec["path"], "rb") as f:
            f.seek(rec["offset"])
            data = f.read(min(rec["length"], SEQ))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[: len(data)] = torch.tensor(list(data), dtype=torch.long)
        labels = ids.clone()
        labels[len(data) :] = -100
        return {"input_ids": ids, "labels": labels}


def main(callbacks: tuple[TrainerCallback, ...] = ()) -> int:
    cli = argparse.ArgumentParser()
    cli.add_argument("--output-dir", required=True)  # the run directory
    cli.add_argument("--manifest", required=True)  # read when the run is created; it keeps a copy
    cli.add_argument("--data-root", required=True)  # the prefix of the manifest's paths (runtime-only)
    cli.add_argument("--lr", type=float, default=1e-3)
    cli.add_argument("--workers", type=int, default=0)  # runtime-only
    opt = cli.parse_args()
    args = TrainingArguments(
        output_dir=opt.output_dir,
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=8,
        learning_rate=opt.lr,
        warmup_steps=2,
        save_steps=4,
        logging_steps=1,
        dataloader_num_workers=opt.workers,
        report_to="none",
        disable_tqdm=True,
        seed=1234,
    )
    relay = RelayOptions(
        manifest=opt.manifest,
        data_root=opt.data_root,
        dataset=SourceBytes,  # built from the run's records: dataset(records)[i] is line i
        sampler="length_bucketed",
        bucket_size=4,  # each run of 4 global batches sorted by `length`, then the batches shuffled
    )
    try:
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2))
        trainer = RelayTrainer(model=model, args=args, relay=relay, callbacks=list(callbacks))
        trainer.train()
        trainer.save_model()
        if dist.is_initialized():
            dist.barrier()
        return trainer.relay.exit_code  # 0 finished, 3 budget, 4 request, 5 signal
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
