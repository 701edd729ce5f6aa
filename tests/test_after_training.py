"""After training: checkpoints preserved for later use, validation at chosen checkpoints, export for serving.

One real 2-rank run of the example (save_every 5, keep 2, keep_updates [10, 20], 30 updates) serves every test
of the module that needs a run; the rest are unit tests of the pure policies.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import clean_env, launch, make_code_repo, torchrun_cmd, write_config
from torchrelay.checkpoint.retention import AnyOf, EveryN, Explicit, Final, LatestN, decide, policy_for
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.cli import main
from torchrelay.config import RelayConfig
from torchrelay.contract import build_contract
from torchrelay.errors import ConfigError
from torchrelay.export import ExportOptions, export_weights
from torchrelay.manifest import Manifest

TOTAL = 30
KEEP = {"total_updates": TOTAL, "warmup_updates": 2, "save_every": 5, "keep": 2, "keep_updates": [10, 20]}


# ------------------------------------------------------------------------------------------------ units
def _cfg(**changes: object) -> RelayConfig:
    return RelayConfig.from_dict({"seed": 1, "micro_batch": 2, "manifest": "m.jsonl", **KEEP, **changes})


def test_preservation_policies_compose_and_say_why() -> None:
    saved = [5, 10, 15, 20, 25, 30]
    verdict = decide(policy_for(_cfg()), saved)
    assert verdict.deleted == [5, 15]
    assert verdict.kept == {
        10: "keep_updates",
        20: "keep_updates",
        25: "latest 2",
        30: "latest 2, final",
    }
    every = decide(policy_for(_cfg(keep_every=15, keep_updates=[])), saved)
    assert every.kept == {15: "keep_every 15", 25: "latest 2", 30: "latest 2, keep_every 15, final"}
    # the final checkpoint survives later saves of nothing newer (e.g. a run whose keep shrank)
    assert decide(AnyOf((LatestN(2), Final(20))), [10, 20, 25, 30]).kept == {
        20: "final",
        25: "latest 2",
        30: "latest 2",
    }
    # whatever a policy says, the newest complete checkpoint is what a resume needs
    assert decide(Explicit(frozenset({5})), [5, 10]).kept == {5: "keep_updates", 10: "newest"}
    assert decide(policy_for(_cfg()), []).kept == {}
    # a checkpoint to keep must be written: the loop saves at kept updates off the save_every cadence too
    policy = policy_for(_cfg(keep_updates=[7], keep_every=12))
    assert [u for u in range(1, TOTAL) if policy.saves_at(u)] == [7, 12, 24]
    assert not LatestN(2).saves_at(7) and EveryN(0).preserve([0, 5]) == {}


def test_preservation_fields_are_validated_and_runtime_only(example: dict[str, Path]) -> None:
    with pytest.raises(
        ConfigError, match=r"'keep_updates' must be a list of updates in \[1, total_updates=30\]"
    ):
        _cfg(keep_updates=[0])
    with pytest.raises(ConfigError, match="'keep_updates' must be a list"):
        _cfg(keep_updates=[31])
    with pytest.raises(ConfigError, match="'keep_every' must be an integer >= 0"):
        _cfg(keep_every=-1)
    assert _cfg(keep_updates=[20, 10, 20]).keep_updates == [10, 20]
    # changing what is kept never changes the contract (the math): a resume accepts it as a runtime change
    base = RelayConfig.from_dict(
        {
            "seed": 1,
            "micro_batch": 2,
            "manifest": str(example["manifest"]),
            "data_root": str(example["root"]),
            **KEEP,
        }
    )
    manifest = Manifest.load(example["manifest"], str(example["root"]))
    a = build_contract(base, 2, None, manifest)
    b = build_contract(base.replace(keep_updates=[5], keep_every=3, keep=4), 2, None, manifest)
    assert a["sha256"] == b["sha256"]


# ------------------------------------------------------------------------------------------------ one real run
@pytest.fixture(scope="module")
def kept_run(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("kept")
    config = write_config(base / "lm.yaml", example["manifest"], example["root"], **KEEP)
    run = base / "run"
    out = launch(example["code"], run, config=config)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run


def test_retention_keeps_the_listed_updates_and_the_latest_two(
    kept_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpts = list_checkpoints(kept_run)
    assert [c.update for c in ckpts] == [10, 20, 25, 30] and all(c.complete for c in ckpts)
    assert main(["status", str(kept_run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert {c["update"]: c["kept"] for c in status["checkpoints"]} == {
        10: "keep_updates",
        20: "keep_updates",
        25: "latest 2",
        30: "latest 2, final",
    }
    assert main(["status", str(kept_run)]) == 0
    table = capsys.readouterr().out
    assert "kept because" in table and "keep_updates" in table


# ------------------------------------------------------------------------------------------------ export
def test_export_of_the_example_model_streams_equal_tensors(
    kept_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from torchrelay.checkpoint.reader import load_tensors

    stored = {
        k.removeprefix("model."): v
        for k, v in load_tensors(kept_run / "checkpoint-30").items()
        if k.startswith("model.")
    }
    out = tmp_path / "export"
    assert main(["export", str(kept_run), str(out), "--drop", "head"]) == 0
    exported = load_file(str(out / "model.safetensors"))
    assert "head.weight" in stored and not any(k == "head" or k.startswith("head.") for k in exported)
    assert exported.keys() == stored.keys() - {"head.weight"}
    assert all(torch.equal(exported[k], stored[k]) for k in exported)
    provenance = json.loads((out / "torchrelay_export.json").read_text())
    contract = json.loads((kept_run / "resume_contract.json").read_text())
    assert provenance["source"]["checkpoint"] == "checkpoint-30" and provenance["dropped"] == ["head.weight"]
    assert provenance["source"]["contract_sha256"] == contract["sha256"]
    assert provenance["source"]["code"]["commit"] == contract["fields"]["code.commit"]
    sums = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True)
    assert sums.returncode == 0 and sums.stdout.count(": OK") == 2, sums.stdout

    # a cast, an older checkpoint and shards small enough that HF's index is written
    small = tmp_path / "bf16"
    args = [
        "export",
        str(kept_run),
        str(small),
        "--checkpoint",
        "10",
        "--dtype",
        "bf16",
        "--max-shard-size",
        "20KB",
    ]
    assert main(args) == 0
    index = json.loads((small / "model.safetensors.index.json").read_text())
    at10 = {
        k.removeprefix("model."): v
        for k, v in load_tensors(kept_run / "checkpoint-10").items()
        if k.startswith("model.")
    }
    assert index["weight_map"].keys() == at10.keys() and len(set(index["weight_map"].values())) > 1
    for name, file in index["weight_map"].items():
        with safe_open(str(small / file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), at10[name].to(torch.bfloat16)), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in at10.values())

    # a checkpoint that fails its inventory is refused, naming the file; nothing is written
    broken = tmp_path / "copy" / "checkpoint-25"
    shutil.copytree(kept_run / "checkpoint-25", broken)
    shard = next((broken / "model").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["export", str(broken), str(tmp_path / "nope")]) == 2
    assert f"{shard.name} does not match its SHA-256" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists() and not list(tmp_path.glob(".nope.export-tmp-*"))
    with pytest.raises(ConfigError, match="--drop 'hea' matches no model tensor"):
        export_weights(kept_run, tmp_path / "typo", ExportOptions(drop=["hea"]))


def test_export_of_a_hugging_face_model_loads_with_from_pretrained(
    example: dict[str, Path], tmp_path: Path
) -> None:
    """A transformers Llama (from a config, random init) with a training-only head, trained on 2 ranks."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from torchrelay.checkpoint.reader import load_tensors

    code = make_code_repo(tmp_path / "code", scripts=("train_lm.py", "train_hf.py"))
    config = write_config(
        tmp_path / "lm.yaml", example["manifest"], example["root"], total_updates=3, save_every=3
    )
    run, hf = tmp_path / "run", tmp_path / "hf"
    cmd = [*torchrun_cmd(code, run, 2, config, script="train_hf.py"), "--hf-out", str(hf)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=code)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    export = tmp_path / "export"
    args = [
        "export",
        str(run),
        str(export),
        "--drop",
        "state_head",
        "--rename",
        "lm=",
        "--include",
        str(hf / "config.json"),
    ]
    assert main(args) == 0
    weights = load_file(str(export / "model.safetensors"))
    stored = load_tensors(run / "checkpoint-3")
    assert not any("state_head" in k for k in weights) and any(
        k.startswith("model.state_head") for k in stored
    )
    assert all(torch.equal(v, stored[f"model.lm.{k}"]) for k, v in weights.items())

    model = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    assert model.state_dict().keys() == weights.keys()
    probe = load_file(str(hf / "probe.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert torch.equal(logits, probe["logits"])
