"""After training: checkpoints preserved for later use, validation at chosen checkpoints, export for serving.

One launch of a plan (a real 2-rank run of the example: save_every 5, keep 2, keep_updates [10, 20], 30 updates,
then its validation stage) serves every test of the module that needs a run; a Hugging Face model is trained in
one more launch; the rest are unit tests of the pure policies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from helpers import EXAMPLES, clean_env, make_code_repo, segments, torchrun_cmd, write_config
from torchrelay.checkpoint.inventory import validate_complete
from torchrelay.checkpoint.retention import (
    AnyOf,
    EveryN,
    Explicit,
    Final,
    LatestN,
    decide,
    policy_for,
    unpreserved,
)
from torchrelay.checkpoint.select import list_checkpoints
from torchrelay.cli import main
from torchrelay.config.relay import RelayConfig
from torchrelay.controller.attempts import Attempts
from torchrelay.controller.plan import Plan, load_plan
from torchrelay.controller.validation import (
    ValidationSpec,
    command_for,
    run_one,
    select,
    validate_checkpoints,
)
from torchrelay.errors import ConfigError, UnsafeInput
from torchrelay.export import ExportOptions, export_weights
from torchrelay.manifest import Manifest
from torchrelay.paths.rundir import RunDir
from torchrelay.policy.costmodel import validation_fits
from torchrelay.records.contract import build_contract
from torchrelay.records.validation import read_pending, read_records
from torchrelay.report import render
from torchrelay.util.hashing import sha256_hex

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
    # what a validation stage after the run can count on: latest N alone does not keep an update until then
    assert unpreserved(_cfg(keep_every=15), [10, 15, 20, 25, 30, 40]) == [25]


def test_preservation_fields_are_validated_and_runtime_only(example: dict[str, Path]) -> None:
    with pytest.raises(
        ConfigError, match=r"'keep_updates' must be a list of updates in \[1, total_updates=30\]"
    ):
        _cfg(keep_updates=[0])
    with pytest.raises(ConfigError, match="'keep_updates' must be a list"):
        _cfg(keep_updates=[31])
    with pytest.raises(ConfigError, match=r"^config\.keep_every: must be >= 0"):
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


def test_validation_plan_section_and_placeholders(tmp_path: Path) -> None:
    base = {"run_dir": "runs/x", "train": {"script": "t.py"}}
    plan = Plan.from_dict({**base, "validate": {"run": "v {checkpoint}", "updates": [20, 10, 20]}}, tmp_path)
    assert plan.validate.update_list == [10, 20] and Plan.from_dict(base, tmp_path).validate.run == ""
    assert (
        Plan.from_dict({**base, "validate": {"run": "v", "updates": "kept"}}, tmp_path).validate.update_list
        is None
    )
    with pytest.raises(ConfigError, match="plan validate.updates: 'soon' is neither 'kept' nor a list"):
        Plan.from_dict({**base, "validate": {"run": "v", "updates": "soon"}}, tmp_path)
    with pytest.raises(ConfigError, match=r"plan validate.export: unknown field\(s\) \['dorp'\]"):
        Plan.from_dict({**base, "validate": {"run": "v", "export": {"dorp": ["head"]}}}, tmp_path)
    assert load_plan_with(tmp_path, base, {"validate.env.HF_HOME": "/x"}).validate.env == {"HF_HOME": "/x"}
    values = {
        "checkpoint": "/r/checkpoint-10",
        "metrics": "/r/m x.json",
        "update": "10",
        "run_dir": "/r",
        "weights": "/w",
    }
    assert (
        command_for("""echo ${HOME} {update} '{"a": 1}' > {metrics}""", values)
        == """echo ${HOME} 10 '{"a": 1}' > '/r/m x.json'"""
    )


def load_plan_with(folder: Path, data: dict[str, Any], sets: dict[str, Any]) -> Plan:
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_plan(path, sets)


# ------------------------------------------------------------------------------------------------ one real run
# The validation command: reads the checkpoint it is given (its update must be the one named), writes metrics, and
# crashes on checkpoint-20 the way a real evaluation would (an exception, exit 1).
VALIDATE = (
    f"{sys.executable} -c \"import json, sys; u = json.load(open(sys.argv[1] + '/relay_state.json'))['loop']['update']; "
    "assert u != 20, 'evaluation crashed (test)'; "
    "json.dump({'l1': 1.0 / u, 'update_seen': u, 'update_named': int(sys.argv[3])}, open(sys.argv[2], 'w'))\" "
    "{checkpoint} {metrics} {update}"
)


def launch_plan(plan: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torchrelay", "launch", str(plan), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())


def last_outcome(run: Path) -> dict[str, Any]:
    return json.loads((Attempts(RunDir(run)).all()[-1].path / "outcome.json").read_text())


@pytest.fixture(scope="module")
def kept_run(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of a plan: the formal run (save_every 5, keep 2, keep_updates [10, 20]), then validation."""
    base = tmp_path_factory.mktemp("kept")
    config = write_config(base / "lm.yaml", example["manifest"], example["root"], **KEEP)
    run = base / "run"
    plan = {
        "run_dir": str(run),
        "workdir": str(example["code"]),
        "train": {"script": "train_lm.py", "args": ["--config", str(config)], "nproc_per_node": 2},
        "smoke": {"when": "never"},
        "budget": {"margin_s": 1.0},
        "validate": {"run": VALIDATE, "updates": [10, 20, 30, 40]},
    }
    (base / "plan.yaml").write_text(yaml.safe_dump(plan))
    out = launch_plan(base / "plan.yaml")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "checkpoint-20: failed" in out.stderr and "checkpoint-40 not available: past the end" in out.stderr
    return run


