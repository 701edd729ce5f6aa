"""Hugging Face Trainer as a torchrelay run (examples/train_hf_trainer.py, 2 ranks under torchrun on CPU).

`torchrelay audit` launches the example unchanged, stops it early and late with another worker count and finds it
equal bit for bit; its uninterrupted run is the reference of the rest. Stopped by a request, killed inside a save,
stopped by a signal late in the schedule and by a budget, packed, verified, prepared elsewhere and finished there,
with the loader's worker count changed along the way: it ends bit for bit where the uninterrupted run ends, every
sample seen exactly once. A changed learning rate is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    REPO,
    TORCHRUN,
    assert_same_final_state,
    assert_same_logs,
    clean_env,
    exposures,
    make_code_repo,
    make_data,
    run_tree,
    segments,
    sigterm,
    wait_for_update,
)
from torchrelay.audit import RNG, verdict_for_run
from torchrelay.audit.compare import load_checkpoint_tensors
from torchrelay.audit.values import rng_tensors
from torchrelay.cli import main
from torchrelay.ledger.exposure import prove

U = 12  # the example's max_steps: 8 updates an epoch, so the schedule crosses into epoch 1
# the example, its updates paced by TRAINER_PACE_S (a signal must land before the run ends)
SCRIPT = "trainer_paced.py"


def _cmd(code: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / SCRIPT),
        "--output-dir",
        str(run_dir),
        *extra,
    ]


def _launch(code: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    out = run_tree(_cmd(code, run_dir, *extra), timeout=300, env=clean_env(**(env or {})), cwd=code)
    return out.returncode, out.stdout + out.stderr


def _workers_started(out: str) -> list[str]:
    """Each rank's line saying how its loader workers started (run/loop.py), rank by rank."""
    return sorted(line for line in out.splitlines() if "] LOADER_WORKERS " in line)


# A torchrun rank holds gloo's native threads and no other Python thread: its workers are forked, as Trainer's own.
FORKED = ["[rank 0] LOADER_WORKERS 2 fork", "[rank 1] LOADER_WORKERS 2 fork"]


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("trainer-code") / "code"
    dest.mkdir()
    shutil.copyfile(REPO / "tests" / SCRIPT, dest / SCRIPT)
    return make_code_repo(dest, scripts=("train_hf_trainer.py", "broken/trainer_weight_noise.py"))


def _audit(code: Path, script: str, work: Path, *options: str) -> tuple[int, dict[str, Any]]:
    """`torchrelay audit OPTIONS -- torchrun ... SCRIPT --output-dir W/output-dir` in the code repo: exit code, verdict."""
    launch = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--monitor_interval=0.5"]
    launch += [str(code / script), "--output-dir", str(work / "output-dir")]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(out):
        for key in [k for k in os.environ if k.startswith(("TORCHRELAY_", "SLURM_"))]:
            env.delenv(key)
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("XDG_CACHE_HOME", str(work / "cache"))  # the kept verdicts, out of the real ~/.cache
        env.chdir(code)
        rc = main(["audit", *options, "--work-dir", str(work / "audit"), "--json", "--", *launch])
    return rc, json.loads(out.getvalue())


