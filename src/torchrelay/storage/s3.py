"""The S3 backend (AWS or any S3-compatible store) through boto3: the client chosen by measurement
(benchmarks/RESULTS.md, bench_s3.py), credentials from the standard AWS chain, the endpoint from
TORCHRELAY_S3_ENDPOINT or AWS_ENDPOINT_URL. No message ever holds a credential: errors are built here from the
error code and the URL only."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torchrelay.config import envvars
from torchrelay.errors import ConfigError, PathError, RelayError, StoreError
from torchrelay.storage.base import ObjectInfo
from torchrelay.storage.url import StoreURL

_CREDENTIALS = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
    "AuthorizationHeaderMalformed", "InvalidClientTokenId", "UnrecognizedClientException",
}  # fmt: skip
_CHANGED = {"PreconditionFailed", "412"}
_CREDENTIAL_HINT = "check the AWS credential chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE and ~/.aws/credentials"


class ObjectChanged(StoreError):
    """An object was replaced between the listing and a read of it."""


def _backoff(attempt: int) -> float:
    """Seconds before retry `attempt` (1, 2, ...): exponential with full jitter, capped at 5 s."""
    return random.uniform(0, min(5.0, 0.1 * 2**attempt))


class S3Store:
    """One bucket of an S3 store (`url`: the bucket and the prefix it was opened for)."""

    def __init__(self, url: StoreURL, *, jobs: int = 8) -> None:
        import boto3
        from botocore.config import Config

        self.url = url
        self.jobs = max(1, jobs)
        self.attempts = max(1, int(envvars.S3_ATTEMPTS.get()))
        self.endpoint = envvars.S3_ENDPOINT.get()  # None: boto3 reads AWS_ENDPOINT_URL, or AWS's own
        session = boto3.session.Session()
        config = Config(
            # botocore's "standard" retries: throttling, 5xx and broken connections, exponential backoff, bounded
            retries={"mode": "standard", "max_attempts": self.attempts},
            max_pool_connections=2 * self.jobs,
            connect_timeout=10,
            read_timeout=60,
            # every byte is proven by its SHA-256 state on arrival (and SHA256SUMS): no second checksum per request
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if self.endpoint else None,
        )
        self.client: Any = session.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=session.region_name or "us-east-1",
            config=config,
        )

    # -- errors ----------------------------------------------------------------------------------------------
    def _error(self, exc: BaseException, where: str, doing: str) -> RelayError:
        """One line naming `where` (a URL) and what to do; never the exception's text (it may quote a request)."""
        from botocore import exceptions as bx

        if isinstance(exc, RelayError):
            return exc
        if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
            return ConfigError(f"{where}: no AWS credentials found to {doing}", hint=_CREDENTIAL_HINT)
        if isinstance(exc, bx.ProfileNotFound):
            return ConfigError(
                f"{where}: the AWS profile named by AWS_PROFILE does not exist", hint=_CREDENTIAL_HINT
            )
        if isinstance(exc, bx.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", "?"))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket" or (code in ("404", "NotFound") and doing == "open the bucket"):
                return PathError(
                    f"s3://{self.url.bucket}: no such bucket (at {self._where()})",
                    hint="create the bucket first, or check its name and TORCHRELAY_S3_ENDPOINT",
                )
            if code in _CREDENTIALS or status == 403:
                return ConfigError(
                    f"{where}: the store refused the credentials ({code})", hint=_CREDENTIAL_HINT
                )
            if code in _CHANGED:
                return ObjectChanged(
                    f"{where}: the object changed while it was read (its ETag is not the listed one)",
                    hint="another writer is using this prefix; wait until it has finished, then try again",
                )
            return StoreError(
                f"{where}: the store failed to {doing}: {code} (HTTP {status}) after {self.attempts} attempt(s)",
                hint="the store is overloaded or failing; try again later (TORCHRELAY_S3_ATTEMPTS sets the retries)",
            )
        if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError):
            return StoreError(
                f"{where}: cannot reach the store at {self._where()}",
                hint="check TORCHRELAY_S3_ENDPOINT (or AWS_ENDPOINT_URL) and that the store is up",
            )
        if isinstance(exc, bx.BotoCoreError | OSError):
            return StoreError(
                f"{where}: the connection to {self._where()} failed to {doing} ({type(exc).__name__})",
                hint="try again; check the network and the store",
            )
        return StoreError(f"{where}: {doing} failed ({type(exc).__name__})")

    def _where(self) -> str:
        return self.endpoint or "AWS S3"

    def _call(self, where: str, doing: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - every client failure becomes one line (self._error)
            raise self._error(exc, where, doing) from None

    # -- the interface (storage/base.py) ---------------------------------------------------------------------
    def check_bucket(self) -> None:
        self._call(
            f"s3://{self.url.bucket}", "open the bucket", self.client.head_bucket, Bucket=self.url.bucket
        )

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        where = f"s3://{self.url.bucket}/{prefix}"
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(where, "list the objects", self.client.list_objects_v2, **kwargs)
            for item in page.get("Contents", []):
                found.append(ObjectInfo(item["Key"], int(item["Size"]), str(item.get("ETag", ""))))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                break
        found.sort(key=lambda o: o.key)
        keys = [o.key for o in found]
        if len(set(keys)) != len(keys):
            raise ObjectChanged(
                f"{where}: the listing changed between its pages (a key came twice)",
                hint="another writer is using this prefix; wait until it has finished, then try again",
            )
        return found

    def get_range(self, key: str, start: int, length: int, *, etag: str | None = None) -> bytes:
        from botocore import exceptions as bx

        where = f"s3://{self.url.bucket}/{key}"
        kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Key": key}
        if length > 0:
            kwargs["Range"] = f"bytes={start}-{start + length - 1}"
        if etag:
            kwargs["IfMatch"] = etag
        for attempt in range(1, self.attempts + 1):
            cut = ""
            try:
                response = self.client.get_object(**kwargs)
                data = response["Body"].read()
            except (bx.IncompleteReadError, bx.ResponseStreamingError, bx.ReadTimeoutError) as exc:
                cut = type(exc).__name__  # a body cut short: read again (botocore retries only the request)
            except Exception as exc:  # noqa: BLE001 - one line (self._error)
                raise self._error(exc, where, f"read bytes {start}-{start + length - 1}") from None
            else:
                if len(data) == length or length == 0:
                    return bytes(data)
                cut = f"{len(data)} of {length} bytes"
            if attempt < self.attempts:
                time.sleep(_backoff(attempt))
        raise StoreError(
            f"{where}: the object's bytes {start}-{start + length - 1} arrived cut short ({cut}) "
            f"{self.attempts} time(s)",
            hint="the store or the network is failing, or the object is truncated; try again later, "
            "or upload the bundle again",
        )

    def get(self, key: str, limit: int) -> bytes | None:
        where = f"s3://{self.url.bucket}/{key}"
        try:
            head = self.client.head_object(Bucket=self.url.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 - absent is an answer; the rest one line
            from botocore import exceptions as bx

            if isinstance(exc, bx.ClientError) and str(exc.response.get("Error", {}).get("Code")) in (
                "404",
                "NoSuchKey",
                "NotFound",
            ):
                return None
            raise self._error(exc, where, "read the object") from None
        size = int(head["ContentLength"])
        if size > limit:
            raise StoreError(f"{where}: {size} bytes, more than the {limit} such an object may have")
        return self.get_range(key, 0, size, etag=str(head.get("ETag") or "") or None) if size else b""

    def put(self, key: str, data: bytes) -> None:
        self._call(
            f"s3://{self.url.bucket}/{key}", "write the object", self.client.put_object,
            Bucket=self.url.bucket, Key=key, Body=data,
        )  # fmt: skip

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore import exceptions as bx

        try:
            self.client.put_object(Bucket=self.url.bucket, Key=key, Body=data, IfNoneMatch="*")
        except bx.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code"))
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            raise self._error(exc, f"s3://{self.url.bucket}/{key}", "write the object") from None
        except Exception as exc:  # noqa: BLE001 - one line
            raise self._error(exc, f"s3://{self.url.bucket}/{key}", "write the object") from None
        return True

    def upload_file(
        self, key: str, path: Path, *, part_bytes: int, on_part: Callable[[bytes], None] | None = None
    ) -> int:
        where = f"s3://{self.url.bucket}/{key}"
        with open(path, "rb") as f:
            first = f.read(part_bytes)
            rest = f.read(1)
            if not rest:  # one part: one PUT
                if on_part:
                    on_part(first)
                self.put(key, first)
                return len(first)
            f.seek(0)
            created = self._call(
                where, "start a multipart upload", self.client.create_multipart_upload,
                Bucket=self.url.bucket, Key=key,
            )  # fmt: skip
            upload_id = created["UploadId"]
            try:
                sent = self._parts(where, key, upload_id, f, part_bytes, on_part)
            except BaseException:
                # best effort: an aborted upload's parts are freed, a failed abort is the bucket's lifecycle's;
                # the first failure is the one to report
                with contextlib.suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=key, UploadId=upload_id)
                raise
        return sent

    def _parts(
        self,
        where: str,
        key: str,
        upload_id: str,
        f: Any,
        part_bytes: int,
        on_part: Callable[[bytes], None] | None,
    ) -> int:
        """Read, hand to `on_part` and upload the parts in order, `jobs` of them in flight (memory: jobs + 1
        parts), then complete the upload with every part's ETag."""
        slots = threading.BoundedSemaphore(self.jobs + 1)
        futures: list[Future[dict[str, Any]]] = []
        sent = 0

        def one(number: int, data: bytes) -> dict[str, Any]:
            try:
                out = self._call(
                    where, f"upload part {number}", self.client.upload_part,
                    Bucket=self.url.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data,
                )  # fmt: skip
                return {"PartNumber": number, "ETag": out["ETag"]}
            finally:
                slots.release()

        with ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="s3-upload") as pool:
            number = 0
            while True:
                slots.acquire()
                if any(fu.done() and fu.exception() for fu in futures):
                    slots.release()
                    break
                data = f.read(part_bytes)
                if not data:
                    slots.release()
                    break
                number += 1
                sent += len(data)
                if on_part:
                    on_part(data)
                futures.append(pool.submit(one, number, data))
            parts = [fu.result() for fu in futures]  # the first failure raises here
        self._call(
            where, "complete the multipart upload", self.client.complete_multipart_upload,
            Bucket=self.url.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts},
        )  # fmt: skip
        return sent

    def delete(self, keys: list[str]) -> None:
        for at in range(0, len(keys), 1000):  # S3's limit per DeleteObjects request
            batch = [{"Key": k} for k in keys[at : at + 1000]]
            out = self._call(
                f"s3://{self.url.bucket}/{self.url.prefix}", "delete objects", self.client.delete_objects,
                Bucket=self.url.bucket, Delete={"Objects": batch, "Quiet": True},
            )  # fmt: skip
            if out.get("Errors"):
                first = out["Errors"][0]
                raise StoreError(
                    f"s3://{self.url.bucket}/{first.get('Key')}: the store refused to delete it ({first.get('Code')})",
                    hint="check the credentials' delete permission",
                )