@pytest.mark.launch
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


@pytest.mark.launch
def test_validation_runs_after_the_formal_run_and_records_each_checkpoint(kept_run: Path) -> None:
    records = read_records(RunDir(kept_run))
    assert sorted(records) == [10, 20, 30]
    for update in (10, 30):
        r = records[update]
        assert r.status == "ok" and r.exit_code == 0 and r.checkpoint == f"checkpoint-{update}"
        assert r.metrics == {"l1": 1.0 / update, "update_seen": update, "update_named": update}
        assert r.code["commit"] and r.inventory_sha256 == sha256_hex(
            kept_run / f"checkpoint-{update}" / "COMPLETE.json"
        )
        assert r.started >= float(segments(kept_run)[-1]["stopped"])  # after the training process exited
    crashed = records[20]
    assert (crashed.status, crashed.exit_code, crashed.metrics) == ("failed", 1, None)
    assert crashed.reason == "exited with code 1"
    assert (
        "evaluation crashed (test)" in (kept_run / "validation" / "checkpoint-20" / "output.log").read_text()
    )
    validate_complete(kept_run / "checkpoint-20")  # a crashing validation never costs the checkpoint
    outcome = last_outcome(kept_run)
    assert (outcome["exit_code"], outcome["ended"], outcome["stage"]) == (0, "finished", "done")
    assert outcome["validation"]["validated"] == [10, 30] and outcome["validation"]["failed"] == [20]
    assert outcome["validation"]["missing"] == {"40": "past the end of the schedule (30 updates)"}