@pytest.fixture(scope="module")
def audited(code: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """`torchrelay audit` of the example as it is (its own file, its own command line): the verdict and its work dir."""
    work = tmp_path_factory.mktemp("trainer-audit")
    rc, verdict = _audit(
        code, "train_hf_trainer.py", work, "--updates", str(U), "--stops", "2", "--vary", "num_workers=0,2"
    )
    assert rc == 0, verdict
    return verdict, work


@pytest.fixture(scope="module")
def baseline(audited: tuple[dict[str, Any], Path]) -> Path:
    """The audit's uninterrupted run: the example launched once, all 12 updates."""
    run = audited[1] / "audit" / "uninterrupted"
    log = (audited[1] / "audit" / "logs" / "uninterrupted-segment1.log").read_text()
    assert "SCHEDULE_GATE_PASS (12, 2)" in log and "TRAINING_CONTRACT" in log
    assert [(s["first_update"], s["last_update"], s["ended"]) for s in segments(run)] == [(1, U, "finished")]
    assert (run / "final" / "model.safetensors").is_file()  # save_model() of a finished run
    return run


@pytest.mark.launch
def test_audit_of_the_unchanged_example_is_equal(code: Path, audited: tuple[dict[str, Any], Path]) -> None:
    verdict, work = audited
    example = (REPO / "examples" / "train_hf_trainer.py").read_bytes()
    assert (code / "train_hf_trainer.py").read_bytes() == example  # the example as it is in the repo ...
    assert verdict["script_sha256"] == hashlib.sha256(example).hexdigest()  # ... is what the audit ran
    assert verdict["equal"] is True and verdict["causes"] == [], verdict
    # Stopped after the first update and in the next epoch (8 updates an epoch), 2 loader workers in between.
    assert verdict["stops"] == [1, 11] and verdict["vary"] == {"num_workers": [0, 2]}
    interrupted = work / "audit" / "interrupted"
    history = segments(interrupted)
    assert [(s["first_update"], s["last_update"], s["ended"]) for s in history] == [
        (1, 1, "request"),
        (2, 11, "request"),
        (12, U, "finished"),
    ]
    assert [(s.get("runtime_changes") or {}).get("num_workers") for s in history] == [None, [0, 2], [2, 0]]
    # The evidence: every model and optimizer tensor, bit for bit, at the checkpoint right after each resume.
    names = set(load_checkpoint_tensors(interrupted / "checkpoint-2"))
    params = {n.removeprefix("model.") for n in names if n.startswith("model.")}
    moments = {
        f"optim.{p}.{s}" for p in params - {"lm_head.weight"} for s in ("exp_avg", "exp_avg_sq", "step")
    }
    assert len(params) == 17 and names == {f"model.{p}" for p in params} | moments  # lm_head is tied to wte
    # ... and each rank's generator states (python, numpy, torch CPU: audit/values.py)
    compared = len(names) + len(rng_tensors(interrupted / "checkpoint-2"))
    assert compared == len(names) + 6 and verdict["values_compared"] > 20  # the scheduler's, param groups'
    assert [
        (c["update"], c["after_stop"], c["compared"], c["differing"]) for c in verdict["checkpoints"]
    ] == [
        (2, 1, compared, 0),
        (U, 11, compared, 0),
    ]
    assert verdict["tensors_equal"] and verdict["metrics_equal"] and verdict["ledger_equal"]
    # The audit gave each run its own directory (TORCHRELAY_RUN_DIR wins over --output-dir) and kept the verdict.
    assert not (work / "output-dir").exists()
    shown = verdict_for_run(interrupted)
    assert shown is not None and shown["verdict"].startswith("equal (12 updates, 2 stops)"), shown


@pytest.mark.launch
def test_audit_names_a_trainer_callbacks_own_generator(code: Path, tmp_path: Path) -> None:
    # The example plus a callback whose generator no checkpoint holds: the audit finds it, with one stop.
    rc, verdict = _audit(code, "broken/trainer_weight_noise.py", tmp_path, "--updates", "2", "--stop-at", "1")
    assert rc == 1 and verdict["equal"] is False, verdict
    assert [c["name"] for c in verdict["causes"]] == [RNG], verdict["causes"]
    evidence = verdict["causes"][0]["evidence"]
    assert (
        "random stream(s) the script holds (torch.Generator) start update 2 in another state" in evidence
    ), evidence
    # Parted at the first update after the resume: its loss, and the weights the noise was added to.
    assert verdict["metrics_first_update"] == 2 and "loss" in verdict["metrics_keys"]
    (point,) = verdict["checkpoints"]
    assert point["update"] == 2 and point["after_stop"] == 1 and point["differing"] > 0
    assert all(t["name"].startswith("model.") and t["max_abs"] > 0 for t in verdict["top_tensors"])
    assert "uninterrupted-again" not in verdict["run_dirs"]  # the probe's evidence sufficed


@pytest.mark.launch
def test_trainer_stopped_killed_handed_off_ends_bit_exact(code: Path, baseline: Path, tmp_path: Path) -> None:
    import subprocess

    run = tmp_path / "run"
    run.mkdir()
    # 1. a request file, honoured after update 3
    main(["stop", str(run), "--at-update", "3", "--before-start"])
    rc, out = _launch(code, run)
    assert rc != 0 and "exitcode  : 4" in out, out
    assert segments(run)[-1]["ended"] == "request" and segments(run)[-1]["last_update"] == 3
    assert not (run / "final").exists()  # save_model() of a stopped run writes nothing
    # 2. rank 0 SIGKILLed inside the save of checkpoint-4 (its inventory written, not yet renamed), 2 loader workers
    rc, out = _launch(code, run, "--workers", "2", "--kill-at", "rename:4:0")
    assert rc != 0, out
    assert _workers_started(out) == FORKED, out
    assert not (run / "checkpoint-4").exists() and list(run.glob(".tmp-checkpoint-4-*")), out
    # 3. SIGTERM late in the schedule (after update 8 of 12): resumes from checkpoint-3, the previous complete one
    proc = subprocess.Popen(
        _cmd(code, run, "--workers", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(TRAINER_PACE_S="0.3", TORCHRELAY_CHECK_EVERY="1"),
        cwd=code,
        start_new_session=True,
    )
    wait_for_update(run, 8, proc)
    sigterm(proc)
    proc.wait(timeout=120)
    said = proc.stdout.read() if proc.stdout else ""
    seg = segments(run)[-1]
    assert seg["ended"] == "signal", said
    assert _workers_started(said) == FORKED, said
    assert seg["resumed_from"] == 3 and 8 <= seg["last_update"] < U, seg
    assert [s["ended"] for s in segments(run)] == ["request", "crash", "signal"]
    assert segments(run)[1]["runtime_changes"] == {"num_workers": [0, 2]}  # recorded by the killed launch
    assert not list(run.glob(".tmp-checkpoint-*"))  # the killed save's leftovers were removed at the open
    stopped = seg["last_update"]
    # 4. a time budget that no update fits in: stops at the first boundary, nothing to save
    rc, out = _launch(code, run, env={"TORCHRELAY_BUDGET_S": "0.5"})
    assert segments(run)[-1]["ended"] == "budget" and segments(run)[-1]["last_update"] == stopped, out
    assert main(["status", str(run), "--last-exit"]) == 3
    # 5. packed, verified, prepared into another directory, and finished there
    bundle = tmp_path / "bundle"
    assert main(["pack", str(run), str(bundle)]) == 0
    assert main(["verify", str(bundle)]) == 0
    there = tmp_path / "elsewhere" / "run"
    assert main(["prepare", str(bundle), "--run-dir", str(there)]) == 0
    moved = next((there / "source").iterdir())
    rc, out = _launch(moved, there)
    assert rc == 0, out
    assert segments(there)[-1]["resumed_from"] == stopped

    assert assert_same_final_state(baseline, there, U) > 20  # every parameter and optimizer tensor
    assert_same_logs(baseline, there)  # per-rank metrics (loss, lr, grad_norm) and exposures
    ledger = prove(there)
    # 12 updates of 8 samples from a 64-sample set: one epoch whole, half of the next, no sample twice in one
    assert ledger.ok and ledger.exposures == U * 8 and ledger.distinct == 64 and ledger.repeats == 0
    # The same contract but for the program: this chain ran the example through its paced wrapper
    ours = json.loads((there / "resume_contract.json").read_text())["fields"]
    theirs = json.loads((baseline / "resume_contract.json").read_text())["fields"]
    assert {k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)} == {"code.program"}
    assert ours["code.program"] == [*theirs["code.program"], SCRIPT]


@pytest.mark.launch
def test_trainer_refuses_a_changed_learning_rate(code: Path, baseline: Path) -> None:
    rc, out = _launch(code, baseline, "--lr", "0.002")
    assert rc != 0 and "exitcode  : 2" in out, out
    assert "params.training_args.learning_rate: 0.001 -> 0.002" in out, out
    assert segments(baseline)[-1]["ended"] == "refused"
    assert main(["status", str(baseline), "--last-exit"]) == 2


@pytest.mark.parametrize(
    ("example", "section"),
    [
        ("train_hf_trainer.py", "TRAINER.md"),
        ("train_hf_trainer_deepspeed.py", "DEEPSPEED.md"),
    ],
)
def test_the_guide_shows_the_example_file(example: str, section: str) -> None:
    body = (REPO / "examples" / example).read_text()
    shown = (REPO / "docs" / section).read_text()
    assert body[body.index("import argparse") :] in shown, (
        f"copy examples/{example} (from `import argparse`) into docs/{section}"
    )


def test_trainer_runtime_and_contract_arguments() -> None:
    from transformers import TrainingArguments

    from torchrelay.integrations.hf_contract import math_args

    a = TrainingArguments(output_dir="/a", use_cpu=True, report_to="none", dataloader_num_workers=0)
    b = TrainingArguments(
        output_dir="/b", use_cpu=True, report_to="none", dataloader_num_workers=8, logging_steps=3
    )
    assert math_args(a) == math_args(b)  # paths, workers, reporting and logging are runtime-only
    c = TrainingArguments(output_dir="/a", use_cpu=True, report_to="none", per_device_train_batch_size=3)
    assert {k for k in math_args(a) if math_args(a)[k] != math_args(c)[k]} == {"per_device_train_batch_size"}


def test_a_subclass_adds_its_own_state_to_what_relay_track_registers() -> None:
    """The fix examples/broken/trainer_weight_noise.py names: relay_track(**statefuls) keeps model, optimizer and
    scheduler and adds the subclass's state (Run.track registers once: a second call would replace the first)."""
    import torch

    from torchrelay.integrations.transformers import RelayTrainerMixin

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    noise = torch.Generator().manual_seed(7)
    registered: list[dict[str, Any]] = []

    class Run:  # what relay_track calls on the open run
        def track(self, **kwargs: Any) -> None:
            registered.append(kwargs)

    class NoisyTrainer(RelayTrainerMixin):
        def relay_track(self, **statefuls: Any) -> None:
            super().relay_track(noise=noise, **statefuls)

    trainer = NoisyTrainer.__new__(NoisyTrainer)  # Trainer's own __init__ is not needed for this hook
    trainer.relay, trainer.model_wrapped, trainer.optimizer, trainer.lr_scheduler = Run(), model, opt, sched  # type: ignore[assignment]
    trainer.relay_track()
    assert registered == [{"model": model, "optimizer": opt, "scheduler": sched, "noise": noise}]


# ---------------------------------------------------------------------------------------------- over a manifest
MANIFEST_SCRIPT = "train_hf_trainer_manifest.py"
MU = 8  # that example's max_steps


def _launch_manifest(code: Path, run_dir: Path, root: Path, manifest: Path, *extra: str) -> tuple[int, str]:
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--monitor_interval=0.5",
        str(code / MANIFEST_SCRIPT),
    ]
    cmd += ["--output-dir", str(run_dir), "--manifest", str(manifest), "--data-root", str(root), *extra]
    out = run_tree(cmd, timeout=300, env=clean_env(), cwd=code)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.launch
