"""SIGKILLs of a whole 2-rank job while its durable-tier sync runs (at once where the store holds part of a
checkpoint not committed yet, else at a random moment into the sync process), the local checkpoints lost once along the way, then a launch to
the end. Shared by tests/test_durable_tier.py (3 kills) and benchmarks/bench_durable_kills.py (20 and more)."""

from __future__ import annotations

import functools
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

from helpers import launch_bg
from kill_campaign import kill_job
from torchrelay.checkpoint.inventory import INVENTORY
from torchrelay.storage import durable
from torchrelay.util.proctree import Tree


@dataclass
class Outcome:
    kills: int = 0
    lost_at: int | None = None  # the store's newest committed checkpoint when the local ones were deleted
    launches: int = 0
    output: str = ""  # the last launch's
    returncode: int | None = None
    seconds: float = 0.0
    kill_moments: list[dict[str, Any]] = field(default_factory=list)


@functools.cache
def _client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint)  # one per endpoint: making one costs 50+ ms at load


def keys(bucket: str, prefix: str) -> list[str]:
    s3 = _client(os.environ["TORCHRELAY_S3_ENDPOINT"])
    found, token = [], None
    while True:
        kw: dict[str, Any] = {
            "Bucket": bucket,
            "Prefix": prefix,
            **({"ContinuationToken": token} if token else {}),
        }
        page = s3.list_objects_v2(**kw)
        found += [o["Key"] for o in page.get("Contents", [])]
        token = page.get("NextContinuationToken")
        if not token:
            return sorted(found)


def committed(bucket: str, prefix: str) -> list[int]:
    return sorted(
        int(k.split("/")[-2].split("-")[1]) for k in keys(bucket, prefix) if k.endswith("/" + INVENTORY)
    )


def uploading(bucket: str, prefix: str) -> list[str]:
    """The checkpoint-N/ under `prefix` that have objects but no COMPLETE.json yet."""
    found = keys(bucket, prefix)
    started = {k[len(prefix) :].split("/")[0] for k in found if k[len(prefix) :].count("/") >= 1}
    return sorted(
        n for n in started if n.startswith("checkpoint-") and f"{prefix}{n}/{INVENTORY}" not in found
    )


def sync_alive(tree: Tree) -> bool:
    tree.collect()
    for proc in tree.alive():
        try:
            if durable.MODULE in " ".join(proc.cmdline()):
                return True
        except Exception:  # noqa: BLE001, S112 - a process that just ended
            continue
    return False


def run_campaign(
    code: Path,
    config: Path,
    run: Path,
    *,
    bucket: str,
    prefix: str,
    endpoint: str,
    kills: int,
    lose_after: int,
    sets: dict[str, Any],
    launch_timeout: float = 240,
    fallback_s: float = 1.0,
) -> Outcome:
    """Launch, kill during an upload, relaunch ... `kills` times (after the first, only once some checkpoint is
    committed: the run must get somewhere), deleting every local checkpoint after kill `lose_after`; then one
    launch to its end. A kill lands where an upload of this launch is seen in the store, else up to `fallback_s`
    seconds into a sync process."""
    env = {"TORCHRELAY_DURABLE": f"s3://{bucket}/{prefix.rstrip('/')}", "TORCHRELAY_S3_ENDPOINT": endpoint}
    out = Outcome()
    started = time.perf_counter()
    while True:
        proc = launch_bg(code, run, config=config, sets=sets, env=env)
        out.launches += 1
        tree = Tree(proc.pid)
        deadline = time.time() + launch_timeout
        partial: list[str] = []
        stale = set(uploading(bucket, prefix))  # left by earlier kills: not this launch's uploads
        seen: float | None = None  # when this launch's sync process was first seen alive
        delay = random.uniform(0.0, fallback_s)
        # killed while a sync process runs: at once where the store holds part of an uncommitted checkpoint, else
        # after a random delay into the sync (after the first kill, only once some checkpoint is committed there:
        # the run must get somewhere)
        while proc.poll() is None and time.time() < deadline and out.kills < kills:
            if sync_alive(tree) and (out.kills == 0 or committed(bucket, prefix)):
                seen = seen if seen is not None else time.time()
                partial = [n for n in uploading(bucket, prefix) if n not in stale]
                if partial or time.time() - seen >= delay:
                    break
            else:
                seen = None
            time.sleep(0.005)
        if proc.poll() is not None or time.time() >= deadline or out.kills >= kills:
            out.output = proc.communicate(timeout=launch_timeout)[0]
            out.returncode = proc.returncode
            break
        kill_job(tree, proc)  # the sync process dies with the job
        out.kills += 1
        out.kill_moments.append({"launch": out.launches, "uploading": partial})
        if out.kills == lose_after:
            out.lost_at = max(committed(bucket, prefix), default=None)  # none yet at a first kill
            for ckpt in run.glob("checkpoint-*"):
                shutil.rmtree(ckpt)
    out.seconds = time.perf_counter() - started
    return out
