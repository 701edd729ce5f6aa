"""The parity hooks of examples/train_hf.py: how `torchrelay export --parity N` builds its training model and feeds
one sample of the run to it and to the exported model (docs/CLI.md, export).

    torchrelay export runs/hf runs/hf-export --drop state_head --rename lm= --include runs/hf-cfg/config.json \\
        --parity 4 --parity-hooks examples/hf_parity.py
"""

from __future__ import annotations

from typing import Any

import torch
from train_hf import WithStateHead, hf_config  # the training script's own model
from train_lm import SourceBytes  # and its data


def training_model(config: Any) -> torch.nn.Module:
    return WithStateHead(hf_config(config.params))


def inputs(config: Any, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    xs, _length = SourceBytes([record], config.params["seq_len"])[0]
    return {"input_ids": xs[None, :-1]}  # the inputs training fed the language model


def training_logits(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model.lm(**inputs).logits
