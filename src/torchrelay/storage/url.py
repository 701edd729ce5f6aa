"""Store URLs (`s3://bucket/prefix`): parsed strictly, and never taken for a local path."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchrelay.errors import ConfigError, UnsafeInput

SCHEMES = ("s3",)  # the stores torchrelay has a backend for
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# S3's bucket naming rules (3-63 characters, lower case, digits, dots and hyphens, a letter or digit at each end)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def scheme_of(text: str) -> str | None:
    """The `scheme` of a `scheme://...` argument, None for anything else (a path)."""
    match = _SCHEME.match(text)
    return match.group(1).lower() if match else None


@dataclass(frozen=True, slots=True)
class StoreURL:
    """`s3://bucket/prefix`: the prefix without leading or trailing slashes ("" for the bucket's root)."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, rel: str) -> str:
        """The object key of `rel` (a bundle-relative path) under this prefix."""
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def rel(self, key: str) -> str:
        """The bundle-relative path of a key listed under this prefix."""
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def child(self, rel: str) -> str:
        """The URL of one object, for messages."""
        return f"{self}/{rel}"


def parse_url(text: str) -> StoreURL:
    """A store URL, or one line saying what is wrong with it."""
    scheme = scheme_of(text)
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{text!r}: not a store URL torchrelay can use",
            hint=f"use s3://BUCKET/PREFIX ({', '.join(SCHEMES)})",
        )
    rest = text[len(scheme) + 3 :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise ConfigError(
            f"{text}: {bucket!r} is not a bucket name",
            hint="a bucket name has 3-63 characters: lower-case letters, digits, dots and hyphens",
        )
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 or c == "\\" for c in prefix):
        raise UnsafeInput(
            f"{text}: the prefix has an empty, '.' or '..' part or a control character",
            hint="name the prefix plainly: s3://BUCKET/a/b",
        )
    return StoreURL(scheme, bucket, prefix)


def refuse_url(text: str, what: str, supported: str = "") -> None:
    """Refuse `text` when it is a `scheme://` URL where `what` must be a local path (one line, exit 2)."""
    scheme = scheme_of(text)
    if scheme is not None:
        raise ConfigError(
            f"{what} {text!r} is a {scheme}:// URL, not a local path",
            hint=supported or "pass a local path; no store URL is read or written here",
        )
