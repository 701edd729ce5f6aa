"""Benchmark the object-store transfers against boto3's own managed transfer of the same bytes, same run, same
server: SeaweedFS on 127.0.0.1 (tests/s3_server.py), one file of --mib MiB.

- upload: torchrelay's (multipart 16 MiB parts, each part's SHA-256 state recorded as it is read, then the commit
  object) vs `boto3 upload_file` (s3transfer multipart, 16 MiB parts, same concurrency, nothing hashed);
- download: torchrelay's verified download (ranged 16 MiB GETs, each part checked against its state before it is
  written) vs `boto3 download_file` (ranged GETs, nothing checked).

    PYTHONPATH=src:tests .venv/bin/python benchmarks/bench_s3.py --mib 512 --jobs 8 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import boto3
from benchlib import print_stamped

import s3_server
from s3_measure import measure


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        server = s3_server.start(Path(tmp) / "server")
        try:
            os.environ.update(server.env())
            boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket="bench")
            result = measure(
                server.endpoint,
                "bench",
                Path(tmp) / "work",
                size=args.mib << 20,
                jobs=args.jobs,
                rounds=args.rounds,
            )
        finally:
            s3_server.stop(server)
    print_stamped(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
