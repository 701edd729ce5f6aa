"""Each segment records the numerics it ran with; a resume under other numerics is warned, recorded and shown, or
refused with strict_numerics; prepare warns on a machine of other numerics (docs/NUMERICS.md).

The other numerics are real: the later segments run under ATEN_CPU_CAPABILITY, which changes the kernels torch
dispatches (on an AVX-512 machine, 47 of the example's 68 tensors end differently under AVX2).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import clean_env, launch, segments
from torchrelay.cli import main
from torchrelay.handoff.pack import PackOptions, pack
from torchrelay.paths.layout import PREPARE_RECORD
from torchrelay.policy.stop import write_request

HERE = (
    torch.backends.cpu.get_cpu_capability()
)  # what torch dispatches in this process (and the first segment)
# Another capability this processor runs: AVX2 where torch picks something else, else the portable kernels.
OTHER = ("avx2", "AVX2") if HERE != "AVX2" else ("default", "DEFAULT")


@pytest.fixture(scope="module")
def moved(example: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run on 2 ranks: updates 1-4 here; a strict launch under OTHER (refused); updates 5-6 under OTHER."""
    run = tmp_path_factory.mktemp("numerics") / "run"
    run.mkdir()
    code, config = example["code"], example["config"]
    write_request(run, at_update=4)
    first = launch(code, run, config=config, sets={"save_every": 2})
    assert segments(run)[-1]["last_update"] == 4, first.stdout + first.stderr
    other = {"ATEN_CPU_CAPABILITY": OTHER[0]}
    strict = launch(code, run, env=other, sets={"strict_numerics": True})
    write_request(run, at_update=6)
    warned = launch(code, run, env=other)
    assert segments(run)[-1]["last_update"] == 6, warned.stdout + warned.stderr
    return {"run": run, "code": code, "strict": strict, "warned": warned}


@pytest.mark.launch
def test_a_resume_under_other_numerics_is_warned_recorded_and_shown(
    moved: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run = moved["run"]
    first, refused, third = segments(run)
    assert first["numerics"]["cpu.capability"] == HERE and "numerics_change" not in first
    assert third["numerics"]["cpu.capability"] == OTHER[1]
    line = f"bit-for-bit comparison with segment 1 is not expected: another CPU capability, {OTHER[1]} instead of {HERE}"
    assert f"[torchrelay] warning: {line}\n" in moved["warned"].stderr  # one line, at the resume
    assert third["numerics_change"] == {
        "segments": [1],
        "fields": {"cpu.capability": [HERE, OTHER[1]]},
        "line": line,
    }
    assert line in third["notes"]
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "400")  # rich's width: each row on one line
    assert main(["status", str(run)]) == 0
    shown = capsys.readouterr().out
    assert f"\nsegment #3: numerics changed: {line}\n" in shown
    row = next(r for r in shown.splitlines() if r.startswith("│ numerics "))
    assert (
        f", {OTHER[1]}, " in row
        and "(2 identities across the segments: bit-for-bit comparison holds only" in row
    )
    assert main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["segments"][2]["numerics_change"]["fields"] == {
        "cpu.capability": [HERE, OTHER[1]]
    }


@pytest.mark.launch
def test_strict_numerics_refuses_naming_the_field_and_loses_nothing(moved: dict[str, Any]) -> None:
    run, out = moved["run"], moved["strict"]
    refused = segments(run)[1]
    assert (refused["ended"], refused["exit_code"]) == ("refused", 2)
    told = [line for line in out.stderr.splitlines() if "strict_numerics" in line and "refused" in line]
    assert told and told[0].endswith(
        f"resume refused (strict_numerics): the numerics differ from segment 1 in cpu.capability: "
        f"another CPU capability, {OTHER[1]} instead of {HERE}"
    ), out.stderr
    assert refused["notes"][0].startswith("resume refused (strict_numerics)")
    # Nothing was trimmed or rewritten: the next launch resumed from checkpoint-4 with updates 1-4 logged.
    assert segments(run)[2]["resumed_from"] == 4 and segments(run)[2]["first_update"] == 5