def test_trainer_over_a_manifest_in_length_order_moved_rebased_and_resumed(tmp_path: Path) -> None:
    """RelayOptions(manifest, data_root, dataset, sampler='length_bucketed'): the manifest's fingerprint is the
    contract, `prepare --set data_root --check-files` moves the data (the old root and manifest gone), the script
    resumes unchanged with 2 loader workers, and ends bit for bit where the uninterrupted run ends, in the
    length-bucketed order, every sample once."""
    from torchrelay.data.order import GlobalOrder
    from torchrelay.manifest import Manifest

    code = make_code_repo(tmp_path / "code", scripts=(MANIFEST_SCRIPT,))
    root, manifest = make_data(tmp_path / "old", files=1, max_bytes=96)
    ref = tmp_path / "ref"
    rc, out = _launch_manifest(code, ref, root, manifest)
    assert rc == 0, out
    run = tmp_path / "run"
    run.mkdir()
    main(["stop", str(run), "--at-update", "3", "--before-start"])
    rc, out = _launch_manifest(code, run, root, manifest)
    assert rc != 0 and "exitcode  : 4" in out, out
    fields = json.loads((run / "resume_contract.json").read_text())["fields"]
    source = Manifest.load(manifest, str(root))
    assert fields["data.fingerprint"] == source.fingerprint() and fields["data.samples"] == len(source)
    bundle = tmp_path / "bundle"
    assert main(["pack", str(run), str(bundle)]) == 0
    assert main(["verify", str(bundle)]) == 0
    # the data moves to another root; the old root and the script's manifest are gone
    new_root = tmp_path / "cluster2" / "root"
    new_root.parent.mkdir()
    shutil.move(str(root), str(new_root))
    manifest.unlink()
    there = tmp_path / "cluster2" / "run"
    prepare = [
        "prepare",
        str(bundle),
        "--run-dir",
        str(there),
        "--set",
        f"data_root={new_root}",
        "--check-files",
    ]
    victim = next(new_root.iterdir())
    victim.rename(victim.with_suffix(".away"))
    assert main(prepare) != 0 and not there.exists()  # --check-files: a file the manifest names is missing
    victim.with_suffix(".away").rename(victim)
    assert main(prepare) == 0
    record = json.loads((there / "REBASE_RECORD.json").read_text())
    assert record["changes"]["data_root"] == [str(root), str(new_root)]
    assert str(new_root) in (there / "data/manifest.jsonl").read_text()
    moved = next((there / "source").iterdir())
    rc, out = _launch_manifest(moved, there, root, manifest, "--workers", "2")  # the script's old paths
    assert rc == 0, out
    assert _workers_started(out) == FORKED, out
    assert f"kept data_root={str(new_root)!r} set by prepare" in out, out
    assert segments(there)[-1]["resumed_from"] == 3
    assert json.loads((there / "resume_contract.json").read_text()) == json.loads(
        (ref / "resume_contract.json").read_text()
    )

    assert assert_same_final_state(ref, there, MU) > 20
    assert_same_logs(ref, there)
    ledger = prove(there)
    assert ledger.ok and ledger.exposures == ledger.distinct == MU * 8
    # the order: global batches of similar `length` (runs of 4 batches sorted longest first), as the plain loop's
    rebased = Manifest.load(there / "data/manifest.jsonl", str(new_root))
    order = GlobalOrder(len(rebased), 1234, 8, "length_bucketed", rebased.lengths(), 4)
    logged = [json.loads(x) for r in (0, 1) for x in exposures(there, r)]
    by_slot = {
        (e["u"], e["m"], r): e["i"] for r in (0, 1) for e in (json.loads(x) for x in exposures(there, r))
    }
    assert len(logged) == MU * 2 * 2
    assert by_slot == {
        (u, m, r): order.slot(u - 1, m, r, 2, 2) for u in range(1, MU + 1) for m in (0, 1) for r in (0, 1)
    }
    lengths = rebased.lengths()
    assert any(len({int(lengths[i]) for i in order.global_batch_indices(u)}) < 8 for u in range(MU))


