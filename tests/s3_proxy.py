"""A tiny HTTP proxy in front of the real S3 server that injects faults: 503 SlowDown answers, bodies cut short,
a listing with a foreign key, or a callback run before a request is forwarded (to change the store between a
listing and a read). The client under test talks to the proxy as it would to the store; the store is real.

Signatures stay valid: SigV4 signs the Host header, which the proxy forwards unchanged, and the server checks it
against what the client signed (the proxy's address)."""

from __future__ import annotations

import http.client
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@dataclass
class Faults:
    """What to inject; each counter is decremented as its fault is spent. `match`: a regex on "METHOD path?query"."""

    fail_503: int = 0  # answer this many matching requests with 503 SlowDown
    truncate: int = 0  # cut this many matching GET bodies to half (the Content-Length still says the whole)
    match: str = ".*"
    list_extra_key: str | None = None  # inserted into every ListObjectsV2 answer
    delay_s: float = 0.0  # every matching request waits this long before it is forwarded (a slow store)
    before: Callable[[str, str], None] | None = None  # (method, path) -> None, run before forwarding
    seen: list[str] = field(default_factory=list)


class FaultProxy:
    """`with FaultProxy(upstream) as proxy:` ... `proxy.endpoint`; `proxy.faults` may be changed at any time."""

    def __init__(self, upstream: str, faults: Faults | None = None) -> None:
        self.upstream = urlsplit(upstream)
        self.faults = faults or Faults()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _take(self, name: str, line: str) -> bool:
        with self.lock:
            f = self.faults
            if getattr(f, name) > 0 and re.search(f.match, line):
                setattr(f, name, getattr(f, name) - 1)
                return True
            return False

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        line = f"{h.command} {h.path}"
        self.faults.seen.append(line)
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = _read_chunked(h)
        if self.faults.before is not None:
            self.faults.before(h.command, h.path)
        if self.faults.delay_s and re.search(self.faults.match, line):
            time.sleep(self.faults.delay_s)
        if self._take("fail_503", line):
            payload = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>injected</Message></Error>'
            h.send_response(503)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() != "transfer-encoding"}
        if body or h.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn.request(h.command, h.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        extra = self.faults.list_extra_key
        if extra and h.command == "GET" and "list-type=2" in h.path and resp.status == 200:
            data = data.replace(
                b"<Contents>",
                f"<Contents><Key>{extra}</Key><Size>3</Size><ETag>&quot;x&quot;</ETag></Contents><Contents>".encode(),
                1,
            )
        cut = h.command == "GET" and resp.status in (200, 206) and self._take("truncate", line)
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                h.send_header(k, v)
        # a HEAD's answer has no body but the object's length
        h.send_header(
            "Content-Length", resp.getheader("Content-Length", "0") if h.command == "HEAD" else str(len(data))
        )
        if cut:
            h.send_header("Connection", "close")
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data[: len(data) // 2] if cut else data)
        if cut:
            h.close_connection = True


def _read_chunked(h: BaseHTTPRequestHandler) -> bytes:
    out = bytearray()
    while True:
        size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += h.rfile.read(size)
        h.rfile.readline()
