"""One process, one rank: a DeepSpeed engine (ZeRO stage from argv, CPU, torch AdamW) after one step; prints as JSON
the bytes the memory tier's sizing counts for it (run/restore.py Tracked.state_bytes) and the bytes of the
tensor files its own save_checkpoint writes (what a memory checkpoint of it holds)."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from torchrelay.run.restore import Tracked

if __name__ == "__main__":
    with socket.socket() as probe:  # a free port: other tests may run beside this one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": int(sys.argv[1])}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randn(2, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    tracked = Tracked()
    tracked.register(engine, None, {})
    with tempfile.TemporaryDirectory() as folder:
        engine.save_checkpoint(folder, tag="t")
        written = sum(f.stat().st_size for f in Path(folder).rglob("*.pt"))
    print(json.dumps({"counted": tracked.state_bytes(), "written": written}), flush=True)
    dist.destroy_process_group()
