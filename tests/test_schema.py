"""The one configuration layer (util/schema.py) and the one place of the environment variables (config/envvars.py):
located errors, a did-you-mean, bool never an int, the runtime rule as field metadata, the committed JSON schemas
and docs/ENVIRONMENT.md equal to what the code generates. All in-process."""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest

from helpers import REPO
from torchrelay.commands import pack as pack_cli
from torchrelay.commands import prepare as prepare_cli
from torchrelay.config import envvars
from torchrelay.config.relay import RUNTIME_FIELDS, RelayConfig
from torchrelay.controller.plan import Plan, load_plan
from torchrelay.controller.schemas import render, schemas
from torchrelay.controller.slurm import BatchSpec, SlurmSpec
from torchrelay.errors import ConfigError
from torchrelay.handoff.pack import PackOptions
from torchrelay.handoff.prepare import PrepareOptions
from torchrelay.records.contract import build_contract
from torchrelay.util import schema

BASE = {"seed": 1, "micro_batch": 2, "total_updates": 10, "manifest": "m.jsonl"}
PLAN = {"run_dir": "runs/x", "train": {"script": "t.py"}}


def _config_error(data: dict[str, Any], source: str = "config") -> str:
    with pytest.raises(ConfigError) as info:
        RelayConfig.from_dict(data, source=source)
    return info.value.message


