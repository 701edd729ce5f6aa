"""One measurement of torchrelay's store transfers against boto3's own managed transfer (s3transfer) of the same
bytes, on the same server in the same process: the upload of a bundle's files (torchrelay: multipart 16 MiB parts,
each part's SHA-256 state recorded as it is read; plain: `upload_file`) and the verified download (torchrelay:
ranged 16 MiB GETs, each part checked against its state before it is written; plain: `download_file`, ranged GETs,
nothing checked). Shared by benchmarks/bench_s3.py and its toy-size test in tests/test_object_store.py."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20


def measure(
    endpoint: str, bucket: str, work: Path, *, size: int, jobs: int, rounds: int = 1
) -> dict[str, Any]:
    """Seconds (best of `rounds`) and GB/s of each of the four transfers of one `size`-byte file; the process's
    environment must hold the server's credentials (the AWS chain)."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    from torchrelay.handoff.store_pack import upload_files
    from torchrelay.handoff.store_read import read_store_bundle
    from torchrelay.storage.base import open_store
    from torchrelay.storage.url import parse_url
    from torchrelay.util.sha256_parts import PART_BYTES
    from torchrelay.util.sums import SUMS_NAME, SumEntry, format_sums

    folder = work / "bundle"
    folder.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    (folder / "shard.bin").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    del data
    entries = [SumEntry("shard.bin", digest)]
    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(
        multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=jobs, use_threads=True
    )
    times: dict[str, list[float]] = {
        "upload_relay": [],
        "upload_plain": [],
        "download_relay": [],
        "download_plain_hashed": [],
        "download_plain": [],
    }
    for r in range(rounds):
        url = parse_url(f"s3://{bucket}/relay-{r}")
        store = open_store(url, jobs=jobs)
        t = time.perf_counter()
        upload_files(store, url, folder, entries, jobs=jobs, on_bytes=None)
        store.put_if_absent(url.key(SUMS_NAME), format_sums(entries).encode())
        times["upload_relay"].append(time.perf_counter() - t)

        t = time.perf_counter()
        client.upload_file(str(folder / "shard.bin"), bucket, f"plain-{r}/shard.bin", Config=config)
        times["upload_plain"].append(time.perf_counter() - t)

        down = work / f"down-{r}"
        t = time.perf_counter()
        report = read_store_bundle(store, url, jobs=jobs, dest=down)
        times["download_relay"].append(time.perf_counter() - t)
        assert report.ok, report.problems
        shutil.rmtree(down)

        plain = work / f"plain-{r}.bin"
        t = time.perf_counter()
        client.download_file(bucket, f"plain-{r}/shard.bin", str(plain), Config=config)
        times["download_plain"].append(time.perf_counter() - t)
        assert plain.stat().st_size == size
        plain.unlink()

        # the plain download, then its SHA-256 (what checking it against SHA256SUMS afterwards costs)
        t = time.perf_counter()
        client.download_file(bucket, f"plain-{r}/shard.bin", str(plain), Config=config)
        with open(plain, "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == digest
        times["download_plain_hashed"].append(time.perf_counter() - t)
        plain.unlink()
    best = {k: min(v) for k, v in times.items()}
    return {
        "bytes": size,
        "jobs": jobs,
        "rounds": rounds,
        **{f"{k}_s": round(v, 3) for k, v in best.items()},
        **{f"{k}_gbps": round(size / v / 1e9, 3) for k, v in best.items()},
    }
