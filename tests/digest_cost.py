"""What the per-update digest of the parameters (torchrelay/records/digests.py) costs against the update it follows.

Shared by tests/test_digests.py (toy size) and benchmarks/bench_digest.py (its docstring says how it is run).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn as nn

from torchrelay.records.digests import digest, parameters


def measure(*, width: int, depth: int, batch: int, updates: int, device: str = "cpu") -> dict[str, Any]:
    """Median seconds of an AdamW update of an MLP (forward, backward, step) and of the digest of its
    parameters right after it, on `device`; the ratio is the digest's share of an update."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, device=device)
    params = parameters(model)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    update_s, digest_s = [], []
    for i in range(updates + 2):  # two warm-up updates
        sync()
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t1 = time.perf_counter()
        digest(params)  # reads its terms back: the update's one host synchronization
        t2 = time.perf_counter()
        if i >= 2:
            update_s.append(t1 - t0)
            digest_s.append(t2 - t1)
    update, cost = statistics.median(update_s), statistics.median(digest_s)
    return {
        "device": device,
        "parameters": sum(p.numel() for p in params),
        "tensors": len(params),
        "update_s": update,
        "digest_s": cost,
        "ratio": cost / update if update > 0 else None,
    }