def test_trainer_options_refuse_what_needs_a_manifest() -> None:
    from transformers import TrainingArguments

    from torchrelay.errors import ConfigError
    from torchrelay.integrations.hf_contract import RelayOptions, check_supported

    with pytest.raises(
        ConfigError, match=r"RelayOptions.sampler='length_bucketed' needs RelayOptions.manifest"
    ):
        RelayOptions(sampler="length_bucketed")
    with pytest.raises(ConfigError, match="RelayOptions.data_root needs RelayOptions.manifest"):
        RelayOptions(data_root="/data")
    with pytest.raises(ConfigError, match="RelayOptions.sampler must be one of"):
        RelayOptions(manifest="m.jsonl", sampler="by_length")
    args = TrainingArguments(
        output_dir="/a", use_cpu=True, report_to="none", train_sampling_strategy="group_by_length"
    )
    with pytest.raises(ConfigError, match="group_by_length") as info:
        check_supported(args, [1, 2], manifest=False)
    assert "sampler='length_bucketed'" in (info.value.hint or "")


@pytest.mark.full  # a fresh interpreter importing transformers: 20 s on a busy machine
def test_the_forkserver_preloads_what_a_trainer_script_imports(tmp_path: Path) -> None:
    """A forkserver's workers import the script, and with it transformers, each one: the server imports the
    script's top-level imports once instead (data/loader.py script_imports), the modules `from X import name`
    resolves lazily among them; nothing the script did not import itself."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import json\n"
        "import torch\n"
        "from transformers import GPT2Config, TrainingArguments\n"
        "from torchrelay.data.loader import script_imports\n"
        "if __name__ == '__main__':\n"
        "    import numpy.polynomial\n"  # under the guard: not run by a worker, not preloaded
        "    print(json.dumps(script_imports()))\n"
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=clean_env(), timeout=600
    )
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"json", "torch", "transformers", "torchrelay.data.loader"} <= set(names), names
    assert "transformers.models.gpt2.configuration_gpt2" in names and "transformers.training_args" in names
    assert "numpy.polynomial" not in names and "__main__" not in names


def test_relay_options_turn_the_memory_tier_on() -> None:
    """RelayOptions(memory_every, memory_keep) reach the run's config (TrainingArguments has no such field; before,
    only TORCHRELAY_OVERRIDES turned the tier on for a Trainer run); a bad value is refused naming the field."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from torchrelay.errors import ConfigError
    from torchrelay.integrations.hf_contract import RelayOptions, relay_config

    args = TrainingArguments(output_dir="/a", use_cpu=True, report_to="none", max_steps=4, save_steps=2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))

    def config(**options: Any) -> Any:
        given = RelayOptions(dataset_fingerprint="d", **options)
        return relay_config(args, model, list(range(16)), given, 1, "manifest.jsonl")

    cfg = config(memory_every=1, memory_keep=2)
    assert (cfg.memory_every, cfg.memory_keep, cfg.save_every) == (1, 2, 2)
    assert (config().memory_every, config().memory_keep) == (0, 1)  # off unless asked for
    assert cfg.is_runtime("memory_every") and cfg.is_runtime("memory_keep")
    with pytest.raises(ConfigError, match="memory_keep"):
        config(memory_every=1, memory_keep=0)
