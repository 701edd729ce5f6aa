"""The interface of an object store backend: what the bundle and checkpoint code may ask of any store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torchrelay.storage.url import StoreURL


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: its key, size and ETag (the version a later conditional read insists on)."""

    key: str
    size: int
    etag: str


class ObjectStore(Protocol):
    """A bucket of one store, seen through the operations torchrelay needs; every failure is a RelayError whose
    one line names the URL (never a credential) and what to do."""

    url: StoreURL  # the bucket and prefix this store was opened for

    def check_bucket(self) -> None:
        """Raise PathError when the bucket is missing, ConfigError when the credentials are refused."""

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order (all pages)."""

    def get_range(self, key: str, start: int, length: int, *, etag: str | None = None) -> bytes:
        """`length` bytes from `start` (fewer only at the object's end); with `etag`: refused when the object
        was replaced since it was listed. A short or broken body raises StoreError after bounded retries."""

    def get(self, key: str, limit: int) -> bytes | None:
        """A small object whole (None when absent); refused when larger than `limit`."""

    def put(self, key: str, data: bytes) -> None:
        """Write a small object (replacing one)."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write a small object only where none is: the commit of a writer (False: one was already there)."""

    def upload_file(
        self, key: str, path: Path, *, part_bytes: int, on_part: Callable[[bytes], None] | None = None
    ) -> int:
        """Upload one file in `part_bytes` parts (multipart above one part), each part passed to `on_part` in
        order as it is read; returns the bytes sent."""

    def delete(self, keys: list[str]) -> None:
        """Delete these objects (absent ones are no error)."""


def open_store(url: StoreURL, *, jobs: int | None = None) -> ObjectStore:
    """The backend of `url`'s scheme, opened for its bucket (credentials and endpoint from the environment)."""
    from torchrelay.storage.s3 import S3Store

    try:
        import boto3  # noqa: F401 - the backend's client; its absence is said here, in one line
    except ImportError as exc:  # boto3 is the `s3` extra's
        from torchrelay.errors import ConfigError

        raise ConfigError(
            f"{url}: s3:// needs boto3, which is not installed ({exc.name})",
            hint="pip install 'torchrelay[s3]'",
        ) from None
    return S3Store(url, jobs=jobs or 8)