@pytest.mark.launch
def test_prepare_warns_on_a_machine_of_other_numerics(
    moved: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bundle = tmp_path / "bundle"
    pack(moved["run"], bundle, PackOptions(code_dir=moved["code"]))  # its last segment ran under OTHER
    caplog.set_level(logging.INFO, logger="torchrelay")
    assert main(["prepare", str(bundle), "--run-dir", str(tmp_path / "prepared")]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "[torchrelay] warning: on this machine, bit-for-bit comparison with segment 3 is not expected: "
        f"another CPU capability, {HERE} instead of {OTHER[1]}"
    ) in warned
    record = json.loads((tmp_path / "prepared" / PREPARE_RECORD).read_text())
    assert record["numerics"]["change"]["segments"] == [3]
    assert record["numerics"]["here"]["cpu.capability"] == HERE


def test_the_identity_names_what_decides_the_bits() -> None:
    from torchrelay.identity import numerics

    here = numerics.gather()
    assert here["cpu.capability"] == HERE and here["torch"] == torch.__version__
    assert here["cpu.threads"] == torch.get_num_threads() and here["deterministic"] is False
    assert (here["cuda"] is not None) == torch.cuda.is_available()
    # ATEN_CPU_CAPABILITY changes what torch dispatches, and the identity says so
    probe = "import json; from torchrelay.identity.numerics import gather; print(json.dumps(gather()))"
    env = clean_env(ATEN_CPU_CAPABILITY=OTHER[0])
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    there = json.loads(out.stdout)
    assert numerics.differences(here, there, skip={"cpu.threads"}) == {"cpu.capability": [HERE, OTHER[1]]}
    assert numerics.fingerprint(here) != numerics.fingerprint(there)
    assert f", {HERE}, " in numerics.describe(here) and numerics.fingerprint(here) in numerics.describe(here)


def test_the_comparison_with_history() -> None:
    from torchrelay.identity import numerics

    a = {"cpu.capability": "AVX2", "torch": "2.13.0"}
    b = {"cpu.capability": "AVX512", "torch": "2.13.0"}
    history = [
        {"first_update": 1, "ended": "request", "numerics": a},
        {"first_update": 5, "ended": "refused", "numerics": b},  # ran nothing
        {"first_update": 5, "ended": "signal", "numerics": a},
        {"first_update": 9, "ended": "crash"},  # written before the field existed
        {"first_update": 13, "ended": "signal", "numerics": a},  # past the checkpoint resumed: rolled back
    ]
    found = numerics.compare_with_history(history, b, upto=12)
    assert found == {
        "segments": [1, 3],
        "unknown": [4],
        "fields": {"cpu.capability": ["AVX2", "AVX512"]},
        "line": "bit-for-bit comparison with segments 1, 3 is not expected: another CPU capability, AVX512 "
        "instead of AVX2; segment 4 recorded no numerics identity (written before torchrelay did)",
    }
    assert numerics.compare_with_history(history, a, upto=8)["line"] == ""  # type: ignore[index]
    assert numerics.compare_with_history(history, a, upto=0) is None
    assert numerics.segment_list([1, 2, 3, 5]) == "segments 1-3, 5"
    # prepare leaves the program's settings, and a GPU it cannot see, to the launch
    gpu = {**b, "cuda": "12.8", "gpu.model": "H200", "cpu.threads": 8}
    assert numerics.compare_here([{"first_update": 1, "numerics": gpu}], b, upto=4)["segments"] == []  # type: ignore[index]


def test_strict_numerics_is_a_runtime_field() -> None:
    from torchrelay.config.relay import RelayConfig
    from torchrelay.errors import ConfigError

    cfg = RelayConfig(seed=0, micro_batch=1, total_updates=2, manifest="m.jsonl")
    assert cfg.strict_numerics is False and cfg.is_runtime("strict_numerics")
    with pytest.raises(ConfigError, match=r"^config\.strict_numerics: expected true or false, got 'yes'$"):
        cfg.replace(strict_numerics="yes")


def test_the_audit_says_which_identity_its_verdict_holds_for() -> None:
    from torchrelay.audit.verdict import Verdict, describe
    from torchrelay.identity import numerics

    here = numerics.gather()
    there = {**here, "cpu.capability": "AVX2" if here["cpu.capability"] != "AVX2" else "AVX512"}
    one = Verdict(
        equal=True, launch=["x"], script=None, script_sha256=None, updates=4, stops=[2], numerics=[here]
    )
    assert one.summary() == (
        f"equal: 4 updates, 1 stop(s), bit for bit; holds for numerics identity {numerics.fingerprint(here)} only "
        f"({numerics.describe(here)})"
    )
    two = Verdict(
        equal=True,
        launch=["x"],
        script=None,
        script_sha256=None,
        updates=4,
        stops=[2],
        numerics=[here, there],
    )
    assert "ran with 2 numerics identities" in two.summary() and "holds for" in describe(one.to_dict())