@pytest.mark.launch
def test_a_second_launch_does_not_validate_again(kept_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {u: r.started for u, r in read_records(RunDir(kept_run)).items()}
    segments_before = len(segments(kept_run))
    out = launch_plan(kept_run.parent / "plan.yaml")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "the run is complete (checkpoint-30): no smoke, no formal run" in out.stderr
    assert {u: r.started for u, r in read_records(RunDir(kept_run)).items()} == before
    assert len(segments(kept_run)) == segments_before  # nothing was trained
    outcome = last_outcome(kept_run)
    assert outcome["validation"]["done_before"] == [10, 20, 30] and outcome["validation"]["validated"] == []

    # the plain verb validates every kept checkpoint not validated yet: checkpoint-25, with the example's real
    # validation (held-out loss of the weights read from the checkpoint)
    example_validation = (
        f"{sys.executable} {EXAMPLES / 'validate_lm.py'} --checkpoint {{checkpoint}} --out {{metrics}}"
    )
    assert main(["validate", str(kept_run), "--cmd", example_validation]) == 0
    assert sorted(read_records(RunDir(kept_run))) == [10, 20, 25, 30]
    metrics = read_records(RunDir(kept_run))[25].metrics or {}
    assert metrics.keys() == {"loss", "bits_per_byte", "samples"} and 0 < metrics["loss"] < 6
    # ... and hands a command the exported weights ({weights}, here without the head), removed afterwards
    weights_probe = (
        f'{sys.executable} -c "import json, sys; from safetensors import safe_open; '
        "keys = list(safe_open(sys.argv[1] + '/model.safetensors', 'np').keys()); "
        "json.dump({'tensors': len(keys), 'heads': sum(k.startswith('head') for k in keys)}, open(sys.argv[2], 'w'))\" "
        "{weights} {metrics}"
    )
    argv = [
        "validate",
        str(kept_run),
        "--cmd",
        weights_probe,
        "--updates",
        "25",
        "--again",
        "--weights",
        "--drop",
        "head",
    ]
    assert main(argv) == 0
    record = read_records(RunDir(kept_run))[25]
    assert record.metrics == {"tensors": 16, "heads": 0} and record.attempt == 2
    assert not (kept_run / "validation" / "checkpoint-25" / "weights").exists()
    capsys.readouterr()
    assert main(["status", str(kept_run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)["validation"]
    assert [(r["update"], r["status"]) for r in status["records"]] == [
        (10, "ok"),
        (20, "failed"),
        (25, "ok"),
        (30, "ok"),
    ]
    report = render(kept_run, kept_run.parent / "report")
    assert (
        report.plots["validation"].name == "validation.png"
        and report.plots["validation"].stat().st_size > 10_000
    )
    page = report.html.read_text()
    assert "<h2>Validation</h2>" in page and "checkpoint-20</td><td>failed" in page


@pytest.mark.launch
def test_validation_left_for_the_next_launch_when_time_is_short(kept_run: Path, tmp_path: Path) -> None:
    # the cost model: a validation (measured in this run, else the plan's estimate) and the margin must fit
    assert (
        validation_fits(600.0, 1060.0, 1000.0, 1.0).why
        == "60.0s left < 601.0s needed (validation 600.0s + margin 1.0s)"
    )
    assert validation_fits(0.0, 1060.0, 1000.0, 1.0).go and validation_fits(0.0, None, 1000.0, 1.0).go
    assert not validation_fits(0.0, 1000.5, 1000.0, 1.0).go
    # what a pass SIGKILLed while writing left (the temporaries of pending.json and of a record) goes with the
    # next pass; a file of the user's beside them stays
    v = kept_run / "validation"
    planted = [v / ".pending.json.tmp-424242", v / "checkpoint-10" / ".record.json.tmp-424242"]
    for p in planted:
        p.write_text("{")
    (v / "checkpoint-10" / "notes.txt").write_text("mine")
    (v / ".pending.json.tmp-7").mkdir()  # a folder of that name is no killed pass's: it stays
    spec = ValidationSpec(command=VALIDATE, updates=[10, 25], again=True, estimate_s=600.0)
    report = validate_checkpoints(kept_run, spec, deadline=time.time() + 0.5, margin_s=1.0)
    assert not [p for p in planted if os.path.lexists(p)]
    assert (v / "checkpoint-10" / "notes.txt").read_text() == "mine" and (v / ".pending.json.tmp-7").is_dir()
    assert report.records == [] and sorted(report.left) == [10, 25] and "s left <" in report.left[10]
    assert read_pending(RunDir(kept_run))["left"].keys() == {"10", "25"}

    # an unmeasured validation (a copy of the run without records) that outlives the deadline is stopped, its
    # whole process group, and stays to do
    fresh = tmp_path / "fresh"
    shutil.copytree(kept_run, fresh, ignore=shutil.ignore_patterns("validation"))
    pid_file = tmp_path / "pid"
    sleeper = ValidationSpec(command=f"echo $$ > {pid_file}; sleep 60 & wait", updates=[25])
    started = time.time()
    report = validate_checkpoints(fresh, sleeper, deadline=time.time() + 2.0, margin_s=0.5)
    assert time.time() - started < 15
    (record,) = report.records
    assert (record.status, record.reason) == ("interrupted", "the allocation's time ran out")
    assert report.left == {25: "the allocation's time ran out"}
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
    assert select(RunDir(fresh), [25]).todo == [25]  # interrupted: the next pass validates it again

    # a command that exits 0 without metrics, and one past its own timeout, are failures
    silent = run_one(RunDir(fresh), 25, ValidationSpec(command="true", timeout_s=0))
    assert silent.status == "failed" and "wrote no metrics" in silent.reason
    slow = run_one(RunDir(fresh), 25, ValidationSpec(command="sleep 30", timeout_s=0.5))
    assert slow.status == "failed" and slow.reason == "took longer than timeout_s=0.5s; killed"
    assert slow.attempt == silent.attempt + 1


@pytest.mark.launch
def test_validation_never_writes_through_a_link_out_of_the_run(
    kept_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`validation/`, or one checkpoint's folder in it, replaced by a link to a folder outside the run: the pass
    refuses (UnsafeInput, the refused exit code) and writes nothing there; a link inside the run is followed."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    copy = tmp_path / "run"
    shutil.copytree(kept_run, copy)
    shutil.rmtree(copy / "validation")
    (copy / "validation").symlink_to(outside)
    spec = ValidationSpec(command=VALIDATE, updates=[25], again=True)
    with pytest.raises(UnsafeInput, match="validation"):
        validate_checkpoints(copy, spec)
    (copy / "validation").unlink()
    (copy / "validation").mkdir()
    (copy / "validation" / "checkpoint-25").symlink_to(outside)
    with pytest.raises(UnsafeInput, match="checkpoint-25"):
        validate_checkpoints(copy, spec)
    assert list(outside.iterdir()) == []
    (copy / "validation" / "checkpoint-25").unlink()
    (copy / "inside").mkdir()
    (copy / "validation" / "checkpoint-25").symlink_to(copy / "inside")
    (outside / "mine").write_text("kept")
    (copy / "inside" / "weights").symlink_to(outside)  # where a pass's export goes: a link there is removed
    report = validate_checkpoints(copy, spec)
    assert [r.status for r in report.records] == ["ok"] and (copy / "inside" / "record.json").is_file()
    assert not os.path.lexists(copy / "inside" / "weights") and os.listdir(outside) == ["mine"]


@pytest.mark.launch
def test_validation_records_travel_in_a_bundle(
    kept_run: Path, example: dict[str, Path], tmp_path: Path
) -> None:
    copy = tmp_path / "run"
    shutil.copytree(kept_run, copy)
    bundle = tmp_path / "bundle"
    assert main(["pack", str(copy), str(bundle), "--code-dir", str(example["code"])]) == 0
    sums = (bundle / "SHA256SUMS").read_text()
    for update in (10, 20, 30):
        assert f"  validation/checkpoint-{update}/record.json\n" in sums
    assert main(["verify", str(bundle)]) == 0
    # ... and arrive with it: the continuation knows checkpoint-30 is validated, and that 10 is not here
    prepared = tmp_path / "prepared"
    assert main(["prepare", str(bundle), "--run-dir", str(prepared)]) == 0
    assert read_records(RunDir(prepared)).keys() == read_records(RunDir(copy)).keys()
    sel = select(RunDir(prepared), [10, 30])
    assert sel.done == [30] and sel.todo == [] and "no complete checkpoint" in sel.missing[10]


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.launch
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


@pytest.fixture(scope="module")
def hf_run(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A transformers Llama (from a config, random init) with a training-only head, trained on 2 ranks: (the code
    repo, the run, the folder holding its config.json and probe)."""
    pytest.importorskip("transformers")
    base = tmp_path_factory.mktemp("hf")
    code = make_code_repo(base / "code", scripts=("train_lm.py", "train_hf.py", "hf_parity.py"))
    config = write_config(
        base / "lm.yaml", example["manifest"], example["root"], total_updates=3, save_every=3
    )
    run, hf = base / "run", base / "hf"
    cmd = [*torchrun_cmd(code, run, 2, config, script="train_hf.py"), "--hf-out", str(hf)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env(), cwd=code)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return code, run, hf


@pytest.mark.launch
def test_export_of_a_hugging_face_model_loads_with_from_pretrained(
    hf_run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from torchrelay.checkpoint.reader import load_tensors

    _code, run, hf = hf_run
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


@pytest.mark.launch
def test_export_parity_holds_for_the_right_names_and_fails_a_wrong_rename(
    hf_run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--parity 4: float32 equal logits, bf16 within the KL tolerance, both recorded with the numerics identity; a
    --rename that strips the wrong prefix fails in one line, exit 2, and writes no export."""
    code, run, hf = hf_run
    base = ["export", str(run)]
    same = ["--drop", "state_head", "--include", str(hf / "config.json")]
    hooks = ["--parity", "4", "--parity-hooks", str(code / "hf_parity.py")]
    assert main([*base, str(tmp_path / "fp32"), *same, "--rename", "lm=", *hooks]) == 0
    said = capsys.readouterr().out
    assert "parity: 4 samples of the run, float32: equal logits" in said, said
    record = json.loads((tmp_path / "fp32" / "torchrelay_export.json").read_text())["parity"]
    assert record["mode"] == "exact" and record["unequal_samples"] == 0 and record["max_abs"] == 0.0
    assert record["numerics"]["torch"] == torch.__version__ and len(record["numerics_fingerprint"]) == 12
    assert len(set(record["indices"])) == 4 and record["hooks"]["file"] == "hf_parity.py"

    assert main([*base, str(tmp_path / "bf16"), *same, "--rename", "lm=", "--dtype", "bf16", *hooks]) == 0
    record = json.loads((tmp_path / "bf16" / "torchrelay_export.json").read_text())["parity"]
    assert (
        record["mode"] == "tolerance" and record["dtype"] == "bfloat16" and record["tolerance"]["kl"] == 0.01
    )
    assert record["max_abs"] > 0 and 0 <= record["kl"] < 0.01
    capsys.readouterr()
    # the same bf16 export held to a tolerance it cannot meet
    strict = [*base, str(tmp_path / "strict"), *same, "--rename", "lm=", "--dtype", "bf16", *hooks]
    assert main([*strict, "--parity-kl", "0", "--parity-max-abs", "0"]) == 2
    assert "export parity (bfloat16): KL" in capsys.readouterr().err and not (tmp_path / "strict").exists()

    # 'lm.model=' strips one level too many: the names load nowhere in the serving model
    wrong = tmp_path / "wrong"
    assert main([*base, str(wrong), *same, "--rename", "lm.model=", *hooks]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith(
        "torchrelay export: error: from_pretrained of the export leaves"
    )
    assert "unset" in err[0] and err[1].startswith("  hint: check --rename"), err
    assert not wrong.exists() and not list(tmp_path.glob(".wrong.export-tmp-*"))
    # a float32 export whose logits differ from training's in one ulp is not equal
    (code / "off_by_ulp.py").write_text(
        "import torch\nfrom hf_parity import inputs, training_model, training_logits as plain\n"
        "def training_logits(model, feed):\n    out = plain(model, feed)\n"
        "    return torch.nextafter(out, torch.full_like(out, float('inf')))\n"
    )
    off = ["--parity", "2", "--parity-hooks", str(code / "off_by_ulp.py")]
    assert main([*base, str(tmp_path / "off"), *same, "--rename", "lm=", *off]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "export parity: 2 of 2 samples give other logits than the training model (float32" in err[0], err
    assert not (tmp_path / "off").exists()


MEMORY_PROBE = """
import json, sys
from pathlib import Path
import torchrelay.export as ex
from torchrelay.checkpoint.reader import iter_model_tensors
from torchrelay.util.hashing import sha256_file

def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

if sys.argv[1] == "freed":  # a tensor read for an export: what it holds, and what it leaves once freed (RssAnon)
    tensors = iter_model_tensors(Path(sys.argv[2]))
    before = status("RssAnon")
    _name, tensor = next(tensors)
    held = status("RssAnon") - before
    del tensor
    print(json.dumps([held, status("RssAnon") - before]))
    sys.exit()
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here: imports do not count
before = status("VmRSS")
if sys.argv[1] == "export":
    ex.export_weights(Path(sys.argv[2]), Path(sys.argv[3]), ex.ExportOptions())
else:
    sha256_file(Path(sys.argv[2]))
print(json.dumps(status("VmHWM") - before))
"""


def memory_probe(*args: str) -> Any:
    """MEMORY_PROBE's figures (bytes) from a fresh process."""
    probe = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    return json.loads(probe.stdout.strip().splitlines()[-1])


def peak_growth(*args: str) -> int:
    """How much the peak resident memory of a fresh process grows while it exports or hashes (bytes)."""
    return int(memory_probe(*args))


def test_export_holds_about_one_tensor_in_memory(tmp_path: Path) -> None:
    """The peak grows by about the largest tensor, not by the checkpoint (which here is 4 such tensors)."""
    import warnings

    from torchrelay.checkpoint import dcp_io
    from torchrelay.checkpoint.inventory import inventory_entries, list_files, write_inventory

    ckpt = tmp_path / "checkpoint-1"
    side = 2048  # 16 MiB of fp32 per tensor
    model = {f"layer{i}.weight": torch.full((side, side), float(i)) for i in range(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says so
        dcp_io.save({"model": model, "optim": {}}, ckpt / "model")
    write_inventory(ckpt, inventory_entries(ckpt, list_files(ckpt)), update=1)
    del model
    grown = peak_growth("export", str(ckpt), str(tmp_path / "out"))
    largest = side * side * 4
    assert grown < 1.5 * largest, f"peak RSS grew by {grown / largest:.2f} x the largest tensor"
    # hashing a file (the inventory check here, a save's inventory, pack, verify) maps it; the hashed pages must
    # leave the process's RSS, or a 70 GB checkpoint looks like 70 GB of memory to the memory guard
    shard = max((ckpt / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    assert shard.stat().st_size > 3 * largest
    hashed = peak_growth("hash", str(shard))
    assert hashed < 0.5 * shard.stat().st_size, (
        f"hashing grew the peak by {hashed / shard.stat().st_size:.2f} x the file"
    )
    # a tensor read gives its memory back when it is freed: memory of the C heap may stay, and the next tensor then
    # takes new memory when a small allocation lies above the freed one (two tensors at the peak above, in about
    # 1 export of 30-100); in a fresh process glibc's heap keeps the first tensor's memory every time
    held, left = memory_probe("freed", str(ckpt))
    assert held > 0.9 * largest, f"reading a tensor held {held / largest:.2f} x it"
    assert left < 0.25 * largest, f"a freed tensor left {left / largest:.2f} x it in the process"
