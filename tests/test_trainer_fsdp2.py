"""Hugging Face Trainer with FSDP2 through accelerate (tests/trainer_fsdp2.py's worker, 2 ranks, gloo:
the script benchmarks/gpu_trainer_fsdp2.py runs on GPUs).

accelerate applies an FSDP plugin only on an accelerator; the worker turns it on for CPU (FSDP2's fully_shard runs
on CPU tensors with a gloo mesh), so the sharded path is tested here and on GPUs by the same script. Stopped by a
request and resumed with another worker count, the run ends bit for bit where the uninterrupted one ends; each rank
wrote its own shards; the FSDP settings accelerate trains with are in the contract.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from helpers import segments
from torchrelay.policy.stop import write_request


def _bench() -> Any:
    import trainer_fsdp2

    return trainer_fsdp2


def _plugin(**fsdp_config: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir="/a", use_cpu=True, report_to="none", fsdp=True, fsdp_config={"version": 2, **fsdp_config}
    )
    return args, FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)


def test_fsdp_settings_in_the_contract_without_runtime_ones() -> None:
    from torchrelay.integrations.hf_contract import math_args, parallel_identity

    def identity(plugin: Any, precision: str = "no") -> Any:
        state = SimpleNamespace(fsdp_plugin=plugin, distributed_type="DistributedType.FSDP")
        return parallel_identity(SimpleNamespace(state=state, mixed_precision=precision))

    args_a, a = _plugin(reshard_after_forward=True)
    args_b, b = _plugin(reshard_after_forward=False, cpu_ram_efficient_loading=True)
    # built twice, the same (no object address in it); re-gathering and loading choices are runtime-only
    assert identity(a) == identity(b) and json.dumps(identity(a))
    assert math_args(args_a) == math_args(args_b)
    fsdp = identity(a)["fsdp"]
    assert fsdp["fsdp_version"] == 2 and "reshard_after_forward" not in fsdp and "state_dict_type" not in fsdp
    # mixed precision and the FSDP units are the math
    _, c = _plugin()
    c.set_mixed_precision("bf16")
    assert identity(c, "bf16")["fsdp"]["mixed_precision_policy"]["param_dtype"] == "torch.bfloat16"
    assert identity(c, "bf16") != identity(a)
    args_d, d = _plugin(transformer_layer_cls_to_wrap="LlamaDecoderLayer")
    assert identity(d)["fsdp"]["transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]
    assert math_args(args_d) != math_args(args_a)
    # no FSDP: nothing added (the contracts of DDP runs are unchanged)
    ddp = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=None, distributed_type="DistributedType.MULTI_CPU")
    )
    assert parallel_identity(ddp) is None and parallel_identity(None) is None


@pytest.mark.launch
def test_trainer_fsdp2_stopped_resumed_bit_exact(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    bench = _bench()
    opt = argparse.Namespace(nproc=2, device="cpu", pace=0.0)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert bench._launch(opt, straight, "fp32", 0, tmp_path / "a.log") == 0, bench._tail(tmp_path / "a.log")
    log = (tmp_path / "a.log").read_text()
    assert "FSDP2_UNITS 6 FSDPLlamaForCausalLM" in log, log[-3000:]  # 2 layers, embedding, norm + head, root
    stopped.mkdir()
    write_request(stopped, at_update=bench.EARLY)
    rc = bench._launch(opt, stopped, "fp32", 0, tmp_path / "b.log")
    assert rc == 1 and "exitcode  : 4" in (tmp_path / "b.log").read_text(), bench._tail(tmp_path / "b.log")
    assert bench._launch(opt, stopped, "fp32", 2, tmp_path / "c.log") == 0, bench._tail(tmp_path / "c.log")
    assert [s["ended"] for s in segments(stopped)] == ["request", "finished"]
    assert segments(stopped)[1]["runtime_changes"] == {"num_workers": [0, 2]}

    result = bench.compare(straight, stopped, 2)
    assert result["all_equal"] and result["optimizer_tensors"] > 20, result  # every parameter and Adam moment
    assert result["metrics_equal"] and result["exposures_equal"], result
    assert result["ledger_ok"] and result["ledger"] == {"exposures": 96, "distinct": 64, "repeats": 0}, result
    assert result["first_metric_diff_update"] is None
    # the GPU script's summary line, passing and failing (device time is too scarce to find a typo there)
    res = {**result, "pass": True, "segments": segments(stopped), "fsdp2": "FSDP2_UNITS 6", "wall_s": 1.0}
    assert bench._summary(res).startswith("PASS: 84 tensors (63 optimizer) torch.equal=True")
    failed = {**res, "pass": False, "differ": ["model.lm_head.weight"], "first_metric_diff_update": 5}
    assert "FAIL" in bench._summary(failed) and "first differ at update 5" in bench._summary(failed)
    assert bench._summary({"pass": False, "error": "uninterrupted run failed"}).startswith(
        "FAIL: uninterrupted"
    )
    # sharded: every parameter and Adam moment in two chunks, one written by each rank (Adam's steps are scalars)
    meta = dcp.FileSystemReader(str(stopped / f"checkpoint-{bench.UPDATES}" / "model")).read_metadata()
    tensors = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.size) > 0}
    assert len(tensors) == result["tensors"] - 21, sorted(tensors)  # 21 parameters, each with its step
    assert {len(v.chunks) for v in tensors.values()} == {2}, {k: len(v.chunks) for k, v in tensors.items()}
    fields = json.loads((stopped / "resume_contract.json").read_text())["fields"]
    assert (
        fields["params.accelerate.fsdp.fsdp_version"] == 2
        and fields["params.accelerate.mixed_precision"] == "no"
    )
    assert fields["params.accelerate.fsdp.transformer_cls_names_to_wrap"] == ["LlamaDecoderLayer"]
    assert fields["params.training_args.fsdp_config.version"] == 2
    assert not [k for k in fields if k.endswith("reshard_after_forward")]  # runtime-only
