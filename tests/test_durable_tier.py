"""A run's durable tier in a real S3-compatible store (SeaweedFS, tests/s3_server.py; TORCHRELAY_DURABLE): each
committed checkpoint copied with its inventory object last, retention in the store only after a newer commit, one
writer per prefix, and a resume that lacks the newest checkpoint downloading it verified. The launch test
SIGKILLs a real 2-rank job while its sync process is uploading, loses the local checkpoints, and ends bit for bit
with the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import boto3
import pytest

from helpers import assert_same_final_state, assert_same_logs, segments
from s3_server import S3Server
from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.errors import ForkRefused, IntegrityError
from torchrelay.paths.rundir import RunDir
from torchrelay.storage import durable
from torchrelay.storage.url import parse_url

pytestmark = pytest.mark.s3


def _keys(bucket: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _run(base: Path, checkpoints: list[int]) -> Path:
    from scale_run import make_run

    return make_run(
        base, samples=2048, updates=6, ranks=1, micro=4, checkpoints=checkpoints, segment_updates=6
    )


def test_sync_commits_last_keeps_one_writer_and_restores_verified(tmp_path: Path, s3_bucket: str) -> None:
    run = _run(tmp_path / "a", [2, 4, 6])
    url = parse_url(f"s3://{s3_bucket}/tier")
    local = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))  # what retention kept
    assert len(local) >= 2 and local[-1] == 6, local
    notes = durable.sync(RunDir(run), url)
    assert notes == [f"checkpoint-{u} copied to {url}" for u in local]
    keys = _keys(s3_bucket, "tier/")
    assert "tier/WRITER.json" in keys and all(f"tier/checkpoint-{u}/{INVENTORY}" in keys for u in local)
    assert durable.sync(RunDir(run), url) == [], "nothing new"

    # local retention dropped the older one: the store follows, since checkpoint-6 is committed there
    old = local[-2]
    shutil.rmtree(run / f"checkpoint-{old}")
    assert durable.sync(RunDir(run), url) == [
        f"checkpoint-{old} removed from {url} (checkpoint-6 is committed there)"
    ]
    assert not [k for k in _keys(s3_bucket, "tier/") if k.startswith(f"tier/checkpoint-{old}/")]

    # a second run into the same prefix is refused, never interleaved
    other = _run(tmp_path / "b", [2])
    with pytest.raises(ForkRefused, match="durable tier of another run"):
        durable.sync(RunDir(other), url)

    # the local checkpoints lost: the resume's restore downloads the newest, verified, into place
    saved = {p.name: p.read_bytes() for p in (run / "checkpoint-6").iterdir() if p.is_file()}
    for ckpt in run.glob("checkpoint-*"):
        shutil.rmtree(ckpt)
    assert durable.restore(RunDir(run), url) == f"checkpoint-6 restored from {url}, verified part by part"
    assert {p.name: p.read_bytes() for p in (run / "checkpoint-6").iterdir() if p.is_file()} == saved
    assert durable.restore(RunDir(run), url) is None, "nothing to do once the newest is here"

    # an object of the store's newest changed: the restore refuses it and leaves nothing behind
    shutil.rmtree(run / "checkpoint-6")
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    victim = next(k for k in _keys(s3_bucket, "tier/checkpoint-6/") if not k.endswith(INVENTORY))
    body = bytearray(s3.get_object(Bucket=s3_bucket, Key=victim)["Body"].read())
    body[len(body) // 2] ^= 1
    s3.put_object(Bucket=s3_bucket, Key=victim, Body=bytes(body))
    with pytest.raises(IntegrityError, match="was not restored"):
        durable.restore(RunDir(run), url)
    assert not (run / "checkpoint-6").exists() and not list(run.glob(".checkpoint-6.restore-tmp"))


def test_an_uncommitted_upload_is_ignored_and_removed_after_a_newer_commit(
    tmp_path: Path, s3_bucket: str
) -> None:
    """Prefixes without COMPLETE.json (syncs killed mid-upload) are no checkpoints: a restore ignores them; one
    older than a commit is removed by the sync that commits, a newer one (an upload maybe in flight) is left."""
    run = _run(tmp_path, [6])
    url = parse_url(f"s3://{s3_bucket}/half")
    s3 = boto3.client("s3", endpoint_url=os.environ["TORCHRELAY_S3_ENDPOINT"])
    for update in (2, 8):
        s3.put_object(Bucket=s3_bucket, Key=f"half/checkpoint-{update}/stray.distcp", Body=b"a killed upload")
    assert durable.restore(RunDir(run), url) is None, "nothing is committed in the store"
    durable.sync(RunDir(run), url)
    keys = _keys(s3_bucket, "half/")
    assert f"half/checkpoint-6/{INVENTORY}" in keys
    assert not [k for k in keys if "checkpoint-2/" in k] and "half/checkpoint-8/stray.distcp" in keys
    # a later kill's leftover, older than the newest commit: the next sync removes it before anything else
    s3.put_object(Bucket=s3_bucket, Key="half/checkpoint-4/stray.distcp", Body=b"a killed upload")
    assert durable.sync(RunDir(run), url) == [
        f"checkpoint-4: an upload that never committed removed from {url}"
    ]
    shutil.rmtree(run / "checkpoint-6")
    assert durable.restore(RunDir(run), url) == f"checkpoint-6 restored from {url}, verified part by part"
    assert not (run / "checkpoint-8").exists()


class _RetentionMidCopy:
    """The real store, but the second file of `victim` sent finds its checkpoint gone: the run's retention
    removes an older checkpoint while a sync copies it."""

    def __init__(self, store: Any, victim: Path) -> None:
        self._store, self._victim, self._sent = store, victim, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def upload_file(self, key: str, path: Path, **kw: Any) -> int:
        if path.is_relative_to(self._victim):
            self._sent += 1
            if self._sent == 2:
                shutil.rmtree(self._victim)
        return int(self._store.upload_file(key, path, **kw))


def test_a_checkpoint_removed_by_retention_while_copied_is_skipped_and_the_next_committed(
    tmp_path: Path, s3_bucket: str
) -> None:
    """A sync copies every local checkpoint the store lacks, oldest first; one that retention removes meanwhile
    ended the sync (FileNotFoundError), so a run saving faster than the store took its checkpoints never had
    one committed there. It is skipped, its part-copy removed, and the newer ones committed."""
    from torchrelay.storage.base import open_store

    run = _run(tmp_path, [2, 4, 6])
    local = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))
    assert len(local) >= 2, local
    url = parse_url(f"s3://{s3_bucket}/retained")
    old = run / f"checkpoint-{local[0]}"
    store = _RetentionMidCopy(open_store(url), old)
    notes = durable.sync(RunDir(run), url, store)
    assert notes[0] == f"{old.name}: removed by the run's retention while it was copied; skipped", notes
    assert notes[1:] == [f"checkpoint-{u} copied to {url}" for u in local[1:]]
    keys = _keys(s3_bucket, "retained/")
    assert not [k for k in keys if k.startswith(f"retained/{old.name}/")], keys
    assert f"retained/checkpoint-6/{INVENTORY}" in keys


def test_a_job_killed_while_uploading_resumes_from_the_store_bit_for_bit(
    example: dict[str, Path], baseline: Path, tmp_path: Path, s3_bucket: str, s3_server: S3Server
) -> None:
    from durable_campaign import keys, run_campaign
    from s3_proxy import FaultProxy, Faults

    run = tmp_path / "run"
    # the job reaches the store through a proxy that holds each upload request 0.2 s (a slow store): a sync
    # takes seconds, so the kills land while part of a checkpoint is in the store and its commit is not. Each
    # update takes at least 0.5 s (the example's pace) and every checkpoint is kept locally (keep: 16), both
    # runtime keys (the same bits): a checkpoint saved every update and removed by retention two updates later
    # is gone before a sync of that store has copied it (skipped: no commit in the store before the run's end)
    sets = {"save_every": 1, "keep": 16, "params.min_update_s": 0.5}
    with FaultProxy(s3_server.endpoint, Faults(delay_s=0.2, match=r"^PUT ")) as proxy:
        out = run_campaign(
            example["code"], example["config"], run, bucket=s3_bucket, prefix="job/", endpoint=proxy.endpoint,
            kills=3, lose_after=2, sets=sets, fallback_s=10.0,
        )  # fmt: skip
    assert out.returncode == 0, out.output[-4000:]
    assert out.kills == 3 and out.lost_at is not None, out
    assert sum(bool(k["uploading"]) for k in out.kill_moments) >= 2, out.kill_moments
    lost_at = out.lost_at
    restored = f"checkpoint-{lost_at} restored from s3://{s3_bucket}/job, verified part by part"
    assert any(restored in seg.get("notes", []) for seg in segments(run)), segments(run)
    assert assert_same_final_state(baseline, run, 16) > 10
    assert_same_logs(baseline, run)
    assert f"job/checkpoint-16/{INVENTORY}" in keys(s3_bucket, "job/"), (
        "the last checkpoint reached the store"
    )
    lease = json.loads(boto3.client("s3", endpoint_url=s3_server.endpoint).get_object(
        Bucket=s3_bucket, Key="job/WRITER.json")["Body"].read())  # fmt: skip
    assert lease["run_dir"] == str(run)
    secret = s3_server.secret_key.encode()
    leaked = [p for p in run.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert not leaked and secret not in out.output.encode(), f"the secret is in {leaked}"