def _plan_error(data: dict[str, Any], tmp_path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        Plan.from_dict(data, tmp_path)
    return info.value.message


def test_errors_name_the_field_where_it_is(tmp_path: Path) -> None:
    train = {"script": "t.py", "nproc_per_node": "two"}
    assert (
        _plan_error({**PLAN, "train": train}, tmp_path)
        == "plan.train.nproc_per_node: expected int, got 'two'"
    )
    checks = {"checks": [{"name": "a", "run": "true"}, {"name": "b", "run": "true", "timeout_s": "long"}]}
    assert (
        _plan_error({**PLAN, "preflight": checks}, tmp_path)
        == "plan.preflight.checks[1].timeout_s: expected a number, got 'long'"
    )
    assert _plan_error({**PLAN, "slurm": {"extra": "--exclusive"}}, tmp_path) == (
        "plan.slurm.extra: expected a list, got '--exclusive'"
    )
    assert _plan_error({**PLAN, "budget": 3}, tmp_path) == "plan.budget: expected a mapping, got 3"
    # a plan file is named first, the field after it
    f = tmp_path / "p.yaml"
    f.write_text("run_dir: r\ntrain: {script: t.py, nnodes: 0}\n")
    with pytest.raises(ConfigError, match=rf"^plan {re.escape(str(f))}: train\.nnodes: must be >= 1, got 0$"):
        load_plan(f)
    # the fields that were never checked as integers before
    assert _config_error({**BASE, "keep": "3"}) == "config.keep: expected int, got '3'"
    assert _config_error({**BASE, "bucket_size": 2.5}) == "config.bucket_size: expected int, got 2.5"
    assert _config_error({**BASE, "save_every": [1]}) == "config.save_every: expected int, got [1]"
    assert (
        _config_error({**BASE, "keep_updates": [5, "x"]}) == "config.keep_updates[1]: expected int, got 'x'"
    )
    assert _config_error({"seed": 1, "total_updates": 3, "manifest": "m"}) == (
        "config.micro_batch: required field missing"
    )
    # `--set` of prepare goes through the same layer
    cfg = RelayConfig.from_dict(BASE)
    with pytest.raises(ConfigError, match=r"^--set: num_workers: expected int, got 'two'$"):
        cfg.with_dotted({"num_workers": "two"}, source="--set")
    # direct construction is checked too
    with pytest.raises(ConfigError, match=r"^config\.total_updates: expected int, got '10'$"):
        RelayConfig(seed=1, micro_batch=1, total_updates="10", manifest="m")  # type: ignore[arg-type]  # the bad input under test


def test_a_misspelt_field_gets_a_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        RelayConfig.from_dict({**BASE, "save_evry": 5})
    assert info.value.message == "config.save_evry: unknown field; did you mean 'save_every'?"
    assert "put your own hyper-parameters under 'params'" in (info.value.hint or "")
    assert _config_error({**BASE, "lr": 0.1, "wd": 0}) == "config.lr: unknown field (and 1 more: ['wd'])"
    assert _plan_error({**PLAN, "smoke": {"updatez": 3}}, tmp_path) == (
        "plan.smoke.updatez: unknown field; did you mean 'updates'?"
    )
    assert (
        _plan_error({**PLAN, "memroy": {}}, tmp_path) == "plan.memroy: unknown field; did you mean 'memory'?"
    )
    assert _plan_error({**PLAN, "smoke": {"when": "frist"}}, tmp_path) == (
        "plan.smoke.when: must be one of 'always', 'first', 'never', got 'frist'; did you mean 'first'?"
    )


def test_a_bool_is_never_an_int_nor_a_number(tmp_path: Path) -> None:
    assert _config_error({**BASE, "save_every": True}) == "config.save_every: expected int, got True"
    assert _config_error({**BASE, "async_save": 1}) == "config.async_save: expected true or false, got 1"
    assert _plan_error({**PLAN, "memory": {"poll_s": False}}, tmp_path) == (
        "plan.memory.poll_s: expected a number, got False"
    )
    assert (
        _plan_error({**PLAN, "slurm": {"nodes": True}}, tmp_path)
        == "plan.slurm.nodes: expected int, got True"
    )
    assert _plan_error({**PLAN, "train": {"script": "t.py", "srun": "yes"}}, tmp_path) == (
        "plan.train.srun: expected true or false, got 'yes'"
    )
    with pytest.raises(ConfigError, match=r"^prepare\.world_size: expected int or None, got True$"):
        PrepareOptions(run_dir=tmp_path, world_size=True)
    # what YAML means as text stays text: argv, env and a Slurm time
    plan = Plan.from_dict(
        {**PLAN, "train": {"script": "t.py", "args": ["--steps", 10], "env": {"N": 1}}}, tmp_path
    )
    assert plan.train.args == ["--steps", "10"] and plan.train.env == {"N": "1"}
    assert Plan.from_dict({**PLAN, "slurm": {"time": 90}}, tmp_path).slurm.time == "90"
    # ints are numbers; the value is kept as written (a recorded plan does not change)
    assert Plan.from_dict({**PLAN, "budget": {"margin_s": 5}}, tmp_path).to_dict()["budget"]["margin_s"] == 5


def test_runtime_only_is_field_metadata_and_batch_spec_extends_the_plans_slurm_section(
    tmp_path: Path,
) -> None:
    assert RUNTIME_FIELDS == (
        "manifest", "data_root", "num_workers", "save_every", "keep", "keep_every", "keep_updates",
        "memory_every", "memory_keep",
        "async_save", "external_files", "runtime_params", "strict_numerics", "strict_code", "save_tuning",
        "load_tuning",
    )  # fmt: skip
    cfg = RelayConfig.from_dict(BASE)
    assert (
        cfg.is_runtime("keep_every")
        and cfg.is_runtime("external_files.teacher")
        and not cfg.is_runtime("seed")
    )
    # the schema marks nothing about the contract: it describes the file; the metadata stays the one rule
    shared = {f for f in SlurmSpec.__dataclass_fields__}
    assert shared <= set(BatchSpec.__dataclass_fields__)
    spec = BatchSpec.from_request(
        SlurmSpec(time="2:00:00", extra=["--exclusive"]),
        plan_path=tmp_path,
        run_dir=tmp_path,
        workdir=tmp_path,
    )
    assert spec.time == "2:00:00" and spec.extra == ["--exclusive"] and spec.nodes == 1
    with pytest.raises(ConfigError, match=r"^sbatch\.nodes: must be >= 1, got 0$"):
        BatchSpec(plan_path=tmp_path, run_dir=tmp_path, workdir=tmp_path, nodes=0)
    _ = build_contract  # the contract drops RUNTIME_FIELDS (tests/test_after_training.py checks the effect)


def test_committed_schemas_are_the_generated_ones() -> None:
    for name, generated in schemas().items():
        committed = REPO / "docs" / "schema" / name
        assert committed.read_text() == render(generated), (
            f"{committed} is stale: run `python -m torchrelay.controller.schemas docs/schema`"
        )
    config = schemas()["relay-config.schema.json"]
    assert config["required"] == ["seed", "micro_batch", "total_updates", "manifest"]
    assert config["properties"]["keep"] == {"type": "integer", "minimum": 2, "default": 2}
    assert config["properties"]["sampler"]["enum"] == ["shuffled", "length_bucketed"]
    plan = schemas()["launch-plan.schema.json"]
    assert plan["properties"]["train"] == {"$ref": "#/$defs/TrainSpec"}
    assert plan["$defs"]["PreflightSpec"]["properties"]["checks"]["items"] == {"$ref": "#/$defs/CheckSpec"}
    assert plan["$defs"]["SmokeSpec"]["additionalProperties"] is False
    json.dumps(plan)  # plain JSON


def test_every_torchrelay_variable_is_declared_once_and_documented() -> None:
    names = [v.name for v in envvars.ALL]
    assert len(names) == len(set(names))
    used = set()
    for path in (REPO / "src" / "torchrelay").rglob("*.py"):
        if path.name == "envvars.py":
            continue  # the declarations themselves
        used |= set(re.findall(r"TORCHRELAY_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert used - set(names) == set(), "declare these in src/torchrelay/config/envvars.py"
    page = REPO / "docs" / "ENVIRONMENT.md"
    assert page.read_text() == envvars.markdown(), (
        f"{page} is stale: run `python -m torchrelay.config.envvars > docs/ENVIRONMENT.md`"
    )


def test_a_bad_variable_is_one_line_naming_it() -> None:
    cases = {
        envvars.LOCK_WAIT_S: ("soon", "TORCHRELAY_LOCK_WAIT_S='soon' is not a number"),
        envvars.CHECK_EVERY: ("6.5", "TORCHRELAY_CHECK_EVERY='6.5' is not an integer"),
        envvars.RESHARD: ("maybe", "TORCHRELAY_RESHARD='maybe' is not a flag (1 or 0)"),
        envvars.OVERRIDES: ("[1]", "TORCHRELAY_OVERRIDES='[1]' is not a JSON object"),
        envvars.PERSIST_STREAMS: ("many", "TORCHRELAY_PERSIST_STREAMS='many' is not an integer"),
        envvars.AUDIT_STREAMS_AT: (
            "3,x",
            "TORCHRELAY_AUDIT_STREAMS_AT='3,x' is not comma-separated integers",
        ),
    }
    for var, (text, message) in cases.items():
        with pytest.raises(ConfigError) as info:
            var.get({var.name: text})
        assert info.value.message == message and "\n" not in info.value.message
    assert envvars.RESHARD.get({"TORCHRELAY_RESHARD": "yes"}) is True
    assert (
        envvars.LOCK_WAIT_S.get({}) == 3.0 and envvars.LOCK_WAIT_S.get({"TORCHRELAY_LOCK_WAIT_S": " "}) == 3.0
    )
    assert envvars.AUDIT_STREAMS_AT.get({"TORCHRELAY_AUDIT_STREAMS_AT": "3, 7"}) == [3, 7]


def _import_time_reads(tree: ast.Module) -> list[int]:
    """Lines of module-level code (run at import: top level and class bodies, not functions) that read the
    environment: os.environ, os.getenv, or an envvars accessor."""
    found: list[int] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return  # runs when called, not at import
        if isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id == "os" and node.attr in ("environ", "getenv"):
                found.append(node.lineno)
            owner = base.value if isinstance(base, ast.Attribute) else None
            if (
                node.attr in ("get", "text", "is_set")
                and isinstance(owner, ast.Name)
                and owner.id == "envvars"
            ):
                found.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_variable_is_read_at_import_time() -> None:
    # A library user's `import` never fails on the environment: a bad value is refused when it is used, by name.
    # (The audit's sitecustomize is the exception by design: it runs inside the audited script to install the probe.)
    wrong = []
    for path in sorted((REPO / "src" / "torchrelay").rglob("*.py")):
        if "_site" in path.parts or path.name == "envvars.py":
            continue
        wrong += [
            f"{path.relative_to(REPO)}:{line}" for line in _import_time_reads(ast.parse(path.read_text()))
        ]
    assert wrong == []
    # the check sees what it must: the read that opening.py made at import until this layer
    assert _import_time_reads(ast.parse('import os\nLOCK_WAIT_S = float(os.environ.get("X", "3"))\n')) == [2]
    assert _import_time_reads(ast.parse("class A:\n    x = envvars.RUN_DIR.text()\n")) == [2]
    assert _import_time_reads(ast.parse("def f():\n    return envvars.RUN_DIR.text()\n")) == []


def test_the_command_line_options_are_the_options_dataclasses_fields(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    prepare_cli.add_arguments(parser)
    args = parser.parse_args(["b", "--run-dir", str(tmp_path), "--world-size", "2", "--check-files"])
    options = schema.from_namespace(PrepareOptions, args, sets={})
    assert options == PrepareOptions(run_dir=tmp_path, world_size=2, check_files=True)
    defaults = schema.from_namespace(PrepareOptions, parser.parse_args(["b", "--run-dir", str(tmp_path)]))
    assert defaults == PrepareOptions(run_dir=tmp_path)  # every default is the dataclass's own
    with pytest.raises(ConfigError, match=r"^prepare\.micro_batch: must be >= 1, got 0$"):
        schema.from_namespace(
            PrepareOptions, parser.parse_args(["b", "--run-dir", "r", "--micro-batch", "0"])
        )
    pack_parser = argparse.ArgumentParser()
    pack_cli.add_arguments(pack_parser)
    packed = schema.from_namespace(PackOptions, pack_parser.parse_args(["r", "b", "--link", "--sign", "k"]))
    assert packed == PackOptions(link=True, sign=Path("k"))
    assert "KEYFILE" in pack_parser.format_help() and "--allow-dirty" in pack_parser.format_help()
